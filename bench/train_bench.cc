// The trainer's speed (docs/TRAINING.md):
//  --sft: frozen-base SFT steps (LoRAP, 512-token examples by default) in tokens/s against a
//    bound from libtorch's own f32 GEMM rate on this model's projection shapes, measured in the
//    same run: a step costs ~4 x (layer params x tokens + LM-head params x completion tokens)
//    FLOPs (forward, and backward to the inputs only: the base is frozen). Peak RSS against
//    the f32 weights.
//  --rl: `preft train rl` iterations against an in-process cluster (router, prefill, decode):
//    median rollout / reward / train / sync seconds and sync's share of an iteration.
// Usage: train_bench --model DIR [--sft] [--rl] [flags]

#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include "CLI/CLI.hpp"
#include "bench/bench_util.h"
#include "tools/preft/embedded_cluster.h"
#include "train/example_batch.h"
#include "train/rl_trainer.h"
#include "train/torch_model.h"
#include "train/trainable_adapter.h"

namespace preft {
namespace {

client::ClientOptions ClientFor(const std::string& address) {
  client::ClientOptions o;
  o.address = address;
  return o;
}

using bench::Clock;
using bench::Seconds;

// f32 GFLOP/s of torch::mm over the model's seven projection shapes at `tokens` rows.
double GemmRate(const model::ModelConfig& c, int64_t tokens) {
  const int64_t d = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {d, q}, {d, kv}, {d, kv}, {q, d}, {d, c.intermediate_size}, {d, c.intermediate_size},
      {c.intermediate_size, d}};
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    double flops = 0, secs = 0;
    for (const auto& [in, out] : shapes) {
      const torch::Tensor x = torch::randn({tokens, in}), w = torch::randn({out, in});
      torch::Tensor y = torch::mm(x, w.t());  // warm
      const auto t0 = Clock::now();
      y = torch::mm(x, w.t());
      secs += Seconds(t0, Clock::now());
      flops += 2.0 * tokens * in * out;
    }
    best = std::max(best, flops / secs / 1e9);
  }
  return best;
}

