// The CUDA backend at model level (issue 8's GPU figures), on random bf16 weights made on the
// device in a preset's exact shapes, against the device's copy bandwidth measured in the same
// run:
//  - decode at batch 1: weight bytes per step / step time against the copy bandwidth (>= 0.70);
//  - decode throughput at 64 and 256 sequences (prompt 128, base model);
//  - the paper's setting: R requests, each with its own adapter (LoRA rank 16 on all seven
//    projections; DiReFT rank 4 on every layer), prompt P, G new tokens, in lockstep: prompts
//    prefilled in chunks, then decode steps over every sequence. End-to-end tokens/s of base,
//    LoRAP, DiReFTP (adapter on the prompt only; decode on the base model), LoRA (multi-LoRA,
//    every position) and DiReFT, and PreFT / multi-LoRA;
//  - host-to-device copy rates and a LoRA adapter's upload as the engine does it.
// With --tensor-parallel N (N GPUs; e.g. --preset llama3.1-70b) only the split model's decode
// is measured instead: batch 1 against rank 0's weight bytes / copy bandwidth, and 64
// sequences, through the CUDA backend's ranks (NCCL all-reduces).
//
//   cuda_model_bench [--preset llama3.1-8b] [--requests 512] [--prompt 128] [--new 128]
//                    [--chunk 8192] [--lora-rank 16] [--direft-rank 4] [--quick] [--no-graphs]
//                    [--tensor-parallel N]
// Decode steps replay CUDA graphs unless --no-graphs (batch 1 is measured both ways).
// Prints one markdown table; exit 2 without a CUDA device.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_util.h"
#include "common/backend/cuda_backend.h"
#include "common/backend/device_model.h"
#include "common/kernels/cuda/runtime.cuh"
#include "common/kv/blocks.h"
#include "common/model/make_model.h"

