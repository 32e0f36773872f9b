#include "services/router/routing.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/kv/blocks.h"

namespace preft::router {

int64_t BlocksNeeded(int64_t prompt_tokens, int64_t max_new_tokens, int64_t block_tokens) {
  return kv::BlocksFor(prompt_tokens + max_new_tokens, block_tokens);
}

absl::StatusOr<int64_t> EligibleDecode(std::vector<DecodeView>* views, const DecodeNeeds& needs) {
  bool any_healthy = false, any_of_kind = false, any_with_adapters = false;
  for (DecodeView& v : *views) {
    // A colocated router sends Run, which only colocated workers serve; they refuse Reserve.
    const bool of_kind = v.colocated == needs.colocated;
    any_healthy |= v.healthy;
    any_of_kind |= v.healthy && of_kind;
    any_with_adapters |= v.healthy && of_kind && v.adapters;
    if (!of_kind) v.healthy = false;
    // The all-position baseline decodes with the adapter: only workers that run adapters.
    if (!needs.colocated && needs.decode_adapter && !v.adapters) v.healthy = false;
  }
  if (any_healthy && !any_of_kind) {
    return absl::FailedPreconditionError(
        needs.colocated
            ? "this router is --colocated (it sends whole requests with Run), but no decode "
              "worker is: start them with --colocated"
            : "the decode workers are colocated (they run whole requests and refuse Reserve): "
              "start the router with --colocated");
  }
  if (!needs.colocated && needs.decode_adapter && any_of_kind && !any_with_adapters) {
    return absl::FailedPreconditionError(
        "the request applies its adapter to generated tokens (all positions), but no decode "
        "worker runs adapters (start them with --adapters all-positions), or ask for "
        "adapter_positions PROMPT");
  }
  const int64_t bt = views->empty() ? 16 : std::max<int64_t>(1, (*views)[0].block_tokens);
  const int64_t blocks = BlocksNeeded(needs.prompt_tokens, needs.max_new_tokens, bt);
  bool fits_somewhere = false;
  for (const DecodeView& v : *views) fits_somewhere |= v.total_blocks >= blocks;
  if (!views->empty() && !fits_somewhere &&
      std::all_of(views->begin(), views->end(), [](const DecodeView& v) { return v.healthy; })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", needs.prompt_tokens, " tokens + max_tokens ", needs.max_new_tokens,
        " needs ", blocks, " KV blocks; the largest decode worker has ",
        (*views)[0].total_blocks));
  }
  return blocks;
}

std::vector<size_t> RankDecode(const std::vector<DecodeView>& workers, int64_t blocks_needed) {
  std::vector<size_t> order;
  int64_t total_load = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const DecodeView& w = workers[i];
    if (w.healthy && !w.draining && w.free_blocks >= blocks_needed) {
      order.push_back(i);
      total_load += w.running + w.queue_depth;
    }
  }
  const int64_t cap = BoundedLoadCap(total_load, static_cast<int64_t>(order.size()));
  // Free KV blocks alone let a burst fill one worker's batch past max_running while another
  // has places (its engine then queues what the other would run).
  auto key = [&](size_t i) {
    const DecodeView& w = workers[i];
    const int64_t load = w.running + w.queue_depth;
    const bool batch_full = w.max_running > 0 && load >= w.max_running;
    const int64_t prefix = load > cap ? 0 : w.prefix_blocks;
    return std::make_tuple(w.kv_path_suspect, batch_full, -prefix, -(w.free_blocks - blocks_needed),
                           load);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  return order;
}

const char* ResidencyName(Residency r) {
  switch (r) {
    case Residency::kResident:
      return "resident";
    case Residency::kFreeSlot:
      return "free_slot";
    case Residency::kLoading:
      return "loading";
    case Residency::kFull:
      return "full";
  }
  return "?";
}

int64_t BoundedLoadCap(int64_t total_load, int64_t workers) {
  const int64_t n = std::max<int64_t>(1, workers);
  return (5 * (total_load + 1) + 4 * n - 1) / (4 * n);
}

Residency Classify(const PrefillView& w, bool has_adapter, int64_t adapter_bytes) {
  if (!has_adapter || w.adapter_resident) return Residency::kResident;
  if (w.adapter_loading) return Residency::kLoading;
  if (w.adapter_bytes_free >= adapter_bytes) return Residency::kFreeSlot;
  return Residency::kFull;
}

std::vector<size_t> RankPrefill(const std::vector<PrefillView>& workers, bool has_adapter,
                                int64_t adapter_bytes) {
  std::vector<size_t> order;
  int64_t total_load = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    if (workers[i].healthy && !workers[i].draining) {
      order.push_back(i);
      total_load += workers[i].queue_depth + workers[i].running;
    }
  }
  // Bounded-load affinity (consistent hashing with bounded loads): a worker holding the adapter
  // keeps the request only while its load is at most 1.25 x the average (counting this
  // request); past that it competes with the free slots on load, so a hot adapter spreads to an
  // idle worker instead of queueing behind its holder.
  const int64_t cap = BoundedLoadCap(total_load, static_cast<int64_t>(order.size()));
  auto key = [&](size_t i) {
    const PrefillView& w = workers[i];
    const int64_t load = w.queue_depth + w.running;
    Residency r = Classify(w, has_adapter, adapter_bytes);
    if (has_adapter && r == Residency::kResident && load > cap) r = Residency::kFreeSlot;
    const int64_t prefix = load > cap ? 0 : w.prefix_blocks;
    return std::make_tuple(static_cast<int>(r), -prefix, load, i);
  };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  return order;
}

bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kInternal ||
         code == absl::StatusCode::kAborted || code == absl::StatusCode::kUnknown;
}

bool RetryElsewhere(const absl::Status& s, bool client_saw_output) {
  return !s.ok() && Retryable(s.code()) && !client_saw_output;
}

bool WorkerAttempts::Tried(const std::string& address) const {
  return std::find(tried_.begin(), tried_.end(), address) != tried_.end();
}

void WorkerAttempts::Failed(const std::string& address, const absl::Status& s) {
  FailedElsewhere(address, s);
  tried_.push_back(address);
}

void WorkerAttempts::FailedElsewhere(const std::string& address, const absl::Status& s) {
  ++attempts_;
  last_error_ = absl::StrCat(address, ": ", s.message());
}

void WorkerAttempts::ForgetTriedIfAllFailed(size_t workers) {
  if (!tried_.empty() && tried_.size() >= workers) tried_.clear();
}

}  // namespace preft::router