int RunSftBench(const std::string& dir, int64_t prompt_tokens, int64_t completion_tokens,
                int64_t examples_per_step, int steps, int64_t rank, const std::string& profile) {
  auto m = train::TorchModel::Load(dir, torch::kFloat32);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", std::string(m.status().message()).c_str());
    return 1;
  }
  const model::ModelConfig& c = (*m)->config();
  adapters::AdapterSpec spec;
  spec.rank = rank;
  auto a = train::TrainableAdapter::Create(c, spec, 1, torch::kFloat32);
  if (!a.ok()) return 1;
  std::mt19937 rng(1);
  std::vector<train::Example> data(examples_per_step);
  for (train::Example& e : data) {
    for (int64_t i = 0; i < prompt_tokens; ++i) e.prompt_ids.push_back(rng() % c.vocab_size);
    for (int64_t i = 0; i < completion_tokens; ++i) e.completion_ids.push_back(rng() % c.vocab_size);
  }
  std::vector<const train::Example*> batch;
  for (const train::Example& e : data) batch.push_back(&e);
  torch::optim::AdamW opt((*a)->parameters(), torch::optim::AdamWOptions(1e-4));
  const train::ExampleBatch b =
      train::MakeExampleBatch(batch, {model::AdapterPositions::kPrompt, {}}, torch::kFloat32);
  const int64_t tokens = examples_per_step * (prompt_tokens + completion_tokens);
  const double gemm = GemmRate(c, prompt_tokens + completion_tokens);
  const int64_t layer_params = (*m)->num_parameters() - c.vocab_size * c.hidden_size *
                                                            (c.tie_word_embeddings ? 1 : 2);
  const double head_params = static_cast<double>(c.vocab_size) * c.hidden_size;
  const double step_flops = 4.0 * (static_cast<double>(layer_params) * tokens +
                                   head_params * examples_per_step * completion_tokens);
  std::vector<double> secs, forward;
  bench::ResetPeakRss();
  for (int s = 0; s <= steps; ++s) {  // step 0 warms up
    std::unique_ptr<torch::autograd::profiler::RecordProfile> trace;
    if (s == steps && !profile.empty()) {  // a Chrome trace of the last step
      trace = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
    }
    const auto t0 = Clock::now();
    opt.zero_grad();
    torch::Tensor loss = -train::CompletionLogprobs(**m, a->get(), b).mean();
    const auto t1 = Clock::now();
    loss.backward();
    opt.step();
    if (s > 0) {
      secs.push_back(Seconds(t0, Clock::now()));
      forward.push_back(Seconds(t0, t1));
    }
  }
  std::vector<double> base_forward;  // the frozen base alone, no adapter, no graph
  for (int s = 0; s < 2; ++s) {
    torch::NoGradGuard no_grad;
    std::unique_ptr<torch::autograd::profiler::RecordProfile> trace;
    if (s == 1 && !profile.empty()) {
      trace = std::make_unique<torch::autograd::profiler::RecordProfile>(profile + ".base");
    }
    const auto t0 = Clock::now();
    (*m)->Forward(b.batch, nullptr);
    base_forward.push_back(Seconds(t0, Clock::now()));
  }
  const double step = bench::Median(secs);
  const double rate = tokens / step, bound = gemm * 1e9 / (step_flops / tokens);
  std::printf("sft: %s, %lld layer params, %lld examples x (%lld prompt + %lld completion) tokens, "
              "LoRAP rank %lld on all projections, %d cores\n",
              dir.c_str(), static_cast<long long>(layer_params),
              static_cast<long long>(examples_per_step), static_cast<long long>(prompt_tokens),
              static_cast<long long>(completion_tokens), static_cast<long long>(rank),
              static_cast<int>(std::thread::hardware_concurrency()));
  std::printf("  libtorch f32 GEMM on the model's shapes: %.1f GFLOP/s -> bound %.1f tokens/s\n",
              gemm, bound);
  std::printf("  step %.2f s (median of %d; forward %.2f s; the base's forward alone %.2f s): "
              "%.1f tokens/s = %.2f x the bound (%.1f GFLOP/s)\n",
              step, steps, bench::Median(forward), *std::min_element(base_forward.begin(),
                                                                     base_forward.end()),
              rate, rate / bound, step_flops / step / 1e9);
  std::printf("  peak RSS %ld MiB; f32 weights %.0f MiB\n", bench::PeakRssMiB(),
              (*m)->num_parameters() * 4.0 / (1 << 20));
  return 0;
}

