#include "services/decode/decode_metrics.h"

#include "common/metrics/families.h"

namespace preft::decode {

DecodeMetrics::DecodeMetrics(prometheus::Registry& registry, const DecodeService* service,
                             absl::Duration period)
    : service_(service),
      running_(metrics::Gauge(registry, "preft:num_requests_running",
                              "Sequences decoding on this worker.")),
      waiting_(metrics::Gauge(registry, "preft:num_requests_waiting",
                              "Reservations waiting for their prompt's KV from a prefill worker, "
                              "and (colocated) requests queued for room in the batch.")),
      usage_(metrics::Gauge(registry, "preft:kv_cache_usage_perc",
                            "Fraction of KV blocks not free (1 = full).")),
      blocks_(metrics::GaugeFamily(
          registry, "preft:kv_blocks",
          "KV blocks by state: free, reserved (awaiting a prefill's KV), filled "
          "(running sequences), quarantined (aborted, waiting out late writes).")),
      free_(blocks_.Add({{"state", "free"}})),
      reserved_(blocks_.Add({{"state", "reserved"}})),
      quarantined_(blocks_.Add({{"state", "quarantined"}})),
      filled_(blocks_.Add({{"state", "filled"}})) {
  if (service->adapter_store() != nullptr) store_.emplace(registry);
  Refresh();
  refresher_ = std::make_unique<metrics::Periodic>(period, [this] { Refresh(); });
}

DecodeMetrics::~DecodeMetrics() = default;

void DecodeMetrics::Refresh() {
  const DecodeService::BlockCounts b = service_->block_counts();
  running_.Set(b.sequences);
  waiting_.Set(b.reservations_waiting + b.queued);
  usage_.Set(b.total > 0 ? 1.0 - static_cast<double>(b.free) / b.total : 0.0);
  free_.Set(b.free);
  reserved_.Set(b.reserved);
  quarantined_.Set(b.quarantined);
  filled_.Set(b.filled);
  if (store_) {
    const adapters::AdapterStore& store = *service_->adapter_store();
    store_->Set(metrics::AdapterStoreMetrics::Read(store, service_->options().store, store.List()));
  }
}

}  // namespace preft::decode
