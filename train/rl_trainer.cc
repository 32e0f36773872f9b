#include "train/rl_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "train/data.h"
#include "train/example_batch.h"
#include "train/reward.h"
#include "train/rollouts.h"
#include "train/torch_model.h"
#include "train/trainable_adapter.h"

namespace preft::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The adapter's registered version, NotFound when it is not registered.
absl::StatusOr<int64_t> CurrentVersion(client::Client& c, const std::string& name) {
  PREFT_ASSIGN_OR_RETURN(v1::ListModelsResponse models, c.ListModels());
  for (const v1::AdapterInfo& a : models.adapters()) {
    if (a.name() == name) return a.version();
  }
  return absl::NotFoundError(absl::StrCat("adapter '", name,
                                          "' is not registered with the cluster; register a "
                                          "folder first (preft client register)"));
}

// Export -> UpdateAdapter(expected v) -> every prefill worker holding v + 1.
absl::StatusOr<int64_t> Sync(client::Client& c, const TrainableAdapter& a, const RlOptions& o,
                             int64_t version) {
  const std::string dir = o.out_dir + "/policy";
  PREFT_RETURN_IF_ERROR(a.Write(dir));
  PREFT_ASSIGN_OR_RETURN(v1::UpdateAdapterResponse r,
                         c.UpdateAdapter(o.adapter, dir, nullptr, version));
  // Every prefill worker, and for a prompt-only adapter no decode worker, even one that also
  // serves all-position adapters: its decode runs the base model.
  const bool prompt_only = o.positions == model::AdapterPositions::kPrompt;
  PREFT_RETURN_IF_ERROR(
      c.LoadAdapter(o.adapter, /*num_workers=*/1 << 20, prompt_only).status());
  return r.version();
}

// (r - mean) / (std + 1e-4) within each group of G (Dr. GRPO: no division).
std::vector<double> Advantages(const std::vector<double>& rewards, int64_t group, bool by_std) {
  std::vector<double> out(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += group) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < group; ++i) mean += rewards[g + i];
    mean /= group;
    for (int64_t i = 0; i < group; ++i) var += (rewards[g + i] - mean) * (rewards[g + i] - mean);
    const double std = group > 1 ? std::sqrt(var / (group - 1)) : 0;
    for (int64_t i = 0; i < group; ++i) {
      out[g + i] = (rewards[g + i] - mean) / (by_std ? std + 1e-4 : 1.0);
    }
  }
  return out;
}

struct StepStats {
  double loss = 0, kl = 0, clipped = 0, ratio = 0;
  double agreement_max = 0, agreement_sum = 0;
  int64_t tokens = 0;
};