int RunRlBench(const std::string& dir, int iterations, int64_t group, int64_t batch,
               int32_t max_tokens, int64_t rank) {
  namespace fs = std::filesystem;
  const std::string work = (fs::temp_directory_path() / "preft_train_bench_rl").string();
  fs::remove_all(work);
  fs::create_directories(work + "/adapters");
  tools::EmbeddedClusterOptions co;
  co.model_dir = dir;
  co.adapter_root = work + "/adapters";
  co.threads = 0;
  auto cluster = tools::EmbeddedCluster::Start(co);
  if (!cluster.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cluster.status().message()).c_str());
    return 1;
  }
  auto config = model::ModelConfig::FromFile(dir + "/config.json");
  adapters::AdapterSpec spec;
  spec.rank = rank;
  spec.preft_positions = model::AdapterPositions::kPrompt;
  auto start = train::TrainableAdapter::Create(*config, spec, 1, torch::kFloat32);
  if (!start.ok() || !(*start)->Write(work + "/adapters/policy").ok()) return 1;
  auto client = client::Client::Connect(ClientFor((*cluster)->address()));
  if (!client.ok() || !(*client)->RegisterAdapter("policy", "policy").ok()) return 1;
  {
    std::FILE* f = std::fopen((work + "/prompts.jsonl").c_str(), "w");
    for (int i = 0; i < 32; ++i)
      std::fprintf(f, "{\"prompt\": \"Task %d: write something about the number %d.\"}\n", i, i * 7);
    std::fclose(f);
    f = std::fopen((work + "/reward.py").c_str(), "w");
    std::fprintf(f, "import json, sys\nfor l in sys.stdin:\n    ids = json.loads(l)['completion_ids']\n"
                    "    print(sum(t %% 3 == 0 for t in ids) / max(1, len(ids)))\n");
    std::fclose(f);
  }
  train::RlOptions o;
  o.server.address = (*cluster)->address();
  o.adapter = "policy";
  o.model_dir = dir;
  o.prompts_path = work + "/prompts.jsonl";
  o.reward = "command:/usr/bin/python3 " + work + "/reward.py";
  o.out_dir = work + "/out";
  o.init_dir = work + "/adapters/policy";
  o.group = group;
  o.batch = batch;
  o.iterations = iterations;
  o.max_tokens = max_tokens;
  o.lr = 1e-3;
  auto r = train::RunRl(o, stderr);
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
    return 1;
  }
  std::vector<double> rollout, reward, train, sync, total, agree;
  for (size_t i = 1; i < r->iterations.size(); ++i) {  // iteration 0 warms up
    const auto& s = r->iterations[i];
    rollout.push_back(s.rollout_s);
    reward.push_back(s.reward_s);
    train.push_back(s.train_s);
    sync.push_back(s.sync_s);
    total.push_back(s.rollout_s + s.reward_s + s.train_s + s.sync_s);
    agree.push_back(s.agreement_max);
  }
  std::printf("rl: %s, LoRAP rank %lld, %lld prompts x %lld samples x <= %d tokens per iteration\n",
              dir.c_str(), static_cast<long long>(rank), static_cast<long long>(batch),
              static_cast<long long>(group), max_tokens);
  std::printf("  median of %zu iterations: rollout %.3f s, reward %.3f s, train %.3f s, sync %.3f s; "
              "iteration %.3f s, sync %.1f%% of it; max |trainer - server| logprob %.2g\n",
              total.size(), bench::Median(rollout), bench::Median(reward), bench::Median(train),
              bench::Median(sync), bench::Median(total),
              100 * bench::Median(sync) / bench::Median(total),
              *std::max_element(agree.begin(), agree.end()));
  return 0;
}

}  // namespace
}  // namespace preft

int main(int argc, char** argv) {
  CLI::App app{"preft trainer benchmark"};
  std::string model;
  bool sft = false, rl = false;
  int64_t prompt = 384, completion = 128, examples = 1, rank = 16, group = 4, batch = 4;
  int steps = 3, iterations = 4, threads = 0;
  int32_t max_tokens = 32;
  std::string profile;
  app.add_option("--model", model)->required();
  app.add_flag("--sft", sft);
  app.add_flag("--rl", rl);
  app.add_option("--prompt-tokens", prompt);
  app.add_option("--completion-tokens", completion);
  app.add_option("--examples", examples, "examples per SFT step");
  app.add_option("--steps", steps);
  app.add_option("--rank", rank);
  app.add_option("--iterations", iterations);
  app.add_option("--group", group);
  app.add_option("--batch", batch);
  app.add_option("--max-tokens", max_tokens);
  app.add_option("--threads", threads);
  app.add_option("--profile", profile, "write a Chrome trace of the last SFT step here");
  CLI11_PARSE(app, argc, argv);
  preft::train::SetComputeThreads(threads);
  int rc = 0;
  if (sft || !rl) rc |= preft::RunSftBench(model, prompt, completion, examples, steps, rank, profile);
  if (rl) rc |= preft::RunRlBench(model, iterations, group, batch, max_tokens, rank);
  return rc;
}
