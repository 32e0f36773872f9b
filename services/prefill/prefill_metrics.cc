#include "services/prefill/prefill_metrics.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/metrics/buckets.h"
#include "common/metrics/families.h"

namespace preft::prefill {

PrefillMetrics::PrefillMetrics(prometheus::Registry& r, std::function<State()> read,
                               const std::string& transport, absl::Duration period)
    : read_(std::move(read)),
      waiting_(
          metrics::Gauge(r, "preft:num_requests_waiting",
                         "Prompts accepted and not computing yet (adapter loading or queued).")),
      running_(metrics::Gauge(r, "preft:num_requests_running",
                              "Prompts computing or pushing their KV to a decode worker.")),
      usage_(metrics::Gauge(r, "preft:kv_cache_usage_perc",
                            "Fraction of KV blocks not free (1 = full).")),
      store_(r),
      adapter_wait_(metrics::Histogram(
          r, "preft:adapter_wait_seconds",
          "Time a prompt waited for its adapter (about 0 when resident).", metrics::FastBuckets())),
      adapter_load_(metrics::Histogram(r, "preft:adapter_load_seconds",
                                       "Waits for adapters that were not resident: a load "
                                       "from host memory or disk (or joining one).",
                                       metrics::FastBuckets())),
      transfer_bytes_(metrics::Counter(r, "preft:kv_transfer_bytes_total",
                                       "KV bytes pushed to decode workers.")),
      transfer_seconds_(metrics::Histogram(r, "preft:kv_transfer_seconds",
                                           "One prompt's KV push, from the write to the decode "
                                           "worker's acknowledgement.",
                                           metrics::FastBuckets())),
      transfer_failures_(metrics::CounterFamily(r, "preft:kv_transfer_failures_total",
                                                "Failed KV pushes, by reason (the status code).")),
      lora_info_(metrics::GaugeFamily(
          r, "preft:lora_requests_info",
          "Adapters running and waiting (vllm:lora_requests_info's shape); the "
          "value is the time of the reading. max_lora: adapters the compute "
          "budget holds at the mean size of those resident.")) {
  metrics::GaugeFamily(r, "preft:kv_transport_info", "The KV transport this worker opened.")
      .Add({{"transport", transport}})
      .Set(1);
  transfer_failures_.Add({{"reason", "unavailable"}});  // visible (at 0) from the first scrape
  Refresh();
  refresher_ = std::make_unique<metrics::Periodic>(period, [this] { Refresh(); });
}

PrefillMetrics::~PrefillMetrics() = default;

void PrefillMetrics::OnTransfer(const absl::Status& status, int64_t bytes, absl::Duration took) {
  if (!status.ok()) {
    transfer_failures_
        .Add({{"reason", absl::AsciiStrToLower(absl::StatusCodeToString(status.code()))}})
        .Increment();
    return;
  }
  transfer_bytes_.Increment(static_cast<double>(bytes));
  transfer_seconds_.Observe(absl::ToDoubleSeconds(took));
}

void PrefillMetrics::OnAdapterWait(absl::Duration waited, bool loaded) {
  adapter_wait_.Observe(absl::ToDoubleSeconds(waited));
  if (loaded) adapter_load_.Observe(absl::ToDoubleSeconds(waited));
}

void PrefillMetrics::Refresh() { Set(read_()); }

void PrefillMetrics::Set(const State& s) {
  waiting_.Set(static_cast<double>(s.waiting));
  running_.Set(static_cast<double>(s.running));
  usage_.Set(s.kv_total_blocks > 0 ? 1.0 - static_cast<double>(s.kv_free_blocks) / s.kv_total_blocks
                                   : 0.0);
  store_.Set(s.store);

  // max_lora: the store budgets bytes, not slots; this is how many adapters of the resident
  // ones' mean size fit (0 before any is resident).
  int64_t max_lora = 0;
  if (s.store.in_compute > 0 && s.store.stats.compute_bytes_used > 0) {
    max_lora = s.store.compute_capacity_bytes * s.store.in_compute / s.store.stats.compute_bytes_used;
  }
  const std::string running = absl::StrJoin(s.running_adapters, ",");
  const std::string waiting = absl::StrJoin(s.waiting_adapters, ",");

  absl::MutexLock lock(&mu_);
  // One series at a time: the previous label set is removed when it changes.
  const std::string key = absl::StrCat(max_lora, "|", running, "|", waiting);
  if (lora_series_ == nullptr || key != lora_key_) {
    if (lora_series_ != nullptr) lora_info_.Remove(lora_series_);
    lora_series_ = &lora_info_.Add({{"max_lora", std::to_string(max_lora)},
                                    {"running_lora_adapters", running},
                                    {"waiting_lora_adapters", waiting}});
    lora_key_ = key;
  }
  lora_series_->Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
}

}  // namespace preft::prefill