namespace {

namespace cuda = preft::kernels::cuda;
using preft::model::AdapterKind;
using preft::model::AdapterWeights;
using preft::backend::DeviceAdapter;
using preft::backend::DeviceAdapterSlots;
using preft::backend::DeviceKvCache;
using preft::backend::DeviceModel;
using preft::model::ForwardBatch;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

template <class T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "cuda_model_bench: %s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*v);
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_model_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Device-to-device copy rate in GB/s (bytes read + written), the ceiling a weight stream meets.
double CopyBandwidth() {
  const size_t bytes = size_t{2} << 30;
  auto a = Check(preft::backend::DeviceBuffer::Allocate(bytes), "allocate");
  auto b = Check(preft::backend::DeviceBuffer::Allocate(bytes), "allocate");
  for (int i = 0; i < 3; ++i) cuda::CopyOnDevice(b.get(), a.get(), bytes, nullptr);
  cuda::StreamSynchronize(nullptr);
  const double t0 = Now();
  for (int i = 0; i < 10; ++i) cuda::CopyOnDevice(b.get(), a.get(), bytes, nullptr);
  cuda::StreamSynchronize(nullptr);
  return 2.0 * bytes * 10 / (Now() - t0) / 1e9;
}

// Host-to-device rate in GB/s of `bytes` from page-locked or pageable memory.
double HostToDevice(size_t bytes, bool pinned) {
  auto dev = Check(preft::backend::DeviceBuffer::Allocate(bytes), "allocate");
  void* host = nullptr;
  std::vector<uint8_t> pageable;
  if (pinned) {
    if (cuda::HostAlloc(&host, bytes) != 0) return 0;
  } else {
    pageable.assign(bytes, 1);
    host = pageable.data();
  }
  std::memset(host, 1, bytes);
  cuda::CopyToDevice(dev.get(), host, bytes, nullptr);
  cuda::StreamSynchronize(nullptr);
  const double t0 = Now();
  for (int i = 0; i < 5; ++i) cuda::CopyToDevice(dev.get(), host, bytes, nullptr);
  cuda::StreamSynchronize(nullptr);
  const double gbps = 5.0 * bytes / (Now() - t0) / 1e9;
  if (pinned) cuda::HostFree(host);
  return gbps;
}

// A host LoRA adapter of `rank` on all seven projections of every layer (zero weights: only
// its size matters here).
std::unique_ptr<AdapterWeights> HostLora(const preft::model::ModelConfig& c, int64_t rank) {
  auto a = std::make_unique<AdapterWeights>(AdapterKind::kLora, c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (int p = 0; p < preft::model::kNumProjections; ++p) {
      const auto proj = static_cast<preft::model::Projection>(p);
      const preft::model::ProjectionDims dims = preft::model::DimsOf(c, proj);
      auto& lr = a->mutable_lora(l, proj);
      lr.shrink = a->AllocateMatrix(preft::kernels::DType::kBF16, rank, dims.in);
      lr.expand = a->AllocateMatrix(preft::kernels::DType::kBF16, rank, dims.out);
    }
  }
  return a;
}

// What serving a new adapter costs the GPU worker: host-to-device rates, then LoRA uploads
// through DeviceAdapterSlots as the engine starts them (Prefetch: staged off the calling
// thread, copied on a side stream): the time the calling (engine) thread is held, and the
// time until the copy is on the device (Ready).
void UploadFigures(const preft::model::ModelConfig& c, int64_t rank) {
  const size_t bytes = size_t{64} << 20;
  const double pinned = HostToDevice(bytes, true), pageable = HostToDevice(bytes, false);
  std::printf("| host to device, page-locked (64 MiB) | %.1f GB/s | - | - | - |\n", pinned);
  std::printf("| host to device, pageable (64 MiB) | %.1f GB/s | - | - | - |\n", pageable);
  DeviceAdapterSlots slots;
  std::vector<std::shared_ptr<const AdapterWeights>> hosts;
  for (int i = 0; i < 17; ++i) hosts.push_back(HostLora(c, rank));
  Check(slots.Get(hosts[0].get()), "upload");  // makes the uploader
  std::vector<double> held, done;
  for (size_t i = 1; i < hosts.size(); ++i) {
    const double t0 = Now();
    slots.Prefetch(hosts[i]);
    const double t1 = Now();
    while (!Check(slots.Ready(hosts[i]), "upload")) {
    }
    held.push_back(t1 - t0);
    done.push_back(Now() - t0);
  }
  const double mb = hosts[0]->bytes() / 1e6, ideal_ms = hosts[0]->bytes() / (pinned * 1e9) * 1e3;
  std::printf("| LoRA r%ld upload (%.1f MB), caller held | %.2f ms | - | - | - |\n",
              static_cast<long>(rank), mb, preft::bench::Median(held) * 1e3);
  std::printf("| LoRA r%ld upload (%.1f MB), on the device | %.2f ms | page-locked copy %.2f ms | %.2f | - |\n",
              static_cast<long>(rank), mb, preft::bench::Median(done) * 1e3, ideal_ms,
              preft::bench::Median(done) * 1e3 / ideal_ms);
}

struct Seq {
  std::vector<int32_t> blocks;
  std::vector<int32_t> tokens;
  const AdapterWeights* adapter = nullptr;
  bool prompt_only = false;
};

// `count` sequences of `prompt` random tokens (the same in every run), each with its own
// blocks of `block_tokens`, room for `total` tokens.
std::vector<Seq> MakeSeqs(int64_t count, int64_t prompt, int64_t total, int64_t block_tokens,
                          int64_t vocab) {
  const int64_t per = preft::kv::BlocksFor(total, block_tokens);
  std::vector<Seq> seqs(count);
  uint64_t rng = 12345;
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t b = 0; b < per; ++b) seqs[i].blocks.push_back(static_cast<int32_t>(i * per + b));
    for (int64_t t = 0; t < prompt; ++t) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      seqs[i].tokens.push_back(static_cast<int32_t>((rng >> 33) % vocab));
    }
  }
  return seqs;
}

// Sequences in lockstep over one cache: prompts first (in chunks), then decode steps.
class Lockstep {
 public:
  Lockstep(DeviceModel* model, DeviceKvCache* cache, DeviceAdapterSlots* slots)
      : model_(model), cache_(cache), slots_(slots) {}

  // `count` sequences of `prompt` random tokens and room for `total` tokens each.
  std::vector<Seq> Make(int64_t count, int64_t prompt, int64_t total) {
    return MakeSeqs(count, prompt, total, cache_->shape().block_tokens,
                    model_->config().vocab_size);
  }

