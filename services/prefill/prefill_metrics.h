#pragma once

// The prefill worker's own metrics (the engine's are common/metrics/engine_metrics.h): its queue,
// adapter residency and traffic, the KV transfers it pushes, and `preft:lora_requests_info` in
// the shape of vLLM's `vllm:lora_requests_info`, which the Gateway API Inference Extension reads
// to route by adapter affinity.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/adapter_store_metrics.h"
#include "common/metrics/periodic.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace preft::prefill {

class PrefillMetrics {
 public:
  // What the gauges show, read from the service every period.
  struct State {
    int64_t waiting = 0;   // accepted, not computing yet (adapter loading or engine queue)
    int64_t running = 0;   // computing, or pushing their KV
    int64_t kv_total_blocks = 0;
    int64_t kv_free_blocks = 0;
    metrics::AdapterStoreMetrics::State store;
    std::vector<std::string> running_adapters;  // names with requests in the engine, sorted
    std::vector<std::string> waiting_adapters;  // names whose requests wait for a load, sorted
  };

  // Borrows the registry (it must outlive this). `read` is called on a background thread every
  // `period` until destruction; `transport` names the KV transport opened (an info label).
  PrefillMetrics(prometheus::Registry& registry, std::function<State()> read,
                 const std::string& transport, absl::Duration period = absl::Milliseconds(500));
  ~PrefillMetrics();

  // Events, from any thread.
  void OnTransfer(const absl::Status& status, int64_t bytes, absl::Duration took);
  // `loaded`: the adapter was not resident (a loader thread answered, after a load or a join).
  void OnAdapterWait(absl::Duration waited, bool loaded);

  // Reads the state now (tests; the thread does it every period).
  void Refresh();

 private:
  void Set(const State& s);

  const std::function<State()> read_;
  prometheus::Gauge& waiting_;
  prometheus::Gauge& running_;
  prometheus::Gauge& usage_;
  metrics::AdapterStoreMetrics store_;
  prometheus::Histogram& adapter_wait_;
  prometheus::Histogram& adapter_load_;
  prometheus::Counter& transfer_bytes_;
  prometheus::Histogram& transfer_seconds_;
  prometheus::Family<prometheus::Counter>& transfer_failures_;
  prometheus::Family<prometheus::Gauge>& lora_info_;

  absl::Mutex mu_;  // Refresh from the thread and from tests
  prometheus::Gauge* lora_series_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string lora_key_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<metrics::Periodic> refresher_;  // last: stopped before the rest goes
};

}  // namespace preft::prefill
