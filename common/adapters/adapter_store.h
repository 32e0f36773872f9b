#pragma once

// Pages adapters through three tiers, each with a byte budget and LRU eviction:
//   disk (registered folders) -> host memory (parsed, in the model's dtype, in one huge-page
//   arena) -> compute slots (what a forward may read). On the CPU a compute slot is the host
//   copy itself, counted in both budgets: a second copy in the same memory would only cost
//   its copying (a device backend keeps its own copies of the slots it uses). An adapter
//   held by a running request is pinned in its compute slot; concurrent requests for a
//   missing adapter share one load; loads run on the store's own threads, so the engine
//   thread never waits on disk.
// Every Acquire refreshes the version's place in both LRU lists (a hot adapter keeps its host
// copy too). A copy waiting for compute room is held outside the budget until admitted.
// Versions: Update() swaps an adapter's weights atomically under a new version; pins taken
// before keep the old weights alive until released (requests finish on the version they
// started with).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/adapters/adapter_loader.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::adapters {

struct AdapterStoreOptions {
  int64_t host_bytes = int64_t{4} << 30;     // parsed adapters kept in host memory
  int64_t compute_bytes = int64_t{1} << 30;  // compute slots (pinned + cached)
  int loader_threads = 1;
  // Loader threads run this much nicer than the process (Linux keeps a nice value per thread):
  // a load then takes mostly what the engine leaves, instead of a core's fair share that
  // stalls a whole parallel step. 0 keeps the process's. Measured on a busy 2-core host
  // (bench/NOTES.md step 17): LoRAP at 512 adapters moved -2 to +7 points of base-only
  // throughput (within that host's noise); each load took 45 -> 60-75 ms.
  int loader_nice = 10;
  LoadOptions load;  // max_rank; load.dtype is the compute dtype (the model's)
};

// A pinned adapter: the weights stay valid and resident while any copy of the pin lives.
struct AdapterPin {
  std::shared_ptr<const model::AdapterWeights> weights;
  std::string name;
  int64_t version = 0;
};

// Counters, exact (taken under the store's lock). Each Acquire of a registered adapter counts
// exactly once, as a compute hit, as the start of a load (a "flight", which ends as one host hit,
// disk load or load failure), or as joining a flight already pending; so, outside shutdown:
//   Acquire calls on registered names
//     == compute_hits + joined + host_hits + disk_loads + load_failures.
// Acquires answered NotFound or Cancelled (store shutting down) count nowhere, nor does Update().
struct AdapterStoreStats {
  int64_t compute_hits = 0;   // Acquire found the version in a compute slot (answered at once)
  int64_t joined = 0;         // Acquire joined a flight for the same version (one load for all)
  int64_t host_hits = 0;      // flights that found the parsed copy in host memory
  int64_t disk_loads = 0;     // flights that read the folder from disk
  int64_t load_failures = 0;  // flights that failed: the loader's error, or ResourceExhausted
                              // (the adapter alone exceeds a tier's whole budget)
  // Time loader threads spent reading and parsing adapters from disk, failures included:
  // over disk_loads, what one load costs (what a request waits beyond it is queueing).
  int64_t disk_load_micros = 0;
  // Copies dropped to make room (LRU). Dropping a superseded or unregistered version's copies
  // is not an eviction.
  int64_t compute_evictions = 0;
  int64_t host_evictions = 0;
  // Bytes held in each tier (AdapterWeights::bytes()). Compute counts every compute copy,
  // pinned copies of superseded versions included; the host and compute tiers share one
  // object and count its bytes in both.
  int64_t compute_bytes_used = 0;
  int64_t host_bytes_used = 0;
  int64_t pinned = 0;  // versions with live pins (superseded versions included)
};

struct AdapterInfo {
  std::string name;
  std::string dir;
  int64_t version = 0;
  bool in_host = false;
  bool in_compute = false;
  int64_t pins = 0;  // outstanding Acquire grants on the current version
  int64_t bytes = 0;   // of its weights in the compute dtype once loaded (kept after
                       // eviction); 0 if never loaded
};

// Thread-safe: every method may be called from any thread. Callbacks run without the store's
// lock held, so they may call back into the store (and release pins) freely; they run on the
// Acquire caller's thread (compute hit, NotFound) or on a loader thread, so they should be
// quick (hand the pin to the engine's queue).
class AdapterStore {
 public:
  using AcquireCallback = std::function<void(absl::StatusOr<AdapterPin>)>;

  AdapterStore(const model::ModelConfig& base, const AdapterStoreOptions& options);
  // Stops the loader threads after the loads they are running (a load is not interrupted) and
  // answers every pending Acquire with Cancelled. Pins should be released first; one that
  // outlives the store still keeps its weights valid.
  ~AdapterStore();

  // Names a folder (not read yet) as version 1. AlreadyExists if the name is taken.
  absl::Status Register(const std::string& name, const std::string& dir);
  // Loads and validates `dir` on the caller's thread (an admin call) and makes it the adapter's
  // next version; returns that version. On any error (the loader's, or ResourceExhausted when
  // it alone exceeds a tier's budget) the current version stays. The new version goes to host
  // memory (evicting LRU copies) and to a compute slot if one is free without evicting.
  // Acquires issued before the swap (pinned or still pending) keep the old weights; its
  // compute copy is dropped when its last pin is released.
  absl::StatusOr<int64_t> Update(const std::string& name, const std::string& dir);
  // Forgets the adapter: later Acquires get NotFound; pins and Acquires already pending are
  // served with the weights they asked for. NotFound if unknown. The name may be registered
  // again (starting at version 1).
  absl::Status Unregister(const std::string& name);

  // Calls `done` with a pin on the current version: at once (on the caller's thread) when it
  // is in a compute slot or the name is unknown (NotFound); otherwise returns at once and
  // calls `done` from a loader thread once loaded, or with the error (the loader's, or
  // ResourceExhausted if the adapter alone exceeds a tier's budget). A failed load is not
  // remembered: the next Acquire tries again. When the compute slots are full of pinned
  // adapters the call waits, in arrival order, until pins are released.
  void Acquire(const std::string& name, AcquireCallback done);
  // Acquire and wait (CLI and tests). Never call it from a loader callback, nor while holding
  // pins that might be needed to make room.
  absl::StatusOr<AdapterPin> AcquireBlocking(const std::string& name);

  std::vector<AdapterInfo> List() const;  // sorted by name
  AdapterStoreStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace preft::adapters