  // Runs every prompt (whole prompts, up to `chunk` tokens per forward); each sequence gets
  // its first token. Returns seconds.
  double Prefill(std::vector<Seq>& seqs, int64_t chunk) {
    double total = 0;
    for (size_t i = 0; i < seqs.size();) {
      ForwardBatch batch;
      std::vector<Seq*> in;
      int64_t tokens = 0;
      while (i < seqs.size() && (in.empty() || tokens + static_cast<int64_t>(seqs[i].tokens.size()) <= chunk)) {
        Seq& s = seqs[i++];
        const int64_t n = static_cast<int64_t>(s.tokens.size());
        batch.AddSequence(s.blocks.data(), static_cast<int64_t>(s.blocks.size()), s.tokens.data(),
                          n, n, true, s.adapter);
        in.push_back(&s);
        tokens += n;
      }
      total += Run(batch, in);
    }
    return total;
  }

  // One decode step over every sequence; PreFT sequences run on the base model. Seconds.
  double Step(std::vector<Seq>& seqs) {
    ForwardBatch batch;
    std::vector<Seq*> in;
    for (Seq& s : seqs) {
      const int64_t ctx = static_cast<int64_t>(s.tokens.size());
      batch.AddSequence(s.blocks.data(), static_cast<int64_t>(s.blocks.size()),
                        s.tokens.data() + ctx - 1, 1, ctx, true,
                        s.prompt_only ? nullptr : s.adapter);
      in.push_back(&s);
    }
    return Run(batch, in);
  }

 private:
  double Run(const ForwardBatch& batch, const std::vector<Seq*>& in) {
    const double t0 = Now();
    Check(model_->ForwardGreedy(batch, cache_, slots_, &picks_, &logprobs_), "forward");
    const double dt = Now() - t0;
    for (size_t i = 0; i < in.size(); ++i) in[i]->tokens.push_back(picks_[i]);
    return dt;
  }

  DeviceModel* model_;
  DeviceKvCache* cache_;
  DeviceAdapterSlots* slots_;
  std::vector<int32_t> picks_;
  std::vector<float> logprobs_;
};

// A decode figure: at batch 1 the weight bytes a step reads (`step_bytes`, per GPU) against
// the copy bandwidth, else tokens per second.
void PrintDecodeRow(int64_t n, const char* how, double step, double step_bytes, double bw) {
  if (n == 1) {
    const double gbps = step_bytes / step / 1e9;
    std::printf("| decode batch 1 (%s) | %.2f ms/step = %.0f GB/s of weights | copy %.0f GB/s | %.2f | >= 0.70 |\n",
                how, step * 1e3, gbps, bw, gbps / bw);
  } else {
    std::printf("| decode %ld sequences (%s) | %.0f tok/s (%.2f ms/step) | - | - | - |\n",
                static_cast<long>(n), how, n / step, step * 1e3);
  }
}

