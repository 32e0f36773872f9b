#pragma once

// The engine's metrics, the same in every worker that runs one (prefill and decode tiers):
// tokens, preemptions, batch sizes, and the request histograms vLLM exports (time to first
// token, inter-token latency, end to end, queue, prefill and decode time), named `preft:` for
// vLLM's `vllm:`. Counts of each tier add up across tiers: a decode worker does not count the
// first token, which the prefill worker sampled, and computes no prompt tokens.
//
// Per-tier meaning: on a prefill worker a request ends at its first token (TTFT is the prompt's
// queue + compute; there is no decode time); on a decode worker a request starts from an
// imported prompt (no TTFT or queue time; its decode time is the whole generation).
// Prefix caching counts tokens as vLLM v1 does: queries are the tokens of the sequences
// admitted, hits those found cached (hit rate = hits / queries); a decode tier has none.

#include "common/engine/engine_observer.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace preft::metrics {

// Thread-safe (prometheus-cpp metrics are); attach with Engine::set_observer. Borrows the
// registry, which must outlive it.
class EngineMetrics final : public engine::EngineObserver {
 public:
  explicit EngineMetrics(prometheus::Registry& registry);

  void OnStep(const engine::StepReport& step) override;
  void OnRequestEnd(const engine::RequestReport& request) override;

 private:
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& generation_tokens_;
  prometheus::Counter& preemptions_;
  prometheus::Histogram& iteration_tokens_;
  prometheus::Histogram& batch_size_;
  prometheus::Histogram& forward_seconds_;
  prometheus::Histogram& ttft_;
  prometheus::Histogram& itl_;
  prometheus::Histogram& e2e_;
  prometheus::Histogram& queue_;
  prometheus::Histogram& prefill_;
  prometheus::Histogram& decode_;
  prometheus::Histogram& request_prompt_tokens_;
  prometheus::Histogram& request_generation_tokens_;
  prometheus::Family<prometheus::Counter>& finished_;
  prometheus::Counter& prefix_queries_;
  prometheus::Counter& prefix_hits_;
  prometheus::Counter& prefix_evictions_;
  prometheus::Gauge& prefix_blocks_;
};

}  // namespace preft::metrics
