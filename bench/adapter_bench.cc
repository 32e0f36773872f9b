// Adapter serving benchmark (issue 3's performance table): aggregate throughput of 64
// concurrent requests for base only, LoRAP, DiReFTP, all-position LoRA (the multi-LoRA
// baseline) and all-position DiReFT, with N distinct adapters; ratios PreFT / multi-LoRA at
// each N, and the baseline's adapter overhead against its byte-count lower bound (adapter
// bytes read per decode step / triad bandwidth, both measured in this run). The overhead is
// the difference of two step medians; the BGMV's own time inside the multi-LoRA steps
// (Model::adapter_seconds) is reported next to it, so the kernel and what it costs the rest
// of the step can be told apart.
//
//   adapter_bench --model DIR --adapters DIR [--requests 64] [--prompt 128] [--new 128]
//                 [--ns 1,8,64] [--lora-rank 16] [--direft-rank 4] [--repeat 1] [--quick]
// --repeat R runs the whole lockstep set R times (fresh engines each round) and reports each
// figure's median round; the bandwidth is measured before and after every round and the
// highest reading makes the byte bound (the tightest, so the overhead ratio errs high); the
// BGMV's ratio is also printed round by round against that round's own bracketing readings,
// and step by step against a plain read of the same adapter bytes timed right after each
// multi-LoRA decode step (the reference closest in time: the host's bandwidth swings +-25%
// within minutes).
// Adapters are written into --adapters (bf16, PEFT LoRA on all seven projections and DiReFT
// on every layer) when absent.

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_util.h"
#include "common/adapters/adapter_loader.h"
#include "common/adapters/make_adapter.h"
#include "common/engine/engine.h"
#include "common/model/model.h"

namespace {

namespace fs = std::filesystem;
using preft::bench::Clock;
using preft::bench::Median;
using preft::bench::Seconds;
using preft::model::AdapterPositions;
using preft::model::AdapterWeights;

struct RunResult {
  double e2e_tokens_per_s = 0;  // generated tokens / the engine's summed step time
  double decode_step_s = 0;     // median time of full decode-only steps
  double decode_adapter_s = 0;  // median time of those steps' low-rank products (the BGMV)
  // Multi-LoRA only, step by step against a plain read of the step's adapter bytes timed right
  // after it: the medians over those steps of the BGMV / the read and of (the step - the base
  // engine's step of the same index, a few steps earlier in the same lockstep cycle) / the
  // read; the read's median time and its bytes.
  double bgmv_over_read = 0;
  double overhead_over_read = 0;
  double decode_read_s = 0;
  size_t decode_read_bytes = 0;
  int64_t decode_steps = 0;
};

struct Mode {
  std::string name;
  preft::model::AdapterKind kind;
  bool adapter;
  AdapterPositions positions;
};

// One configuration's engine, loaded with its requests, and its step timings.
class Run {
 public:
  Run(preft::model::Model* model,
      const std::vector<std::shared_ptr<const AdapterWeights>>& adapters, const Mode& mode,
      int requests, int prompt_len, int new_tokens, std::vector<preft::bench::ByteSpan> probe = {})
      : requests_(requests), model_(model), probe_(std::move(probe)) {
    for (const preft::bench::ByteSpan& s : probe_) probe_bytes_ += s.bytes;
    preft::engine::EngineOptions o;
    o.kv_blocks = requests * ((prompt_len + new_tokens) / 16 + 2);
    o.scheduler.max_batch_tokens = 512;
    engine_ = preft::engine::Engine::Create(model, nullptr, o).value();
    const int32_t vocab = static_cast<int32_t>(model->config().vocab_size);
    for (int i = 0; i < requests; ++i) {
      preft::engine::Request r;
      r.id = "r" + std::to_string(i);
      for (int t = 0; t < prompt_len; ++t)
        r.prompt_ids.push_back((t * 7919 + i * 104729) % (vocab - 1000));
      r.sampling.max_tokens = new_tokens;
      r.sampling.ignore_eos = true;
      if (mode.adapter) {
        r.adapter.weights = adapters[i % adapters.size()];
        r.adapter.name = "a" + std::to_string(i % adapters.size());
        r.adapter.positions = mode.positions;
      }
      if (!engine_->Add(std::move(r)).ok()) std::abort();
    }
  }