// Decode of `config` split over `tp` GPUs (random weights made on each): batch 1 and 64
// sequences with `prompt`-token prompts, through CudaBackend's ranks.
int TensorParallelFigures(const preft::model::ModelConfig& config, int tp, int64_t prompt,
                          int64_t new_tokens, bool graphs, double bw) {
  preft::backend::CudaBackend::Options o;
  o.tensor_parallel = tp;
  o.graphs = graphs;
  const int64_t total = prompt + new_tokens, per_seq = (total + 15) / 16;
  o.kv_blocks = 64 * per_seq;
  auto backend = Check(preft::backend::CudaBackend::CreateRandom(config, 1, o), "split model");
  // Rank 0 reads its slice of every layer's projections and the whole LM head per step.
  double linear = 0;
  for (int p = 0; p < preft::model::kNumProjections; ++p) {
    const auto d = preft::model::DimsOf(config, static_cast<preft::model::Projection>(p));
    linear += static_cast<double>(d.in) * d.out;
  }
  const double rank0_bytes =
      2.0 * (config.num_layers * linear / tp +
             static_cast<double>(config.vocab_size) * config.hidden_size);
  std::printf("tensor parallelism over %d GPUs (%s): %.1f GB read per decode step by rank 0\n\n",
              tp, backend->collective_kind(), rank0_bytes / 1e9);
  std::printf("| figure | value | reference (same run) | ratio | target |\n|---|---|---|---|---|\n");
  for (int64_t n : {int64_t{1}, int64_t{64}}) {
    std::vector<Seq> seqs = MakeSeqs(n, prompt, total, o.block_tokens, config.vocab_size);
    std::vector<preft::backend::RowSampling> greedy(n);
    std::vector<int32_t> picks;
    auto run = [&](bool prefill) {
      ForwardBatch batch;
      for (Seq& s : seqs) {
        const int64_t ctx = static_cast<int64_t>(s.tokens.size()), num = prefill ? ctx : 1;
        batch.AddSequence(s.blocks.data(), static_cast<int64_t>(s.blocks.size()),
                          s.tokens.data() + ctx - num, num, ctx, true, nullptr);
      }
      const double t0 = Now();
      Check(backend->ForwardSample(batch, greedy, &picks), "forward");
      const double dt = Now() - t0;
      for (int64_t i = 0; i < n; ++i) seqs[i].tokens.push_back(picks[i]);
      return dt;
    };
    run(true);
    std::vector<double> steps;
    for (int i = 0; i < 16 && static_cast<int64_t>(seqs[0].tokens.size()) < total; ++i) {
      steps.push_back(run(false));
    }
    PrintDecodeRow(n, (std::to_string(tp) + " GPUs").c_str(), preft::bench::Median(steps),
                   rank0_bytes, bw);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"CUDA model benchmark"};
  std::string preset = "llama3.1-8b";
  int64_t requests = 512, prompt = 128, new_tokens = 128, chunk = 8192, lora_rank = 16,
          direft_rank = 4;
  bool quick = false, no_graphs = false;
  int tensor_parallel = 0;
  app.add_option("--preset", preset, "model shape (make-model preset)");
  app.add_option("--requests", requests, "requests in the adapter comparison, one adapter each");
  app.add_option("--prompt", prompt, "prompt tokens per request");
  app.add_option("--new", new_tokens, "generated tokens per request");
  app.add_option("--chunk", chunk, "prompt tokens per prefill forward");
  app.add_option("--lora-rank", lora_rank);
  app.add_option("--direft-rank", direft_rank);
  app.add_flag("--quick", quick, "64 requests, 16 new tokens");
  app.add_flag("--no-graphs", no_graphs, "decode steps launch kernels one by one");
  app.add_option("--tensor-parallel", tensor_parallel,
                 "measure only the model split over this many GPUs")
      ->check(CLI::Range(2, 64));
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    requests = std::min<int64_t>(requests, 64);
    new_tokens = std::min<int64_t>(new_tokens, 16);
  }
  if (cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "cuda_model_bench: no CUDA device\n");
    return 2;
  }
  const auto config = Check(preft::model::PresetConfig(preset), "preset");
  const double bw = CopyBandwidth();
  if (tensor_parallel > 0) {
    return TensorParallelFigures(config, tensor_parallel, prompt, new_tokens, !no_graphs, bw);
  }
  auto model = Check(DeviceModel::Random(config, 1), "random model");
  const int64_t total = prompt + new_tokens;
  const int64_t per_seq = (total + 15) / 16;
  const int64_t need_blocks = std::max<int64_t>(requests, 256) * per_seq;
  const int64_t fit = Check(DeviceKvCache::BlocksThatFit(model->CacheShape(1), 0.5), "free memory");
  if (fit < need_blocks) {
    std::fprintf(stderr, "cuda_model_bench: %ld KV blocks needed, %ld fit in half the free memory\n",
                 static_cast<long>(need_blocks), static_cast<long>(fit));
    return 1;
  }
  auto cache = Check(DeviceKvCache::Create(model->CacheShape(need_blocks)), "KV cache");
  const size_t embed_bytes = static_cast<size_t>(config.vocab_size) * config.hidden_size * 2;
  const double step_bytes =
      static_cast<double>(model->weight_bytes() - (config.tie_word_embeddings ? 0 : embed_bytes));
  std::printf("%s: %.2f GB of weights (%.2f GB read per decode step), %ld KV blocks\n\n",
              preset.c_str(), model->weight_bytes() / 1e9, step_bytes / 1e9,
              static_cast<long>(need_blocks));
  std::printf("| figure | value | reference (same run) | ratio | target |\n|---|---|---|---|---|\n");
  std::printf("| copy bandwidth | %.0f GB/s (read + write) | - | - | - |\n", bw);
  UploadFigures(config, lora_rank);

  // Decode on the base model at 1, 64 and 256 sequences (batch 1 also without graphs).
  struct DecodeRun {
    int64_t n;
    bool graphs;
  };
  std::vector<DecodeRun> decode_runs = {{1, false}, {1, true}, {64, true}, {256, true}};
  for (const DecodeRun& dr : decode_runs) {
    if (dr.graphs && no_graphs) continue;
    const int64_t n = dr.n;
    model->UseGraphs(dr.graphs);
    DeviceAdapterSlots none;
    Lockstep run(model.get(), cache.get(), &none);
    std::vector<Seq> seqs = run.Make(n, prompt, total);
    run.Prefill(seqs, chunk);
    std::vector<double> steps;
    for (int i = 0; i < (n == 1 ? 32 : 16) && static_cast<int64_t>(seqs[0].tokens.size()) < total; ++i) {
      steps.push_back(run.Step(seqs));
    }
    PrintDecodeRow(n, dr.graphs ? "CUDA graphs" : "eager", preft::bench::Median(steps),
                   step_bytes, bw);
  }
  model->UseGraphs(!no_graphs);

  // The paper's setting.
  struct Mode {
    const char* name;
    bool adapter;
    AdapterKind kind;
    bool prompt_only;
  };
  const Mode modes[] = {{"base", false, AdapterKind::kLora, false},
                        {"LoRAP", true, AdapterKind::kLora, true},
                        {"DiReFTP", true, AdapterKind::kDireft, true},
                        {"LoRA (multi-LoRA)", true, AdapterKind::kLora, false},
                        {"DiReFT", true, AdapterKind::kDireft, false}};
  std::vector<double> e2e(5), decode(5);
  for (int mi = 0; mi < 5; ++mi) {
    const Mode& mode = modes[mi];
    DeviceAdapterSlots slots;
    std::vector<std::unique_ptr<AdapterWeights>> keys;
    if (mode.adapter) {
      for (int64_t i = 0; i < requests; ++i) {
        keys.push_back(std::make_unique<AdapterWeights>(mode.kind, config.num_layers));
        slots.Put(keys.back().get(),
                  Check(DeviceAdapter::Random(config, mode.kind,
                                              mode.kind == AdapterKind::kLora ? lora_rank : direft_rank,
                                              1000 + i),
                        "random adapter"));
      }
    }
    Lockstep run(model.get(), cache.get(), &slots);
    std::vector<Seq> seqs = run.Make(requests, prompt, total);
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i].adapter = mode.adapter ? keys[i].get() : nullptr;
      seqs[i].prompt_only = mode.prompt_only;
    }
    const double prefill = run.Prefill(seqs, chunk);
    std::vector<double> steps;
    while (static_cast<int64_t>(seqs[0].tokens.size()) < total) steps.push_back(run.Step(seqs));
    double seconds = prefill;
    for (double s : steps) seconds += s;
    e2e[mi] = requests * new_tokens / seconds;
    decode[mi] = preft::bench::Median(steps);
    std::printf("| %s, %ld requests x %ld adapters (%ld+%ld tokens) | %.0f tok/s end to end; prefill %.2f s, decode step %.2f ms | - | - | - |\n",
                mode.name, static_cast<long>(requests), static_cast<long>(mode.adapter ? requests : 0),
                static_cast<long>(prompt), static_cast<long>(new_tokens), e2e[mi], prefill,
                decode[mi] * 1e3);
  }
  std::printf("| LoRAP / multi-LoRA | %.2fx end to end (decode step %.2fx) | - | - | paper: 1.83 (8B), 1.63 (0.5B) |\n",
              e2e[1] / e2e[3], decode[3] / decode[1]);
  std::printf("| DiReFTP / multi-LoRA | %.2fx end to end (decode step %.2fx) | - | - | paper: 2.21 (8B), 2.39 (0.5B) |\n",
              e2e[2] / e2e[3], decode[3] / decode[2]);
  std::printf("| LoRAP / base, DiReFTP / base | %.2f, %.2f | - | - | - |\n", e2e[1] / e2e[0],
              e2e[2] / e2e[0]);
  return 0;
}