// One optimizer step over every rollout: the clipped surrogate, token-mean over the batch, with
// the server's logprobs as the behaviour policy. On the first step of an iteration (weights
// still those of the served version) the trainer's logprobs are compared with the server's.
StepStats TrainStep(const TorchModel& m, TrainableAdapter& a, const TrainableAdapter* reference,
                    torch::optim::AdamW& optimizer, const std::vector<Example>& examples,
                    const std::vector<const Rollout*>& rollouts,
                    const std::vector<double>& advantages, const RlOptions& o) {
  StepStats s;
  int64_t total = 0;
  for (const Example& e : examples) total += static_cast<int64_t>(e.completion_ids.size());
  const AdapterMasking masking{o.positions, a.prompt_selection()};
  optimizer.zero_grad();
  size_t i = 0;
  while (i < examples.size()) {  // micro-batches of at most batch_tokens padded tokens
    std::vector<const Example*> mb;
    std::vector<double> server, adv;
    int64_t longest = 0;
    while (i < examples.size()) {
      const int64_t len = std::max(longest, examples[i].num_tokens());
      if (!mb.empty() && len * static_cast<int64_t>(mb.size() + 1) > o.batch_tokens) break;
      longest = len;
      mb.push_back(&examples[i]);
      for (size_t t = 0; t < examples[i].completion_ids.size(); ++t) {
        server.push_back(rollouts[i]->logprobs[t]);
        adv.push_back(advantages[i]);
      }
      ++i;
    }
    const ExampleBatch b = MakeExampleBatch(mb, masking, m.dtype());
    const torch::Tensor lp = CompletionLogprobs(m, &a, b, o.temperature);
    const torch::Tensor old = torch::tensor(server, torch::kFloat64).to(lp.dtype());
    const torch::Tensor advantage = torch::tensor(adv, torch::kFloat64).to(lp.dtype());
    {
      const torch::Tensor diff = (lp.detach().to(torch::kFloat64) -
                                  torch::tensor(server, torch::kFloat64)).abs();
      s.agreement_max = std::max(s.agreement_max, diff.max().item<double>());
      s.agreement_sum += diff.sum().item<double>();
    }
    const torch::Tensor ratio = torch::exp(lp - old);
    const torch::Tensor surrogate = torch::min(
        ratio * advantage, torch::clamp(ratio, 1 - o.clip, 1 + o.clip) * advantage);
    torch::Tensor loss = -surrogate.sum() / total;
    if (reference != nullptr && o.beta > 0) {
      torch::Tensor ref;
      {
        torch::NoGradGuard no_grad;
        ref = CompletionLogprobs(m, reference, b, o.temperature);
      }
      const torch::Tensor delta = ref - lp;
      const torch::Tensor kl = torch::exp(delta) - delta - 1;  // k3: unbiased, >= 0
      loss = loss + o.beta * kl.sum() / total;
      s.kl += kl.sum().item<double>() / total;
    }
    loss.backward();
    s.loss += loss.item<double>();
    s.ratio += ratio.detach().sum().item<double>() / total;
    s.clipped += ((ratio.detach() - 1).abs() > o.clip).sum().item<double>() / total;
    s.tokens += b.targets.size(0);
  }
  if (o.max_grad_norm > 0) torch::nn::utils::clip_grad_norm_(a.parameters(), o.max_grad_norm);
  optimizer.step();
  return s;
}

