// End-to-end engine benchmark (issue 2's performance table). Prints each figure next to a
// reference measured in the same run: a memory-bandwidth probe (triad over 1 GiB arrays)
// and the byte bound it implies for decode.
//
//   engine_bench --model DIR [--threads N] [--quick] [--only-batch N | --only-prefill N (for profiling)]
//   engine_bench --model DIR --kv-compare CTX [--seqs 64] [--steps 24]
//     decode tok/s with f32, bf16 and fp8 KV at SEQS sequences of CTX-token contexts (issue 37),
//     the engines' decode steps alternating; attention timed alone; then how many sequences the
//     scheduler admits into one fixed KV budget at each dtype (--steps 0: attention only).

#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bf16_peak.h"
#include "bench/bench_util.h"
#include "common/engine/engine.h"
#include "common/kernels/cpu/attention.h"
#include "common/kv/kv_cache.h"
#include "common/model/model.h"

namespace {

using preft::bench::Clock;
using preft::bench::PeakRssMiB;
using preft::bench::Seconds;
using preft::bench::TriadGBps;

preft::engine::Request MakeRequest(int i, int prompt_len, int new_tokens, int32_t vocab) {
  preft::engine::Request r;
  r.id = "bench-" + std::to_string(i);
  for (int t = 0; t < prompt_len; ++t) r.prompt_ids.push_back((t * 7919 + i * 104729) % (vocab - 1000));
  r.sampling.max_tokens = new_tokens;
  r.sampling.ignore_eos = true;
  return r;
}

struct DecodeResult {
  double prefill_tokens_per_s = 0;  // over steps that carried prompt tokens
  double decode_tokens_per_s = 0;   // over steps of decode rows only
  double e2e_tokens_per_s = 0;      // generated tokens / wall time
};

DecodeResult RunBatch(preft::model::Model* model, int concurrency, int prompt_len, int new_tokens,
                      int64_t kv_blocks, int64_t batch_tokens) {
  preft::engine::EngineOptions o;
  o.kv_blocks = kv_blocks;
  o.scheduler.max_batch_tokens = batch_tokens;
  auto eng = preft::engine::Engine::Create(model, nullptr, o).value();
  for (int i = 0; i < concurrency; ++i)
    (void)eng->Add(MakeRequest(i, prompt_len, new_tokens, model->config().vocab_size));
  double prefill_s = 0, decode_s = 0;
  int64_t prefill_tok = 0, decode_tok = 0;
  const auto start = Clock::now();
  while (eng->HasWork()) {
    const int64_t p0 = eng->stats().prompt_tokens, g0 = eng->stats().generated_tokens;
    auto t0 = Clock::now();
    if (!eng->Step().ok()) break;
    const double s = Seconds(t0, Clock::now());
    const int64_t dp = eng->stats().prompt_tokens - p0, dg = eng->stats().generated_tokens - g0;
    if (dp > 0) {
      prefill_s += s;
      prefill_tok += dp;
    } else {
      decode_s += s;
      decode_tok += dg;
    }
  }
  DecodeResult r;
  r.e2e_tokens_per_s = eng->stats().generated_tokens / Seconds(start, Clock::now());
  r.prefill_tokens_per_s = prefill_s > 0 ? prefill_tok / prefill_s : 0;
  r.decode_tokens_per_s = decode_s > 0 ? decode_tok / decode_s : 0;
  return r;
}

// One decode step's attention alone (every layer's worth: the same layer timed `layers` times)
// over `seqs` sequences of `ctx` tokens in a cache of `dtype` holding random values, in
// seconds (median of 5): how much of a decode step the KV's bytes can move.
double AttentionStepSeconds(const preft::model::ModelConfig& c, int seqs, int ctx,
                            preft::kv::KvDtype dtype) {
  const int64_t bt = 16, per_seq = (ctx + bt - 1) / bt;
  preft::kv::KvCacheShape shape{1, seqs * per_seq, bt, c.num_kv_heads, c.head_dim, dtype};
  auto cache = preft::kv::KvCache::Create(shape).value();
  std::mt19937 rng(5);
  if (dtype == preft::kv::KvDtype::kFp8E4M3) {  // e4m3 codes of 0.25 to 0.5
    for (size_t i = 0; i < cache->bytes(); ++i) {
      cache->layer_data(0)[i] = static_cast<std::byte>(0x28 + (rng() & 7));
    }
  } else {
    for (size_t i = 0; i < cache->bytes(); i += 2) {  // small finite values as f32 or bf16
      const uint16_t bits = 0x3c00 + (rng() & 0x3ff);
      std::memcpy(cache->layer_data(0) + i, &bits, 2);
    }
  }
  std::vector<int32_t> table(seqs * per_seq);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<float> q(seqs * c.num_heads * c.head_dim, 0.01f), out(q.size());
  std::vector<preft::kernels::AttentionSeq> s(seqs);
  for (int i = 0; i < seqs; ++i) {
    s[i] = {q.data() + i * c.num_heads * c.head_dim, out.data() + i * c.num_heads * c.head_dim,
            table.data() + i * per_seq, 1, ctx};
  }
  const preft::kernels::PagedKvLayout layout{cache->layer_data(0), shape.block_elements(),
                                             cache->v_offset(),    bt,
                                             c.num_kv_heads,       c.head_dim,
                                             dtype};
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = Clock::now();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      preft::kernels::cpu::PagedAttention(s.data(), seqs, layout, c.num_heads,
                                          1.f / std::sqrt(float(c.head_dim)), 0);
    }
    runs.push_back(Seconds(t0, Clock::now()));
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

// Issue 37's figures: decode at `seqs` x `ctx` with f32, bf16 and fp8 KV, and admissions into
// one KV budget. The engines are prefilled, then their decode steps alternate (`steps` rounds),
// so the host's slow spells (10-20% for minutes on this VM) hit all alike; each figure is the
// median of the rounds' ratios to f32. The prediction beside it comes from attention alone.
int KvCompare(preft::model::Model* model, int ctx, int seqs, int steps) {
  using preft::kv::KvDtype;
  const auto& c = model->config();
  constexpr KvDtype kDtypes[] = {KvDtype::kF32, KvDtype::kBF16, KvDtype::kFp8E4M3};
  constexpr int kN = 3;
  auto name = [](KvDtype d) { return std::string(preft::kv::KvDtypeName(d)); };
  const double kv_f32 = double(seqs) * ctx * model->CacheShape(1).bytes_per_block_all_layers() / 16;
  double att[kN];
  std::printf("attention alone, one decode step (%lld layers, %d x %d):",
              static_cast<long long>(c.num_layers), seqs, ctx);
  for (int i = 0; i < kN; ++i) {
    att[i] = AttentionStepSeconds(c, seqs, ctx, kDtypes[i]);
    const double bytes = kv_f32 * preft::kv::KvDtypeBytes(kDtypes[i]) / 4;
    std::printf(" %s %.1f ms (%.1f GB/s of KV, %.2f of f32's time);", name(kDtypes[i]).c_str(),
                att[i] * 1e3, bytes / att[i] / 1e9, att[i] / att[0]);
  }
  std::printf("\n");
  if (steps <= 0) return 0;
  std::vector<std::unique_ptr<preft::engine::Engine>> engines;
  const int64_t batch_tokens = 2048;
  // Long enough that the first sequences, decoding while the last prefill, still run through
  // the timed steps.
  const int max_tokens = steps + 8 + static_cast<int>(int64_t{seqs} * ctx / batch_tokens);
  for (KvDtype d : kDtypes) {
    preft::engine::EngineOptions o;
    o.kv_blocks = seqs * ((ctx + max_tokens + 15) / 16);
    o.kv_dtype = d;
    o.scheduler.max_batch_tokens = batch_tokens;
    engines.push_back(preft::engine::Engine::Create(model, nullptr, o).value());
    for (int i = 0; i < seqs; ++i) {
      (void)engines.back()->Add(MakeRequest(i, ctx, max_tokens, c.vocab_size));
    }
    // Prefill every prompt: from here on each step is `seqs` decode rows.
    while (engines.back()->stats().prompt_tokens < int64_t{seqs} * ctx) {
      (void)engines.back()->Step();
    }
  }
  std::vector<double> t[kN], ratio[kN];
  for (int s = 0; s < steps; ++s) {
    for (int e = 0; e < kN; ++e) {
      const auto t0 = Clock::now();
      (void)engines[e]->Step();
      t[e].push_back(Seconds(t0, Clock::now()));
    }
    for (int e = 0; e < kN; ++e) ratio[e].push_back(t[0].back() / t[e].back());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  const double step_f32 = median(t[0]);
  std::printf("\n| kv dtype | decode step, %d seqs x %d ctx (median of %d) | tok/s | KV read per "
              "step | attention alone | tok/s / f32's (paired) | predicted |\n"
              "|---|---|---|---|---|---|---|\n",
              seqs, ctx, steps);
  for (int e = 0; e < kN; ++e) {
    const double step = median(t[e]);
    // The f32 step less the attention time this dtype saves.
    const double predicted = step_f32 / (step_f32 - (att[0] - att[e]));
    std::printf("| %s | %.1f ms | %.1f | %.2f GB | %.1f ms | **%.2f** | %.2f |\n",
                name(kDtypes[e]).c_str(), step * 1e3, seqs / step,
                kv_f32 * preft::kv::KvDtypeBytes(kDtypes[e]) / 4 / 1e9, att[e] * 1e3,
                median(ratio[e]), predicted);
  }

  // One budget (64 f32 blocks), every dtype: how many 64-token prompts (4 blocks each) the
  // scheduler admits in one step. Short prompts, so the step's prefill stays cheap; the count
  // depends on blocks alone.
  const int64_t budget = 64 * model->CacheShape(1).bytes_per_block_all_layers();
  std::printf("\n| kv dtype | --kv-bytes | blocks | 64-token prompts admitted at once | ratio |\n"
              "|---|---|---|---|---|\n");
  int64_t admitted_f32 = 0;
  for (KvDtype d : kDtypes) {
    preft::engine::EngineOptions o;
    o.kv_bytes = budget;
    o.kv_dtype = d;
    o.scheduler.max_batch_tokens = 64 * 64;
    auto eng = preft::engine::Engine::Create(model, nullptr, o).value();
    for (int i = 0; i < 64; ++i) (void)eng->Add(MakeRequest(i, 64, 2, c.vocab_size));
    (void)eng->Step();
    const int64_t admitted = eng->num_running();
    if (d == KvDtype::kF32) admitted_f32 = admitted;
    std::printf("| %s | %lld | %lld | %lld | %.2f |\n", name(d).c_str(),
                static_cast<long long>(budget), static_cast<long long>(eng->allocator().num_blocks()),
                static_cast<long long>(admitted), double(admitted) / admitted_f32);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir;
  int threads = 0;
  bool quick = false;
  int only_batch = 0;    // profile one batched run only
  int only_prefill = 0;  // profile prompts of this length only
  int kv_compare = 0;    // issue 37's f32 vs bf16 KV figures at this context length
  int seqs = 64, steps = 24;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--model") && i + 1 < argc) model_dir = argv[++i];
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--only-batch") && i + 1 < argc) only_batch = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only-prefill") && i + 1 < argc) only_prefill = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--kv-compare") && i + 1 < argc) kv_compare = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--seqs") && i + 1 < argc) seqs = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
  }
  if (model_dir.empty()) {
    std::fprintf(stderr, "usage: engine_bench --model DIR [--threads N] [--quick]\n");
    return 2;
  }
  if (threads > 0) omp_set_num_threads(threads);
  std::printf("threads: %d\n", omp_get_max_threads());

  auto loaded = preft::model::Model::Load(model_dir);
  if (!loaded.ok()) {
    std::fprintf(stderr, "engine_bench: %s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  auto model = std::move(loaded).value();
  const double weight_gb = model->weight_bytes() / 1e9;
  const auto shape = model->CacheShape(1);
  const double kv_bytes_per_token = shape.bytes_per_block_all_layers() / 16.0;
  std::printf("model: %s, %.3f GB of weights (%.0f%% in huge pages), KV %.1f KiB/token\n",
              model_dir.c_str(), weight_gb, 100.0 * model->weight_huge_page_bytes() / model->weight_bytes(),
              kv_bytes_per_token / 1024);

  if (kv_compare > 0) return KvCompare(model.get(), kv_compare, seqs, steps);
  if (only_batch > 0) {
    const DecodeResult r = RunBatch(model.get(), only_batch, 128, 64, only_batch * 17, 2048);
    std::printf("%d seqs: prefill %.0f tok/s, decode %.0f tok/s\n", only_batch,
                r.prefill_tokens_per_s, r.decode_tokens_per_s);
    return 0;
  }
  if (only_prefill > 0) {
    for (int round = 0; round < 5; ++round) {
      const DecodeResult r = RunBatch(model.get(), 1, only_prefill, 1, 64, only_prefill);
      std::printf("prefill %d: %.0f tok/s\n", only_prefill, r.prefill_tokens_per_s);
    }
    return 0;
  }
  // Batch 1 is bandwidth-bound: its reference is the triad read right before and right after
  // it (this host's bandwidth moves by a third within a minute); the peak RSS restarts after.
  const double triad_before = TriadGBps();
  const DecodeResult one = RunBatch(model.get(), 1, 16, quick ? 16 : 64, 64, 512);
  const double triad_after = TriadGBps();
  const bool rss_reset = preft::bench::ResetPeakRss();
  const DecodeResult pre = RunBatch(model.get(), 1, 512, 1, 64, 512);
  const int new_tokens = quick ? 32 : 128;
  std::vector<std::pair<int, DecodeResult>> batched;
  for (int conc : {16, 64}) batched.emplace_back(conc, RunBatch(model.get(), conc, 128, new_tokens, conc * 17, 2048));
  // Peak RSS before the bandwidth probe allocates its 3 GiB.
  const long peak = PeakRssMiB();
  const double triad = TriadGBps();
  const preft::bench::Bf16Peak peak_bf16 = preft::bench::MeasureBf16Peak();
  const double peak_tflops = peak_bf16.tflops;
  // Multiply-adds per token in the layers' linears, and in the LM head (decode rows only).
  const auto& c = model->config();
  const double layer_macs =
      c.num_layers * (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim +
                      c.num_heads * c.head_dim * c.hidden_size + 3.0 * c.hidden_size * c.intermediate_size);
  const double head_macs = double(c.hidden_size) * c.vocab_size;
  std::printf("bf16 peak (register-resident %s, all threads): %.2f TFLOP/s\n", peak_bf16.unit, peak_tflops);

  std::printf("\n| figure | value | reference (same run) | ratio | target |\n|---|---|---|---|---|\n");
  const double gbps = one.decode_tokens_per_s * weight_gb;
  const double triad_one = (triad_before + triad_after) / 2;
  std::printf("| decode batch 1 | %.1f tok/s = %.1f GB/s of weights | triad %.1f GB/s (%.1f before, %.1f after) | %.2f | >= 0.70 |\n",
              one.decode_tokens_per_s, gbps, triad_one, triad_before, triad_after, gbps / triad_one);
  const double pre_tflops = pre.prefill_tokens_per_s * 2 * layer_macs / 1e12;
  std::printf("| prefill 512 tokens | %.0f tok/s = %.2f TFLOP/s in linears | bf16 peak %.2f TFLOP/s | %.2f | >= 1000 tok/s |\n",
              pre.prefill_tokens_per_s, pre_tflops, peak_tflops, peak_tflops > 0 ? pre_tflops / peak_tflops : 0);
  for (const auto& [conc, r] : batched) {
    const double bound = triad / weight_gb * conc;  // weights read once per step
    std::printf("| decode %d seqs (128+%d) | %.0f tok/s decode-only, %.0f tok/s end to end | weight-byte bound %.0f tok/s | %.2f | %s |\n",
                conc, new_tokens, r.decode_tokens_per_s, r.e2e_tokens_per_s, bound,
                r.decode_tokens_per_s / bound, conc == 64 ? ">= 400 tok/s" : "-");
  }
  const double dec_tflops = batched.back().second.decode_tokens_per_s * 2 * (layer_macs + head_macs) / 1e12;
  std::printf("| decode 64 seqs, compute | %.2f TFLOP/s in linears and LM head | bf16 peak %.2f TFLOP/s | %.2f | - |\n",
              dec_tflops, peak_tflops, peak_tflops > 0 ? dec_tflops / peak_tflops : 0);
  const double weights_mib = weight_gb * 1e9 / (1 << 20);
  const double kv_mib = 64.0 * 256 * kv_bytes_per_token / (1 << 20);
  if (!rss_reset) std::printf("(peak RSS could not be reset: it includes the triad's arrays)\n");
  std::printf("| peak RSS, 64 seqs x 256 tokens | %ld MiB | weights %.0f MiB + KV %.0f MiB | %.2f | <= 1.20 |\n",
              peak, weights_mib, kv_mib, peak / (weights_mib + kv_mib));
  return 0;
}
