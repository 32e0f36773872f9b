#pragma once

// What the engine reports as it runs, for metrics (common/metrics/engine_metrics.h). Called on
// the engine thread, so implementations must be quick and must not call back into the engine.

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "common/engine/request.h"

namespace preft::engine {

// One forward.
struct StepReport {
  int64_t num_sequences = 0;     // sequences in the batch
  int64_t num_tokens = 0;        // tokens computed (prompt chunks, recomputation, decode rows)
  int64_t prompt_tokens = 0;     // prompt tokens computed for the first time
  int64_t generated_tokens = 0;  // tokens sampled
  int64_t preemptions = 0;       // sequences sent back to the queue to free blocks
  // Prefix caching: tokens of the sequences admitted this step looked up, and found cached;
  // cached blocks whose content was reclaimed this step; blocks cached after it.
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prefix_evictions = 0;
  int64_t cached_blocks = 0;
  absl::Duration forward;
  // For each token sampled after a sequence's first: the time since its previous token.
  std::vector<absl::Duration> inter_token;
};

// One request, as it ends (finished, aborted or failed).
struct RequestReport {
  FinishReason finish = FinishReason::kNone;
  bool prefill_only = false;  // handed over after its first token (prefill tier)
  bool imported = false;      // prompt computed elsewhere (decode tier)
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // of those, served from the prefix cache
  // Tokens this engine sampled (an imported first token was sampled elsewhere).
  int64_t generated_tokens = 0;
  absl::Time arrival;                                // Engine::Add
  absl::Time scheduled = absl::InfinitePast();       // first admitted to a batch
  absl::Time first_token = absl::InfinitePast();     // first token sampled or imported
  absl::Time end;
};

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void OnStep(const StepReport& step) = 0;
  virtual void OnRequestEnd(const RequestReport& request) = 0;
};

}  // namespace preft::engine