absl::Status CheckOptions(const RlOptions& o) {
  auto invalid = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (o.adapter.empty()) return invalid("--adapter is required");
  if (o.out_dir.empty()) return invalid("--out is required");
  if (o.group < 2) return invalid("--group must be at least 2 (advantages compare samples)");
  if (o.batch < 1) return invalid("--batch must be at least 1");
  if (o.iterations < 1) return invalid("--iterations must be at least 1");
  if (o.updates_per_iteration < 1) return invalid("--updates-per-iteration must be at least 1");
  if (!(o.temperature > 1e-5f)) {
    return invalid("--temperature must be positive: greedy rollouts have no policy gradient");
  }
  if (o.max_tokens < 1) return invalid("--max-tokens must be at least 1");
  if (!(o.lr > 0)) return invalid("--lr must be positive");
  if (!(o.clip > 0)) return invalid("--clip must be positive");
  if (o.beta < 0) return invalid("--beta must be >= 0");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RlResult> RunRl(const RlOptions& o, std::FILE* progress) {
  PREFT_RETURN_IF_ERROR(CheckOptions(o));
  PREFT_ASSIGN_OR_RETURN(std::unique_ptr<Reward> reward, MakeReward(o.reward, o.answer_marker));
  PREFT_ASSIGN_OR_RETURN(model::ModelConfig config,
                         model::ModelConfig::FromFile(o.model_dir + "/config.json"));
  PREFT_ASSIGN_OR_RETURN(auto tokenizer, text::Tokenizer::LoadFromModelDir(o.model_dir));
  std::unique_ptr<text::ChatTemplate> chat;
  if (auto t = text::ChatTemplate::FromModelDir(o.model_dir); t.ok()) {
    chat = std::make_unique<text::ChatTemplate>(*std::move(t));
  }
  SftDataOptions data_options{o.max_length, false, config.vocab_size};
  PREFT_ASSIGN_OR_RETURN(std::vector<RlPrompt> prompts,
                         ReadRlPrompts(o.prompts_path, *tokenizer, chat.get(), data_options,
                                       reward->needs_answer()));
  PREFT_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> client,
                         client::Client::Connect(o.server));
  PREFT_ASSIGN_OR_RETURN(int64_t version, CurrentVersion(*client, o.adapter));

  SetComputeThreads(o.threads);
  PREFT_ASSIGN_OR_RETURN(auto m, TorchModel::Load(o.model_dir, torch::kFloat32));
  std::unique_ptr<TrainableAdapter> adapter;
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(o.out_dir, ": ", ec.message()));
  if (!o.init_dir.empty()) {
    PREFT_ASSIGN_OR_RETURN(adapter, TrainableAdapter::Load(o.init_dir, config, torch::kFloat32));
  } else {
    adapters::AdapterSpec spec = o.spec;
    spec.preft_positions = o.positions;
    PREFT_ASSIGN_OR_RETURN(adapter, TrainableAdapter::Create(config, spec, o.seed, torch::kFloat32));
    PREFT_ASSIGN_OR_RETURN(version, Sync(*client, *adapter, o, version));
  }
  std::unique_ptr<TrainableAdapter> reference;
  if (o.beta > 0) {  // a frozen copy of the starting weights
    const std::string dir = o.out_dir + "/reference";
    PREFT_RETURN_IF_ERROR(adapter->Write(dir));
    PREFT_ASSIGN_OR_RETURN(reference, TrainableAdapter::Load(dir, config, torch::kFloat32));
  }
  torch::optim::AdamW optimizer(adapter->parameters(), torch::optim::AdamWOptions(o.lr)
                                                           .betas({0.9, 0.999})
                                                           .eps(1e-8)
                                                           .weight_decay(o.weight_decay));
  std::ofstream log(o.out_dir + "/rl_log.jsonl", std::ios::trunc);
  RolloutOptions ro;
  ro.adapter = o.adapter;
  ro.positions = o.positions == model::AdapterPositions::kPrompt ? v1::ADAPTER_POSITIONS_PROMPT
                                                                 : v1::ADAPTER_POSITIONS_ALL;
  ro.group = o.group;
  ro.temperature = o.temperature;
  ro.max_tokens = o.max_tokens;
  ro.seed = o.seed;
  ro.concurrency = o.concurrency;
  if (progress != nullptr) {
    std::fprintf(progress,
                 "preft train rl: adapter %s from version %lld, %zu prompts, %lld iterations of "
                 "%lld prompts x %lld samples\n",
                 o.adapter.c_str(), static_cast<long long>(version), prompts.size(),
                 static_cast<long long>(o.iterations), static_cast<long long>(o.batch),
                 static_cast<long long>(o.group));
  }

  RlResult result;
  std::vector<size_t> order(prompts.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(o.seed);
  size_t cursor = order.size();
  for (int64_t it = 0; it < o.iterations; ++it) {
    RlIterationStats st;
    st.iteration = it;
    st.version = version;
    std::vector<const RlPrompt*> batch;
    for (int64_t b = 0; b < o.batch; ++b) {
      if (cursor == order.size()) {  // a new pass over the prompts, freshly shuffled
        std::shuffle(order.begin(), order.end(), rng);
        cursor = 0;
      }
      batch.push_back(&prompts[order[cursor++]]);
    }
    auto t0 = Clock::now();
    PREFT_ASSIGN_OR_RETURN(std::vector<Rollout> rollouts,
                           CollectRollouts(*client, batch, it, ro));
    st.rollout_s = Seconds(t0);
    // Every rollout ran to its end before this point (the loop waits for all of them), so none
    // is in flight when the weights move; any that ran on another version is discarded.
    int64_t stale = 0;
    for (const Rollout& r : rollouts) stale += r.version != version;

    t0 = Clock::now();
    std::vector<RewardInput> inputs;
    for (const Rollout& r : rollouts) {
      inputs.push_back({batch[r.prompt]->text, r.text, batch[r.prompt]->answer, r.token_ids});
    }
    PREFT_ASSIGN_OR_RETURN(std::vector<double> rewards, reward->Score(inputs));
    st.reward_s = Seconds(t0);
    st.reward_mean = std::accumulate(rewards.begin(), rewards.end(), 0.0) / rewards.size();
    const std::vector<double> advantages = Advantages(rewards, o.group, o.scale_by_std);

    t0 = Clock::now();
    std::vector<Example> examples;
    std::vector<const Rollout*> used;
    std::vector<double> used_advantages;
    for (size_t i = 0; i < rollouts.size(); ++i) {
      const Rollout& r = rollouts[i];
      // Zero-advantage rollouts add no gradient but are kept: agreement covers every token.
      if (r.version != version || r.token_ids.empty()) continue;
      if (r.logprobs.size() != r.token_ids.size()) {
        return absl::InternalError("the server returned fewer logprobs than tokens");
      }
      examples.push_back({batch[r.prompt]->prompt_ids, r.token_ids, "rollout"});
      used.push_back(&r);
      used_advantages.push_back(advantages[i]);
    }
    StepStats first;
    for (int64_t u = 0; u < o.updates_per_iteration && !examples.empty(); ++u) {
      StepStats s = TrainStep(*m, *adapter, reference.get(), optimizer, examples, used,
                              used_advantages, o);
      if (u == 0) first = s;
    }
    st.train_s = Seconds(t0);
    st.agreement_max = first.agreement_max;
    st.agreement_mean = first.tokens > 0 ? first.agreement_sum / first.tokens : 0;

    t0 = Clock::now();
    PREFT_ASSIGN_OR_RETURN(const int64_t next, Sync(*client, *adapter, o, version));
    st.sync_s = Seconds(t0);
    int64_t tokens = 0;
    for (const Rollout& r : rollouts) tokens += static_cast<int64_t>(r.token_ids.size());
    Json entry = {{"iteration", it},
                  {"version", version},
                  {"next_version", next},
                  {"rollouts", rollouts.size()},
                  {"trained_rollouts", examples.size()},
                  {"stale_discarded", stale},
                  {"tokens", tokens},
                  {"reward_mean", st.reward_mean},
                  {"loss", first.loss},
                  {"kl", first.kl},
                  {"ratio_mean", first.ratio},
                  {"clip_fraction", first.clipped},
                  {"agreement_max", st.agreement_max},
                  {"agreement_mean", st.agreement_mean},
                  {"rollout_s", st.rollout_s},
                  {"reward_s", st.reward_s},
                  {"train_s", st.train_s},
                  {"sync_s", st.sync_s}};
    log << entry.dump() << "\n" << std::flush;
    if (progress != nullptr) {
      std::fprintf(progress,
                   "iter %lld  v%lld  reward %.3f  |lp diff| max %.2g mean %.2g  rollout %.2fs "
                   "reward %.2fs train %.2fs sync %.2fs -> v%lld%s\n",
                   static_cast<long long>(it), static_cast<long long>(version), st.reward_mean,
                   st.agreement_max, st.agreement_mean, st.rollout_s, st.reward_s, st.train_s,
                   st.sync_s, static_cast<long long>(next),
                   stale > 0 ? absl::StrCat("  (", stale, " stale rollouts discarded)").c_str()
                             : "");
      std::fflush(progress);
    }
    version = next;
    result.iterations.push_back(st);
  }
  result.final_version = version;
  PREFT_RETURN_IF_ERROR(adapter->Write(o.out_dir));
  return result;
}

}  // namespace preft::train
