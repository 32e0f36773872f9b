#include "services/router/router_metrics.h"

#include "absl/strings/ascii.h"
#include "common/metrics/buckets.h"
#include "common/metrics/families.h"

namespace preft::router {

namespace {

std::string CodeName(const absl::Status& s) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(s.code()));
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

RouterMetrics::RouterMetrics(prometheus::Registry& r)
    : running_(metrics::Gauge(r, "preft:router_requests_running", "Generate calls in flight.")),
      waiting_(metrics::Gauge(r, "preft:router_requests_waiting",
                              "Generate calls waiting for KV room or a prefill worker.")),
      requests_(
          metrics::CounterFamily(r, "preft:router_requests_total",
                                 "Generate calls ended, by gRPC code and adapter positions.")),
      prompt_tokens_(metrics::CounterFamily(r, "preft:router_prompt_tokens_total",
                                            "Prompt tokens of calls ended, by adapter positions.")),
      generation_tokens_(
          metrics::CounterFamily(r, "preft:router_generation_tokens_total",
                                 "Tokens streamed to clients, by adapter positions.")),
      ttft_(metrics::HistogramFamily(
          r, "preft:router_time_to_first_token_seconds",
          "From the call's arrival to its first token, by adapter positions.")),
      e2e_(metrics::HistogramFamily(r, "preft:router_e2e_request_latency_seconds",
                                    "From the call's arrival to its end, by adapter positions.")),
      itl_(metrics::Histogram(r, "preft:router_inter_token_latency_seconds",
                              "Between consecutive tokens relayed to a client.",
                              metrics::ItlBuckets())),
      queue_(metrics::Histogram(r, "preft:router_request_queue_time_seconds",
                                "From the call's arrival to its KV reservation on a decode worker.",
                                metrics::RequestBuckets())),
      stage_(metrics::HistogramFamily(
          r, "preft:router_ttft_stage_seconds",
          "The time to first token split by stage: admit, reserve, prefill_queue, "
          "prefill_compute, kv_transfer, prefill_rpc, decode_start.")),
      routed_(metrics::CounterFamily(
          r, "preft:router_routing_decisions_total",
          "Workers chosen, by tier and why (prefill: the adapter's residency "
          "there, or base).")),
      retries_(metrics::CounterFamily(
          r, "preft:router_retries_total",
          "Worker calls that failed and were tried elsewhere, by tier and reason.")) {
  // Series a dashboard's rate() and histogram_quantile() need from the first scrape on: a series
  // born at its first event has no earlier sample, so that event never shows in increase().
  for (Positions p : {"base", "prompt", "all"}) {
    requests_.Add({{"code", "ok"}, {"positions", p}});
    prompt_tokens_.Add({{"positions", p}});
    generation_tokens_.Add({{"positions", p}});
    ttft_.Add({{"positions", p}}, metrics::TtftBuckets());
    e2e_.Add({{"positions", p}}, metrics::RequestBuckets());
  }
  for (const char* tier : {"prefill", "decode"})
    retries_.Add({{"tier", tier}, {"reason", "unavailable"}});
  for (const char* stage : {"admit", "reserve", "prefill_queue", "prefill_compute", "kv_transfer",
                            "prefill_rpc", "decode_start"}) {
    stage_.Add({{"stage", stage}}, metrics::TtftBuckets());
  }
}

void RouterMetrics::Started() { running_.Increment(); }

void RouterMetrics::WaitingForCapacity(bool waiting) {
  if (waiting) {
    waiting_.Increment();
  } else {
    waiting_.Decrement();
  }
}

void RouterMetrics::Ended(const absl::Status& status, Positions positions, absl::Duration e2e,
                          int64_t prompt_tokens, int64_t generation_tokens) {
  running_.Decrement();
  requests_.Add({{"code", CodeName(status)}, {"positions", positions}}).Increment();
  prompt_tokens_.Add({{"positions", positions}}).Increment(static_cast<double>(prompt_tokens));
  generation_tokens_.Add({{"positions", positions}})
      .Increment(static_cast<double>(generation_tokens));
  e2e_.Add({{"positions", positions}}, metrics::RequestBuckets()).Observe(Seconds(e2e));
}

void RouterMetrics::QueueTime(absl::Duration waited) { queue_.Observe(Seconds(waited)); }

void RouterMetrics::FirstToken(Positions positions, absl::Duration ttft) {
  ttft_.Add({{"positions", positions}}, metrics::TtftBuckets()).Observe(Seconds(ttft));
}

void RouterMetrics::InterToken(absl::Duration gap) { itl_.Observe(Seconds(gap)); }

void RouterMetrics::Stage(const char* stage, absl::Duration d) {
  stage_.Add({{"stage", stage}}, metrics::TtftBuckets()).Observe(Seconds(d));
}

void RouterMetrics::Routed(const char* tier, const char* choice) {
  routed_.Add({{"tier", tier}, {"choice", choice}}).Increment();
}

void RouterMetrics::Retried(const char* tier, const absl::Status& status) {
  retries_.Add({{"tier", tier}, {"reason", CodeName(status)}}).Increment();
}

}  // namespace preft::router
