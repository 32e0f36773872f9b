#pragma once

// The adapter store's metrics, the same on every worker that holds one (prefill workers, and
// decode workers serving adapters): versions by state, bytes and budgets by tier, acquires by
// result (the hit rate: compute_hit over all) and evictions. Names are in docs/METRICS.md.

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/adapters/adapter_store.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace preft::metrics {

class AdapterStoreMetrics {
 public:
  struct State {
    adapters::AdapterStoreStats stats;
    int64_t compute_capacity_bytes = 0;
    int64_t host_capacity_bytes = 0;
    int64_t in_compute = 0;  // versions in a compute slot
    int64_t in_host = 0;     // versions parsed in host memory
  };
  // What `store`, built with `options`, holds now; `listed` is its List() (callers that also
  // read the list for other metrics pass theirs, so the store is listed once).
  static State Read(const adapters::AdapterStore& store,
                    const adapters::AdapterStoreOptions& options,
                    const std::vector<adapters::AdapterInfo>& listed);

  // Borrows the registry (it must outlive this).
  explicit AdapterStoreMetrics(prometheus::Registry& registry);
  // Sets the gauges; counters advance by what the store counted since the last Set.
  // Thread-safe.
  void Set(const State& s);

 private:
  prometheus::Family<prometheus::Gauge>& versions_;
  prometheus::Family<prometheus::Gauge>& bytes_;
  prometheus::Family<prometheus::Gauge>& capacity_;
  prometheus::Family<prometheus::Counter>& acquires_;
  prometheus::Family<prometheus::Counter>& evictions_;
  prometheus::Counter& disk_load_seconds_;
  absl::Mutex mu_;
  adapters::AdapterStoreStats last_ ABSL_GUARDED_BY(mu_);
};

}  // namespace preft::metrics