  bool HasWork() const { return engine_->HasWork(); }

  void Step() {
    const int64_t p0 = engine_->stats().prompt_tokens;
    const double a0 = model_->adapter_seconds();
    const auto t0 = Clock::now();
    if (!engine_->Step().ok()) std::abort();
    const double s = Seconds(t0, Clock::now());
    busy_s_ += s;
    if (engine_->stats().prompt_tokens == p0 && engine_->num_running() == requests_) {
      decode_steps_.push_back(s);  // full decode batches only: comparable across modes
      decode_adapter_.push_back(model_->adapter_seconds() - a0);
      if (!probe_.empty()) {
        const auto r0 = Clock::now();
        preft::bench::PlainRead(probe_);
        decode_read_.push_back(Seconds(r0, Clock::now()));
      }
    }
  }

  // `base`: the base-only engine of the same round (same requests, so its steps pair with
  // these one to one), for the overhead against the read.
  RunResult Result(const Run* base = nullptr) {
    RunResult r;
    r.e2e_tokens_per_s = engine_->stats().generated_tokens / busy_s_;
    r.decode_steps = static_cast<int64_t>(decode_steps_.size());
    r.decode_step_s = Median(decode_steps_);  // 0 when no step had the full batch
    r.decode_adapter_s = Median(decode_adapter_);
    std::vector<double> ratio;
    for (size_t i = 0; i < decode_read_.size(); ++i)
      ratio.push_back(decode_adapter_[i] / decode_read_[i]);
    r.bgmv_over_read = Median(ratio);
    ratio.clear();
    const size_t paired =
        base == nullptr ? 0 : std::min(decode_read_.size(), base->decode_steps_.size());
    for (size_t i = 0; i < paired; ++i)
      ratio.push_back((decode_steps_[i] - base->decode_steps_[i]) / decode_read_[i]);
    r.overhead_over_read = Median(ratio);
    r.decode_read_s = Median(decode_read_);
    r.decode_read_bytes = probe_bytes_;
    return r;
  }

