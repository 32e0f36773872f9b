// GenerateCall's colocated path (RouterOptions::colocated): no reservation, no prefill and no
// KV transfer; a colocated decode worker runs the whole request (DecodeWorker.Run) and its
// engine admits, queues and preempts it like any local request.

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/rpc/status.h"
#include "services/router/generate_call.h"
#include "services/wire/request_convert.h"

namespace preft::router {

absl::StatusOr<std::shared_ptr<DecodeWorker>> GenerateCall::PickColocated(
    const std::vector<int32_t>& prompt, const std::optional<RegisteredAdapter>& adapter,
    int64_t max_new, const WorkerAttempts& attempts, size_t* known) {
  PREFT_ASSIGN_OR_RETURN(const DecodeChoice c,
                         DecodeCandidates(static_cast<int64_t>(prompt.size()), max_new));
  *known = c.workers.size();
  std::vector<DecodeView> views = c.views;
  attempts.ExcludeTried(c.workers, &views);
  // Where the prompt's prefix was sent last, its KV is probably cached.
  const std::vector<uint64_t> keys =
      PrefixKeys(adapter, prompt, views.empty() ? 16 : views.front().block_tokens);
  const auto match = router_->prefix_affinity.Match(keys);
  for (size_t i = 0; i < views.size(); ++i) {
    if (const auto it = match.find(c.workers[i]->address); it != match.end()) {
      views[i].prefix_blocks = it->second;
    }
  }
  // Any worker may take it (its engine queues what does not fit yet): most free first.
  const std::vector<size_t> order = RankDecode(views, 0);
  if (order.empty()) return nullptr;
  const std::shared_ptr<DecodeWorker>& w = c.workers[order.front()];
  router_->prefix_affinity.Record(keys, w->address);
  router_->metrics->Routed("decode", views[order.front()].prefix_blocks > 0 ? "prefix" : "most_free");
  // Until the next poll says otherwise, so a burst spreads over the workers; never below 0,
  // which would take the worker out of the ranking although its engine would queue.
  absl::MutexLock lock(&w->mu);
  w->view.free_blocks = std::max<int64_t>(0, w->view.free_blocks - c.blocks);
  ++w->view.queue_depth;
  return w;
}

std::shared_ptr<DecodeStream> GenerateCall::OpenRun(DecodeWorker& w,
                                                   const std::vector<int32_t>& prompt,
                                                   const std::optional<RegisteredAdapter>& adapter,
                                                   const engine::SamplingParams& sampling,
                                                   v1::AdapterPositions positions) {
  worker::v1::StreamOpen open;
  worker::v1::RunRequest& req = *open.mutable_run();
  req.set_request_id(id_);
  for (int32_t t : prompt) req.add_prompt_ids(t);
  *req.mutable_sampling() = wire::ToProto(sampling);
  if (adapter) {
    req.set_adapter(adapter->name);
    req.set_adapter_version(adapter->version);
    req.set_adapter_path(adapter->path);
    req.set_adapter_positions(positions);
  }
  return w.OpenStream(std::move(open));
}

rpc::Task<absl::Status> GenerateCall::RunColocated(const std::vector<int32_t>& prompt,
                                                  const std::optional<RegisteredAdapter>& adapter,
                                                  const engine::SamplingParams& sampling) {
  std::optional<FinishAdapter> finish;
  if (adapter) {
    // Resolved here, so the finish names what ran whichever worker runs it.
    const v1::AdapterPositions positions = wire::ToProto(
        wire::FromProto(request_.adapter_positions()).value_or(adapter->default_positions));
    finish = FinishAdapter{adapter->name, adapter->version, positions};
  }
  WorkerAttempts attempts(router_->options.max_prefill_attempts, "none was healthy");
  while (!attempts.exhausted()) {
    if (stopped()) {
      const absl::Status aborted = co_await AbortedResult();
      co_return aborted;
    }
    size_t known = 0;
    PREFT_CO_ASSIGN_OR_RETURN(
        const std::shared_ptr<DecodeWorker> w,
        PickColocated(prompt, adapter, sampling.max_tokens, attempts, &known));
    if (w == nullptr) {
      if (absl::Now() >= admission_deadline_) {
        co_return absl::UnavailableError(
            absl::StrCat("no colocated decode worker could run the request (last: ",
                         attempts.last_error(), ")"));
      }
      co_await WaitForCapacity();
      attempts.ForgetTriedIfAllFailed(known);
      continue;
    }
    const std::shared_ptr<DecodeStream> stream = OpenRun(
        *w, prompt, adapter, sampling, finish ? finish->positions : v1::ADAPTER_POSITIONS_UNSPECIFIED);
    Track(stream);
    Relayed relayed;
    co_await Relay(*stream, finish, &relayed);
    Untrack();
    const absl::Status& s = relayed.status;
    // Before its first token the request has cost the client nothing: run it elsewhere.
    if (relayed.client_gone || stopped() ||
        !RetryElsewhere(s, /*client_saw_output=*/completion_tokens_ > 0)) {
      const absl::Status end = co_await RelayEnd(relayed, *w);
      co_return end;
    }
    AttemptFailed("decode", *w, s, &attempts);
  }
  co_return absl::UnavailableError(absl::StrCat("the request failed on ", attempts.max_attempts(),
                                             " decode workers (last: ", attempts.last_error(),
                                             ")"));
}

}  // namespace preft::router
