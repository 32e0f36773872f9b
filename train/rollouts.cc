#include "train/rollouts.h"

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/fnv.h"

namespace preft::train {
absl::StatusOr<std::vector<Rollout>> CollectRollouts(client::Client& client,
                                                     const std::vector<const RlPrompt*>& prompts,
                                                     int64_t iteration,
                                                     const RolloutOptions& o) {
  const int64_t n = static_cast<int64_t>(prompts.size()) * o.group;
  std::vector<Rollout> out(n);
  const uint64_t iteration_seed =
      base::SplitMix64(o.seed ^ base::SplitMix64(static_cast<uint64_t>(iteration)));
  std::atomic<int64_t> next{0};
  absl::Mutex mu;
  absl::Status first_error;
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      {
        absl::MutexLock lock(&mu);
        if (!first_error.ok()) return;
      }
      Rollout& r = out[i];
      r.prompt = i / o.group;
      r.sample = i % o.group;
      const RlPrompt& p = *prompts[r.prompt];
      client::GenerateParams params;
      params.model = o.adapter;
      params.positions = o.positions;
      params.max_tokens = o.max_tokens;
      params.temperature = o.temperature;
      params.seed = base::SplitMix64(iteration_seed ^ static_cast<uint64_t>(i));
      params.logprobs = 0;
      params.logprobs_mode = v1::LOGPROBS_MODE_PROCESSED;
      absl::StatusOr<client::Generation> g =
          client.Generate(client::Prompt::Ids(p.prompt_ids), params);
      if (!g.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) {
          first_error = absl::Status(g.status().code(),
                                     absl::StrCat("rollout of ", p.source, ": ", g.status().message()));
        }
        return;
      }
      r.token_ids = std::move(g->token_ids);
      r.text = std::move(g->text);
      for (const v1::TokenLogprob& lp : g->logprobs) r.logprobs.push_back(lp.logprob());
      r.version = g->finish.adapter_version();
      r.finish = g->finish.reason();
    }
  };
  std::vector<std::thread> threads;
  const int64_t workers = std::min<int64_t>(std::max(1, o.concurrency), n);
  for (int64_t t = 0; t < workers; ++t) threads.emplace_back(work);
  for (std::thread& t : threads) t.join();
  if (!first_error.ok()) return first_error;
  return out;
}

}  // namespace preft::train
