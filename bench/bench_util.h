#pragma once

// Shared by the benchmarks: wall-clock helpers, the memory-bandwidth reference and peak RSS.

#include <algorithm>
#include <chrono>
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
