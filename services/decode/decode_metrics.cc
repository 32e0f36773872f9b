#include "services/decode/decode_metrics.h"

namespace preft::decode {

DecodeMetrics::DecodeMetrics(prometheus::Registry& registry, const DecodeService* service,
                             absl::Duration period)
    : service_(service),
      running_(prometheus::BuildGauge()
                   .Name("preft:num_requests_running")
                   .Help("Sequences decoding on this worker.")
                   .Register(registry)
                   .Add({})),
      usage_(prometheus::BuildGauge()
                 .Name("preft:kv_cache_usage_perc")
                 .Help("Fraction of KV blocks not free (1 = full).")
                 .Register(registry)
                 .Add({})),
      blocks_(prometheus::BuildGauge()
                  .Name("preft:kv_blocks")
                  .Help("KV blocks by state: free, reserved (awaiting a prefill's KV), filled "
                        "(decoding), quarantined (aborted, waiting out late writes).")
                  .Register(registry)),
      free_(blocks_.Add({{"state", "free"}})),
      reserved_(blocks_.Add({{"state", "reserved"}})),
      quarantined_(blocks_.Add({{"state", "quarantined"}})),
      filled_(blocks_.Add({{"state", "filled"}})) {
  Refresh();
  thread_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) Refresh();
  });
}

DecodeMetrics::~DecodeMetrics() {
  stop_.Notify();
  thread_.join();
}

void DecodeMetrics::Refresh() {
  const DecodeService::BlockCounts b = service_->block_counts();
  running_.Set(b.running);
  usage_.Set(b.total > 0 ? 1.0 - static_cast<double>(b.free) / b.total : 0.0);
  free_.Set(b.free);
  reserved_.Set(b.reserved);
  quarantined_.Set(b.quarantined);
  filled_.Set(b.total - b.free - b.reserved - b.quarantined);
}

}  // namespace preft::decode
