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
