#pragma once

// Shared by the benchmarks: wall-clock helpers, the memory-bandwidth reference and peak RSS.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace preft::bench {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The middle element (the upper one of an even count); 0 for none.
inline double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// STREAM triad a = b + s*c over 1 GiB arrays; bytes counted as 3 streams (2 reads, 1 write).
inline double TriadGBps() {
  const size_t n = (size_t{1} << 30) / sizeof(float);
  std::vector<float> a(n), b(n, 1.f), c(n, 2.f);
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    auto t0 = Clock::now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
    const double s = Seconds(t0, Clock::now());
    best = std::max(best, 3.0 * n * sizeof(float) / s / 1e9);
  }
  if (a[n / 2] != 2.f) std::printf("triad check failed\n");
  return best;
}

// Memory a benchmark reads plainly.
struct ByteSpan {
  const void* data;
  size_t bytes;
};

// Reads every span once, as fast as this machine reads memory: what streaming those bytes
// costs at this moment without any arithmetic, a reference steadier than the triad on a host
// whose bandwidth swings. The spans' 64-byte lines, in order, are split evenly over the
// threads, and each thread reads its share as four streams in lockstep (its quarters; a core
// of Zen 5 reads ~25% faster from four streams than from one, NOTES step 24), so the bound
// this gives is the tight one; a tail of a few lines per thread is skipped. 32-byte loads,
// xor-folded so they are not elided; returns the fold (also kept in a volatile, so callers
// may drop it).
inline uint64_t PlainRead(const std::vector<ByteSpan>& spans) {
  constexpr int kStreams = 4;
  std::vector<size_t> first_line = {0};  // of each span, counted across the spans
  for (const ByteSpan& s : spans) first_line.push_back(first_line.back() + s.bytes / 64);
  uint64_t fold = 0;
  if (first_line.back() == 0) return fold;
#pragma omp parallel reduction(^ : fold)
  {
    const size_t lines = first_line.back(), t = omp_get_thread_num(), nt = omp_get_num_threads();
    const size_t begin = lines * t / nt, per = (lines * (t + 1) / nt - begin) / kStreams;
    size_t span[kStreams];
    const uint8_t *at[kStreams], *end[kStreams];
    for (int q = 0; q < kStreams; ++q) {  // stream q starts at line begin + q per
      const size_t line = begin + q * per;
      span[q] =
          std::upper_bound(first_line.begin(), first_line.end(), line) - first_line.begin() - 1;
      at[q] = static_cast<const uint8_t*>(spans[span[q]].data) + (line - first_line[span[q]]) * 64;
      end[q] = static_cast<const uint8_t*>(spans[span[q]].data) + spans[span[q]].bytes / 64 * 64;
    }
    __m256i acc[kStreams];
    for (__m256i& a : acc) a = _mm256_setzero_si256();
    for (size_t i = 0; i < per; ++i) {
#pragma GCC unroll 4
      for (int q = 0; q < kStreams; ++q) {
        while (at[q] == end[q]) {  // on into the next span (past any under 64 bytes)
          ++span[q];
          at[q] = static_cast<const uint8_t*>(spans[span[q]].data);
          end[q] = at[q] + spans[span[q]].bytes / 64 * 64;
        }
        const auto* line = reinterpret_cast<const __m256i*>(at[q]);
        acc[q] = _mm256_xor_si256(
            acc[q], _mm256_xor_si256(_mm256_loadu_si256(line), _mm256_loadu_si256(line + 1)));
        at[q] += 64;
      }
    }
    const __m256i a =
        _mm256_xor_si256(_mm256_xor_si256(acc[0], acc[1]), _mm256_xor_si256(acc[2], acc[3]));
    fold ^= static_cast<uint64_t>(_mm256_extract_epi64(a, 0));
  }
  [[maybe_unused]] static volatile uint64_t sink;
  sink = fold;
  return fold;
}

// Resets the peak resident set size (VmHWM) to the current one (Linux >= 4.0), so a probe's
// temporary arrays (the triad's 3 GiB) do not count in a later PeakRssMiB. False if refused.
inline bool ResetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  return static_cast<bool>(f.flush());
}

inline long PeakRssMiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6)) / 1024;
  return -1;
}

}  // namespace preft::bench
