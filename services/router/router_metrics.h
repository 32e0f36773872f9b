#pragma once

// The router's metrics: what clients see (time to first token, inter-token latency, end to end,
// time waiting for capacity, tokens, outcomes), the time to first token split by stage across
// the tiers, placement decisions, and retries. `positions` labels (base, prompt, all) split
// PreFT traffic from the all-position baseline; no adapter or request id is ever a label.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace preft::router {

// Thread-safe. Borrows the registry, which must outlive it.
class RouterMetrics {
 public:
  explicit RouterMetrics(prometheus::Registry& registry);

  // "base", "prompt" (PreFT) or "all" (the all-position baseline).
  using Positions = const char*;

  // A call is in flight from Started to Ended; Waiting brackets its waits for capacity.
  void Started();
  void WaitingForCapacity(bool waiting);
  void Ended(const absl::Status& status, Positions positions, absl::Duration e2e,
             int64_t prompt_tokens, int64_t generation_tokens);

  void QueueTime(absl::Duration waited);  // arrival to a KV reservation
  void FirstToken(Positions positions, absl::Duration ttft);
  void InterToken(absl::Duration gap);
  // One stage of the time to first token: admit (tokenize, validate), reserve, prefill_queue,
  // prefill_compute, kv_transfer, prefill_rpc (the prefill call's remaining wall time: network,
  // retries), decode_start (prefill answer to the first token at the router).
  void Stage(const char* stage, absl::Duration d);
  // tier: "prefill" or "decode"; choice: the residency class (resident, free_slot, loading,
  // full) or "base" for prefill, "most_free" for decode.
  void Routed(const char* tier, const char* choice);
  // A worker call failed and another was tried; reason: the status code.
  void Retried(const char* tier, const absl::Status& status);

 private:
  prometheus::Gauge& running_;
  prometheus::Gauge& waiting_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& prompt_tokens_;
  prometheus::Family<prometheus::Counter>& generation_tokens_;
  prometheus::Family<prometheus::Histogram>& ttft_;
  prometheus::Family<prometheus::Histogram>& e2e_;
  prometheus::Histogram& itl_;
  prometheus::Histogram& queue_;
  prometheus::Family<prometheus::Histogram>& stage_;
  prometheus::Family<prometheus::Counter>& routed_;
  prometheus::Family<prometheus::Counter>& retries_;
};

}  // namespace preft::router
