#include "common/metrics/engine_metrics.h"

#include "common/metrics/buckets.h"
#include "common/metrics/families.h"

namespace preft::metrics {

namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

EngineMetrics::EngineMetrics(prometheus::Registry& r)
    : prompt_tokens_(Counter(r, "preft:prompt_tokens_total", "Prompt tokens computed.")),
      generation_tokens_(Counter(r, "preft:generation_tokens_total", "Tokens sampled.")),
      preemptions_(Counter(r, "preft:num_preemptions_total",
                           "Sequences sent back to the queue to free KV blocks.")),
      iteration_tokens_(Histogram(r, "preft:iteration_tokens_total",
                                  "Tokens computed per forward step.", OneTwoFiveBuckets(16384))),
      batch_size_(
          Histogram(r, "preft:batch_size", "Sequences per forward step.", OneTwoFiveBuckets(1024))),
      forward_seconds_(Histogram(r, "preft:forward_seconds",
                                 "Time of one forward step (schedule, compute, sample).",
                                 FastBuckets())),
      ttft_(Histogram(r, "preft:time_to_first_token_seconds",
                      "From arrival at this engine to the first token sampled here.",
                      TtftBuckets())),
      itl_(Histogram(r, "preft:inter_token_latency_seconds",
                     "Between consecutive tokens of a request.", ItlBuckets())),
      e2e_(Histogram(r, "preft:e2e_request_latency_seconds",
                     "From arrival at this engine to the request's end.", RequestBuckets())),
      queue_(Histogram(r, "preft:request_queue_time_seconds",
                       "From arrival to the first step that computes the request.",
                       RequestBuckets())),
      prefill_(Histogram(r, "preft:request_prefill_time_seconds",
                         "From the first step that computes the request to its first token.",
                         RequestBuckets())),
      decode_(Histogram(r, "preft:request_decode_time_seconds",
                        "From the first token to the request's end.", RequestBuckets())),
      request_prompt_tokens_(Histogram(r, "preft:request_prompt_tokens",
                                       "Prompt tokens per finished request.",
                                       OneTwoFiveBuckets(1 << 20))),
      request_generation_tokens_(
          Histogram(r, "preft:request_generation_tokens",
                    "Tokens generated per finished request (not on prefill workers).",
                    OneTwoFiveBuckets(1 << 20))),
      finished_(metrics::CounterFamily(
          r, "preft:request_success_total",
          "Requests ended, by finish reason (length, stop, abort, error).")),
      prefix_queries_(Counter(r, "preft:prefix_cache_queries_total",
                              "Tokens of admitted sequences looked up in the prefix cache.")),
      prefix_hits_(Counter(r, "preft:prefix_cache_hits_total",
                           "Of the tokens looked up, those whose KV was cached.")),
      prefix_evictions_(Counter(r, "preft:prefix_cache_evictions_total",
                                "Cached blocks whose KV was reclaimed for new tokens.")),
      prefix_blocks_(Gauge(r, "preft:prefix_cache_blocks",
                           "KV blocks holding cached content (in use or evictable).")) {
  // Present from the first scrape, so increase() sees their first events.
  for (auto reason : {engine::FinishReason::kLength, engine::FinishReason::kStop,
                      engine::FinishReason::kAbort, engine::FinishReason::kError}) {
    finished_.Add({{"finished_reason", engine::FinishReasonName(reason)}});
  }
}

void EngineMetrics::OnStep(const engine::StepReport& step) {
  prompt_tokens_.Increment(static_cast<double>(step.prompt_tokens));
  generation_tokens_.Increment(static_cast<double>(step.generated_tokens));
  preemptions_.Increment(static_cast<double>(step.preemptions));
  prefix_queries_.Increment(static_cast<double>(step.prefix_query_tokens));
  prefix_hits_.Increment(static_cast<double>(step.prefix_hit_tokens));
  prefix_evictions_.Increment(static_cast<double>(step.prefix_evictions));
  prefix_blocks_.Set(static_cast<double>(step.cached_blocks));
  if (step.num_sequences == 0) return;  // only preemptions happened
  iteration_tokens_.Observe(static_cast<double>(step.num_tokens));
  batch_size_.Observe(static_cast<double>(step.num_sequences));
  forward_seconds_.Observe(Seconds(step.forward));
  for (absl::Duration d : step.inter_token) itl_.Observe(Seconds(d));
}

void EngineMetrics::OnRequestEnd(const engine::RequestReport& r) {
  finished_.Add({{"finished_reason", engine::FinishReasonName(r.finish)}}).Increment();
  const bool ran = r.scheduled != absl::InfinitePast();
  const bool has_first = r.first_token != absl::InfinitePast();
  if (!r.imported) {
    if (ran) queue_.Observe(Seconds(r.scheduled - r.arrival));
    if (has_first) ttft_.Observe(Seconds(r.first_token - r.arrival));
    if (ran && has_first) prefill_.Observe(Seconds(r.first_token - r.scheduled));
    request_prompt_tokens_.Observe(static_cast<double>(r.prompt_tokens));
  }
  if (has_first && !r.prefill_only) decode_.Observe(Seconds(r.end - r.first_token));
  e2e_.Observe(Seconds(r.end - r.arrival));
  if (!r.prefill_only) {  // the whole output, the imported first token included
    request_generation_tokens_.Observe(static_cast<double>(r.generated_tokens + r.imported));
  }
}

}  // namespace preft::metrics