 private:
  int requests_;
  preft::model::Model* model_;
  std::unique_ptr<preft::engine::Engine> engine_;
  double busy_s_ = 0;
  std::vector<double> decode_steps_, decode_adapter_, decode_read_;
  std::vector<preft::bench::ByteSpan> probe_;  // adapter bytes to read after each decode step
  size_t probe_bytes_ = 0;
};

// The storage of `adapters`' matrices as spans, neighbouring matrices merged (a compute slot
// is one mapping, so each adapter is about one span).
std::vector<preft::bench::ByteSpan> MatrixSpans(
    const std::vector<std::shared_ptr<const AdapterWeights>>& adapters) {
  std::vector<std::pair<const uint8_t*, const uint8_t*>> pieces;
  auto add = [&](const preft::kernels::MatrixView& m) {
    const auto* p = static_cast<const uint8_t*>(m.data);
    pieces.emplace_back(p, p + m.rows * m.cols * preft::kernels::DTypeSize(m.dtype));
  };
  for (const auto& a : adapters) {
    for (int64_t l = 0; l < a->num_layers(); ++l) {
      for (int p = 0; p < preft::model::kNumProjections; ++p) {
        const preft::model::LowRank& lr = a->lora(l, static_cast<preft::model::Projection>(p));
        if (lr.empty()) continue;
        add(lr.shrink);
        add(lr.expand);
      }
    }
  }
  std::sort(pieces.begin(), pieces.end());
  std::vector<preft::bench::ByteSpan> spans;
  const uint8_t* begin = nullptr;
  const uint8_t* end = nullptr;
  for (const auto& [b, e] : pieces) {
    if (begin != nullptr && b <= end + 64) {  // pieces start on cache lines
      end = std::max(end, e);
      continue;
    }
    if (begin != nullptr) spans.push_back({begin, static_cast<size_t>(end - begin)});
    begin = b;
    end = e;
  }
  if (begin != nullptr) spans.push_back({begin, static_cast<size_t>(end - begin)});
  return spans;
}

std::vector<std::shared_ptr<const AdapterWeights>> LoadAdapters(const preft::model::Model& model,
                                                                const std::string& root,
                                                                preft::model::AdapterKind kind,
                                                                int rank, int n) {
  std::vector<std::shared_ptr<const AdapterWeights>> out;
  preft::adapters::LoadOptions load;
  load.dtype = model.weight_dtype();
  load.cpu_layout = true;  // as a CPU worker's store loads them
  for (int i = 0; i < n; ++i) {
    const std::string dir = root + "/" + preft::model::AdapterKindName(kind) + "-r" +
                            std::to_string(rank) + "-" + std::to_string(i);
    if (!fs::exists(dir + "/adapter_config.json")) {
      preft::adapters::RandomAdapterSpec spec;
      spec.kind = kind;
      spec.rank = rank;
      spec.alpha = 2.0 * rank;
      spec.dtype = preft::kernels::DType::kBF16;
      spec.seed = 1000 + i;
      auto st = preft::adapters::WriteRandomAdapter(model.config(), spec, dir);
      if (!st.ok()) {
        std::fprintf(stderr, "adapter_bench: %s\n", std::string(st.message()).c_str());
        std::exit(1);
      }
    }
    auto a = preft::adapters::LoadAdapter(dir, model.config(), load);
    if (!a.ok()) {
      std::fprintf(stderr, "adapter_bench: %s\n", std::string(a.status().message()).c_str());
      std::exit(1);
    }
    // The form a serving engine reads: the adapter store's compute-slot copy.
    out.emplace_back((*a)->ConvertTo(load.dtype));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"preft adapter serving benchmark"};
  std::string model_dir, adapters_dir = "models/bench-adapters";
  int requests = 64, prompt_len = 128, new_tokens = 128, lora_rank = 16, direft_rank = 4;
  std::vector<int> ns = {1, 8, 64};
  int repeat = 1;
  bool quick = false;
  app.add_option("--model", model_dir, "Model folder")->required();
  app.add_option("--repeat", repeat, "Rounds of the whole run; figures are median rounds")
      ->check(CLI::Range(1, 99));
  app.add_option("--adapters", adapters_dir, "Folder for the benchmark's adapters");
  app.add_option("--requests", requests, "Concurrent requests");
  app.add_option("--prompt", prompt_len, "Prompt tokens per request");
  app.add_option("--new", new_tokens, "Generated tokens per request");
  app.add_option("--ns", ns, "Numbers of distinct adapters")->delimiter(',');
  app.add_option("--lora-rank", lora_rank);
  app.add_option("--direft-rank", direft_rank);
  app.add_flag("--quick", quick, "16 requests, 32 + 32 tokens, N in 1,16 (a smoke run)");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    requests = 16;
    prompt_len = new_tokens = 32;
    ns = {1, 16};
  }
  auto loaded = preft::model::Model::Load(model_dir);
  if (!loaded.ok()) {
    std::fprintf(stderr, "adapter_bench: %s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  preft::model::Model* model = loaded->get();
  const int max_n = *std::max_element(ns.begin(), ns.end());
  std::printf("model %s (%.2f GB), %d threads, %d requests x (%d prompt + %d new)\n",
              model_dir.c_str(), model->weight_bytes() / 1e9, omp_get_max_threads(), requests,
              prompt_len, new_tokens);
  const auto lora =
      LoadAdapters(*model, adapters_dir, preft::model::AdapterKind::kLora, lora_rank, max_n);
  const auto direft =
      LoadAdapters(*model, adapters_dir, preft::model::AdapterKind::kDireft, direft_rank, max_n);
  const double lora_mb = lora[0]->bytes() / 1e6, direft_mb = direft[0]->bytes() / 1e6;
  std::printf("LoRA rank %d on 7 projections: %.2f MB per adapter; DiReFT rank %d: %.3f MB\n",
              lora_rank, lora_mb, direft_rank, direft_mb);
  std::vector<double> triads = {preft::bench::TriadGBps()};

  using K = preft::model::AdapterKind;
  const Mode base{"base", K::kLora, false, AdapterPositions::kAll};
  const std::vector<Mode> modes = {{"LoRAP", K::kLora, true, AdapterPositions::kPrompt},
                                   {"DiReFTP", K::kDireft, true, AdapterPositions::kPrompt},
                                   {"LoRA (multi-LoRA)", K::kLora, true, AdapterPositions::kAll},
                                   {"DiReFT", K::kDireft, true, AdapterPositions::kAll}};
  // Every configuration has its own engine and they advance in lockstep, one step each in
  // turn, so slow spells of the shared host hit all of them alike; a configuration's
  // throughput is its generated tokens over the time its own steps took.
  std::vector<std::pair<int, const Mode*>> keys = {{0, &base}};
  for (int n : ns)
    for (const Mode& m : modes) keys.emplace_back(n, &m);
  std::vector<std::vector<RunResult>> rounds(keys.size());  // [config][round]
  for (int round = 0; round < repeat; ++round) {
    std::vector<std::unique_ptr<Run>> runs;
    for (const auto& [n, m] : keys) {
      const auto& pool = m->kind == K::kLora ? lora : direft;
      std::vector<std::shared_ptr<const AdapterWeights>> set;
      if (m->adapter) set.assign(pool.begin(), pool.begin() + n);
      const bool multi_lora =
          m->adapter && m->kind == K::kLora && m->positions == AdapterPositions::kAll;
      runs.push_back(std::make_unique<Run>(
          model, set, *m, requests, prompt_len, new_tokens,
          multi_lora ? MatrixSpans(set) : std::vector<preft::bench::ByteSpan>{}));
    }
    for (bool work = true; work;) {
      work = false;
      for (auto& r : runs) {
        if (!r->HasWork()) continue;
        r->Step();
        work = true;
      }
    }
    for (size_t i = 0; i < runs.size(); ++i) rounds[i].push_back(runs[i]->Result(runs[0].get()));
    triads.push_back(preft::bench::TriadGBps());
  }
  auto median_result = [&](const std::vector<RunResult>& rs) {
    std::vector<double> tps, step, adapter;
    for (const RunResult& r : rs) {
      tps.push_back(r.e2e_tokens_per_s);
      step.push_back(r.decode_step_s);
      adapter.push_back(r.decode_adapter_s);
    }
    RunResult m;
    m.e2e_tokens_per_s = Median(tps);
    m.decode_step_s = Median(step);
    m.decode_adapter_s = Median(adapter);
    return m;
  };
  const double triad = *std::max_element(triads.begin(), triads.end());
  std::printf("triad bandwidth %.1f GB/s (highest of", triad);
  for (double t : triads) std::printf(" %.1f", t);
  std::printf("; before and after each round)\n");
  if (repeat > 1) std::printf("each figure: the median of %d rounds\n", repeat);
  std::printf("\n");
  const RunResult b = median_result(rounds[0]);
  std::map<int, std::map<std::string, RunResult>> all;
  for (size_t i = 1; i < keys.size(); ++i)
    all[keys[i].first][keys[i].second->name] = median_result(rounds[i]);
  std::printf("| N | mode | tok/s | / base | decode step ms (median) |\n|---|---|---|---|---|\n");
  std::printf("| - | base | %.1f | 1.00 | %.1f |\n", b.e2e_tokens_per_s, b.decode_step_s * 1e3);
  for (int n : ns) {
    for (const Mode& m : modes) {
      const RunResult& r = all[n][m.name];
      std::printf("| %d | %s | %.1f | %.2f | %.1f |\n", n, m.name.c_str(), r.e2e_tokens_per_s,
                  r.e2e_tokens_per_s / b.e2e_tokens_per_s, r.decode_step_s * 1e3);
    }
  }
  std::printf(
      "\n| N | LoRAP / multi-LoRA | DiReFTP / multi-LoRA | LoRAP / base | DiReFTP / base | "
      "multi-LoRA decode overhead ms | of it in the BGMV ms | byte lower bound ms | "
      "overhead / bound | BGMV / bound |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  // Seconds to read the distinct adapters of a full decode step at `gbps`.
  auto byte_bound_s = [&](int n, double gbps) {
    return std::min(n, requests) * lora_mb * 1e6 / (gbps * 1e9);
  };
  for (int n : ns) {
    auto& r = all[n];
    const double ml = r["LoRA (multi-LoRA)"].e2e_tokens_per_s;
    const double overhead = (r["LoRA (multi-LoRA)"].decode_step_s - b.decode_step_s) * 1e3;
    const double bound = byte_bound_s(n, triad) * 1e3;
    const double bgmv = r["LoRA (multi-LoRA)"].decode_adapter_s * 1e3;
    std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %.1f | %.1f | %.1f | %.2f | %.2f |\n", n,
                r["LoRAP"].e2e_tokens_per_s / ml, r["DiReFTP"].e2e_tokens_per_s / ml,
                r["LoRAP"].e2e_tokens_per_s / b.e2e_tokens_per_s,
                r["DiReFTP"].e2e_tokens_per_s / b.e2e_tokens_per_s, overhead, bgmv, bound,
                overhead / bound, bgmv / bound);
  }
  // The same ratio round by round, each round's BGMV against the bound of the bandwidth
  // measured right before and after it (the higher of the two): time-aligned, where the table
  // above sets every round against the run's single best reading.
  std::printf("\nBGMV / byte bound round by round (each against its own bracketing triads):\n");
  for (size_t i = 1; i < keys.size(); ++i) {
    if (keys[i].second->positions != AdapterPositions::kAll || keys[i].second->kind != K::kLora) {
      continue;
    }
    std::vector<double> ratio;
    std::printf("| N = %d |", keys[i].first);
    for (int round = 0; round < repeat; ++round) {
      const double gbps = std::max(triads[round], triads[round + 1]);
      ratio.push_back(rounds[i][round].decode_adapter_s / byte_bound_s(keys[i].first, gbps));
      std::printf(" %.2f (%.1f ms at %.1f GB/s) |", ratio.back(),
                  rounds[i][round].decode_adapter_s * 1e3, gbps);
    }
    std::printf(" median %.2f |\n", Median(ratio));
  }
  std::printf(
      "\nStep by step, the byte bound at the bandwidth of a plain read of the same adapter "
      "bytes right after each step (median of the steps, round by round): BGMV / bound, "
      "overhead (the step - the base step of its cycle) / bound:\n");
  for (size_t i = 1; i < keys.size(); ++i) {
    if (keys[i].second->positions != AdapterPositions::kAll || keys[i].second->kind != K::kLora) {
      continue;
    }
    std::vector<double> ratio, overhead;
    std::printf("| N = %d |", keys[i].first);
    for (int round = 0; round < repeat; ++round) {
      const RunResult& r = rounds[i][round];
      // The read covers its spans; the bound counts bytes() per adapter (padding included).
      const double span_bytes = r.decode_read_bytes;
      const double bytes_ratio = std::min(keys[i].first, requests) * lora_mb * 1e6 / span_bytes;
      ratio.push_back(r.bgmv_over_read / bytes_ratio);
      overhead.push_back(r.overhead_over_read / bytes_ratio);
      std::printf(" %.2f, %.2f (read %.1f ms = %.1f GB/s) |", ratio.back(), overhead.back(),
                  r.decode_read_s * 1e3, span_bytes / r.decode_read_s / 1e9);
    }
    std::printf(" median %.2f, %.2f |\n", Median(ratio), Median(overhead));
  }
  std::printf(
      "\ntargets: LoRAP and DiReFTP >= 0.95 x base at N = 64; multi-LoRA overhead <= 1.5 x "
      "its byte bound; PreFT / multi-LoRA at N = 64: paper 1.63 (LoRAP), 2.39 (DiReFTP)\n");
  return 0;
}
