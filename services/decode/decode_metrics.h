#pragma once

// The decode worker's Prometheus metrics, refreshed from the service on a background thread
// every `period`: KV block states and usage, running sequences, and the adapter store's metrics
// when the worker serves adapters. Names follow vLLM's
// (`vllm:num_requests_running` -> `preft:num_requests_running`, `vllm:kv_cache_usage_perc` ->
// `preft:kv_cache_usage_perc`).

#include <memory>
#include <optional>

#include "absl/time/time.h"
#include "common/metrics/adapter_store_metrics.h"
#include "common/metrics/periodic.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "services/decode/decode_service.h"

namespace preft::decode {

class DecodeMetrics {
 public:
  // Borrows both; they must outlive this object.
  DecodeMetrics(prometheus::Registry& registry, const DecodeService* service,
                absl::Duration period = absl::Milliseconds(500));
  ~DecodeMetrics();

  // Reads the service now (tests; the thread does it every period).
  void Refresh();

 private:
  const DecodeService* const service_;
  prometheus::Gauge& running_;
  prometheus::Gauge& waiting_;
  prometheus::Gauge& usage_;
  prometheus::Family<prometheus::Gauge>& blocks_;
  prometheus::Gauge& free_;
  prometheus::Gauge& reserved_;
  prometheus::Gauge& quarantined_;
  prometheus::Gauge& filled_;
  std::optional<metrics::AdapterStoreMetrics> store_;  // workers serving adapters
  std::unique_ptr<metrics::Periodic> refresher_;  // last: stopped before the rest goes
};

}  // namespace preft::decode
