#pragma once

// The router's placement policy as pure functions over the workers' last reported status, so
// every rule is a unit test. (DESIGN.md §4: decode by free KV and batch load; prefill by adapter
// residency, then queue depth.)

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace preft::router {

struct DecodeView {
  bool healthy = false;   // answered its last Status poll
  bool draining = false;
  int64_t free_blocks = 0;
  int64_t total_blocks = 0;
  int64_t block_tokens = 16;
  int64_t running = 0;
  int64_t queue_depth = 0;
  // Sequences its engine runs at once (0: not reported). A worker with as many running and
  // queued ranks after every worker with a free place in its batch: its engine would queue.
  int64_t max_running = 0;
  bool adapters = false;  // runs adapters on generated tokens (the all-position baseline)
  bool colocated = false;  // runs whole requests (Run), refuses Reserve
  // A prefill worker recently could not deliver KV to it (no acknowledgement, no connection):
  // ranked after every worker that has room and is not suspect, so it is used only as a last
  // resort while the suspicion lasts (RouterOptions::kv_path_suspect).
  bool kv_path_suspect = false;
  // Colocated: leading blocks of this request's prompt it was last given (PrefixAffinity).
  int64_t prefix_blocks = 0;
};

// Where an adapter stands on one prefill worker, best first.
enum class Residency { kResident = 0, kFreeSlot = 1, kLoading = 2, kFull = 3 };
const char* ResidencyName(Residency r);  // "resident", "free_slot", "loading", "full"

struct PrefillView {
  bool healthy = false;
  bool draining = false;
  int64_t queue_depth = 0;
  int64_t running = 0;
  int64_t adapter_bytes_free = 0;
  // The requested adapter version's state there (filled per request by the caller).
  bool adapter_resident = false;  // in a compute slot
  bool adapter_loading = false;
  // Leading blocks of this request's prompt it was last given (PrefixAffinity): probably cached.
  int64_t prefix_blocks = 0;
};

// Blocks a request needs on a decode worker: its prompt and every token it may generate.
int64_t BlocksNeeded(int64_t prompt_tokens, int64_t max_new_tokens, int64_t block_tokens);

// What a request asks of decode workers.
struct DecodeNeeds {
  bool colocated = false;       // the router sends Run (colocated workers only), not Reserve
  bool decode_adapter = false;  // the all-position baseline: the worker must run adapters
  int64_t prompt_tokens = 0;
  int64_t max_new_tokens = 0;
};

// Which decode workers a request may use: marks unfit ones unhealthy in `views` (the other
// deployment kind; no adapters where the request needs them) and returns the blocks it needs
// there. FAILED_PRECONDITION, naming the fix, when healthy workers exist but none is of the
// needed kind (or, all-position, none runs adapters); INVALID_ARGUMENT when every worker is
// healthy and none is large enough. Before the first poll (no healthy worker) it is no error:
// the request waits for capacity like any other.
absl::StatusOr<int64_t> EligibleDecode(std::vector<DecodeView>* views, const DecodeNeeds& needs);

// Indices of decode workers to try, best first: healthy, not draining, with room for
// `blocks_needed` (by the last report); those with a free place in their batch (running +
// queued under max_running) first, then the longest cached prefix among those not over the
// load bound (BoundedLoadCap), then most free blocks (after this request), then the lightest
// batch (running + queued). Workers without room by the report are left out.
std::vector<size_t> RankDecode(const std::vector<DecodeView>& workers, int64_t blocks_needed);

// Consistent hashing with bounded loads (Mirrokni et al.): ceil(1.25 x the average load of
// `workers` workers once this request is added to `total_load`). A worker past it loses its
// affinities for this request.
int64_t BoundedLoadCap(int64_t total_load, int64_t workers);

// The adapter's residency class on a worker (base-model requests: every worker is kResident).
Residency Classify(const PrefillView& w, bool has_adapter, int64_t adapter_bytes);

// Indices of prefill workers to try, best first: healthy and not draining; by residency class
// (resident > free slot > loading > full), then the longest cached prefix, then queue depth +
// running, then index. Both affinities are bounded: a worker whose load (queue depth +
// running) is over BoundedLoadCap ranks as a free slot and as holding no prefix, so an idle
// worker takes the overflow of a hot adapter or a hot system prompt.
std::vector<size_t> RankPrefill(const std::vector<PrefillView>& workers, bool has_adapter,
                                int64_t adapter_bytes);

// ---- Retries: one policy for every tier that tries a request on one worker after another ----

// A worker call that ended with this code may succeed on another worker: the worker is gone
// or failed the call itself. Anything else is about the request, and no other worker helps.
bool Retryable(absl::StatusCode code);

// Whether a request whose worker call ended with `s` runs again elsewhere: only for a
// retryable failure, and only while the client has seen none of this attempt's answer
// (tokens already streamed cannot be taken back).
bool RetryElsewhere(const absl::Status& s, bool client_saw_output);

// One request's walk over the workers of a tier: at most `max_attempts` calls, each failed
// worker left out of the next choice. When no worker may be chosen and every one has failed
// once (ForgetTriedIfAllFailed), they may all be tried again: a worker that restarted may
// take the request.
class WorkerAttempts {
 public:
  WorkerAttempts(int max_attempts, std::string no_worker_error)
      : max_attempts_(max_attempts), last_error_(std::move(no_worker_error)) {}

  bool exhausted() const { return attempts_ >= max_attempts_; }
  bool Tried(const std::string& address) const;
  // Marks the workers tried so far unhealthy in `views` (parallel to `workers`, whose
  // elements point to something with an `address`).
  template <typename WorkerPtr, typename View>
  void ExcludeTried(const std::vector<WorkerPtr>& workers, std::vector<View>* views) const {
    for (size_t i = 0; i < views->size(); ++i) {
      if (Tried(workers[i]->address)) (*views)[i].healthy = false;
    }
  }
  // An attempt on `address` failed with `s` (an attempt; the worker is left out next time).
  void Failed(const std::string& address, const absl::Status& s);
  // A failure that counts as an attempt but blames no worker of this tier (the KV path to a
  // decode worker): recorded as the last error only.
  void FailedElsewhere(const std::string& address, const absl::Status& s);
  void ForgetTriedIfAllFailed(size_t workers);
  // "<address>: <message>" of the last failure, or the error given when none was tried.
  const std::string& last_error() const { return last_error_; }
  int max_attempts() const { return max_attempts_; }

 private:
  const int max_attempts_;
  int attempts_ = 0;
  std::vector<std::string> tried_;
  std::string last_error_;
};

}  // namespace preft::router
