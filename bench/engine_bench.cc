// End-to-end engine benchmark (issue 2's performance table). Prints each figure next to a
// reference measured in the same run: a memory-bandwidth probe (triad over 1 GiB arrays)
// and the byte bound it implies for decode.
//
//   engine_bench --model DIR [--threads N] [--quick] [--only-batch N | --only-prefill N (for profiling)]

#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench/bf16_peak.h"
#include "bench/bench_util.h"
#include "common/engine/engine.h"
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

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir;
  int threads = 0;
  bool quick = false;
  int only_batch = 0;    // profile one batched run only
  int only_prefill = 0;  // profile prompts of this length only
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--model") && i + 1 < argc) model_dir = argv[++i];
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--only-batch") && i + 1 < argc) only_batch = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only-prefill") && i + 1 < argc) only_prefill = std::atoi(argv[++i]);
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
