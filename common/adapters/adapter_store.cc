#include "common/adapters/adapter_store.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <list>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"

namespace preft::adapters {
namespace {

using model::AdapterWeights;
using WeightsPtr = std::shared_ptr<const AdapterWeights>;
using Callback = AdapterStore::AcquireCallback;

// A callback and its answer, collected under the lock and called after it is released.
using Ready = std::pair<Callback, absl::StatusOr<AdapterPin>>;

void Fire(std::vector<Ready>* ready) {
  for (auto& [done, result] : *ready) done(std::move(result));
  ready->clear();  // drops any pin a callback did not take, still without the lock
}

// Where a version's pending Acquires stand. At most one flight per version: the single load
// every Acquire that misses the compute tier shares.
enum class Flight { kNone, kQueued, kLoading, kWaitingRoom };

// One version of one adapter. Retired when superseded by Update or removed by Unregister: it
// then leaves both LRU lists and lives on only for its pins and pending Acquires.
struct Version {
  std::string name;
  std::string dir;
  int64_t number = 0;
  bool retired = false;

  WeightsPtr host;  // in the compute dtype; in host_lru_ while set
  int64_t host_bytes = 0;
  std::list<std::shared_ptr<Version>>::iterator host_pos;

  WeightsPtr compute;  // in the compute dtype; in compute_lru_ while set and not retired
  int64_t compute_bytes = 0;
  std::list<std::shared_ptr<Version>>::iterator compute_pos;
  int64_t pins = 0;  // Acquire grants not yet released; pinned while > 0

  Flight flight = Flight::kNone;
  std::vector<Callback> waiters;  // Acquires answered when the flight lands
  WeightsPtr pending;             // kWaitingRoom: the converted copy waiting for room
};
using VersionPtr = std::shared_ptr<Version>;

struct Entry {
  uint64_t id = 0;  // unique per Register, so Update can tell a re-registered name apart
  VersionPtr current;
  int64_t last_version = 0;
};

// Everything the loader threads and the pins share. Pins hold a shared_ptr to it, so a
// pin released after the store is gone still finds it.
class StoreCore : public std::enable_shared_from_this<StoreCore> {
 public:
  StoreCore(const model::ModelConfig& base, const AdapterStoreOptions& options)
      : base_(base), options_(options) {}

  absl::Status Register(const std::string& name, const std::string& dir);
  absl::StatusOr<int64_t> Update(const std::string& name, const std::string& dir);
  absl::Status Unregister(const std::string& name);
  void Acquire(const std::string& name, Callback done);
  std::vector<AdapterInfo> List() const;
  AdapterStoreStats stats() const;

  void LoaderLoop();
  void Stop();
  void CancelPending();  // after the loader threads are joined
  void Release(const VersionPtr& v);

 private:
  // The pin's deleter: the last copy of a pin unpins its version.
  struct Unpin {
    std::shared_ptr<StoreCore> core;
    VersionPtr version;
    WeightsPtr keep;  // keeps the weights alive however the store's copies are dropped
    void operator()(const AdapterWeights*) const { core->Release(version); }
  };

  void RunFlight(const VersionPtr& v, WeightsPtr host, const std::string& dir,
                 std::vector<Ready>* ready);
  // `bytes` of one object, which both tiers hold (see the header).
  absl::Status CheckFits(const std::string& name, const std::string& dir, int64_t bytes) const;
  // Parses `dir` for the host tier (in the compute dtype), on the calling thread.
  absl::StatusOr<WeightsPtr> LoadHost(const std::string& name, const std::string& dir) const;

  AdapterPin MakePin(const VersionPtr& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TouchHost(const VersionPtr& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void InsertHost(const VersionPtr& v, WeightsPtr w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropHost(Version* v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Admit(const VersionPtr& v, std::vector<Ready>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void InstallCompute(const VersionPtr& v, WeightsPtr w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropCompute(Version* v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdmitWaiting(std::vector<Ready>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RoomFreed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Retire(const VersionPtr& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailWaiters(Version* v, const absl::Status& s, std::vector<Ready>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const model::ModelConfig base_;
  const AdapterStoreOptions options_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // loader threads: a job, room to admit, or stop
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool admit_pending_ ABSL_GUARDED_BY(mu_) = false;  // room may have been freed
  uint64_t next_entry_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::deque<VersionPtr> jobs_ ABSL_GUARDED_BY(mu_);        // flights waiting for a loader
  std::deque<VersionPtr> room_ ABSL_GUARDED_BY(mu_);        // loaded, waiting for compute room
  std::list<VersionPtr> host_lru_ ABSL_GUARDED_BY(mu_);     // front = most recent
  std::list<VersionPtr> compute_lru_ ABSL_GUARDED_BY(mu_);  // current versions only
  AdapterStoreStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status StoreCore::Register(const std::string& name, const std::string& dir) {
  absl::MutexLock lock(&mu_);
  if (entries_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("adapter '", name, "' is already registered"));
  }
  Entry& e = entries_[name];
  e.id = next_entry_id_++;
  e.last_version = 1;
  e.current = std::make_shared<Version>();
  e.current->name = name;
  e.current->dir = dir;
  e.current->number = 1;
  return absl::OkStatus();
}

absl::StatusOr<WeightsPtr> StoreCore::LoadHost(const std::string& name,
                                               const std::string& dir) const {
  // Parsed straight to the compute dtype: the compute copy rounds to it anyway, and a bf16
  // LoRA r16 adapter then holds 17.6 MB of host memory instead of 35 MB in f32.
  auto loaded = LoadAdapter(dir, base_, options_.load);
  if (loaded.ok()) return WeightsPtr(*std::move(loaded));
  // The loader's messages name the file; say which adapter it was for.
  const absl::Status& s = loaded.status();
  return absl::Status(s.code(),
                      absl::StrContains(s.message(), dir)
                          ? absl::StrCat("adapter '", name, "': ", s.message())
                          : absl::StrCat("adapter '", name, "' (", dir, "): ", s.message()));
}

absl::Status StoreCore::CheckFits(const std::string& name, const std::string& dir,
                                  int64_t bytes) const {
  if (bytes > options_.host_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "adapter '", name, "' (", dir, ") needs ", bytes,
        " bytes of host memory, more than the store's whole host budget of ", options_.host_bytes));
  }
  if (bytes > options_.compute_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("adapter '", name, "' (", dir, ") needs ", bytes,
                     " bytes in a compute slot, more than the store's whole compute budget of ",
                     options_.compute_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StoreCore::Update(const std::string& name, const std::string& dir) {
  uint64_t entry_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
    }
    entry_id = it->second.id;
  }
  PREFT_ASSIGN_OR_RETURN(WeightsPtr weights, LoadHost(name, dir));
  const int64_t bytes = static_cast<int64_t>(weights->bytes());
  if (absl::Status s = CheckFits(name, dir, bytes); !s.ok()) return s;

  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.id != entry_id) {
    return absl::NotFoundError(
        absl::StrCat("adapter '", name, "' was unregistered while its update loaded"));
  }
  Entry& e = it->second;
  auto v = std::make_shared<Version>();
  v->name = name;
  v->dir = dir;
  v->number = ++e.last_version;
  Retire(e.current);
  e.current = v;
  InsertHost(v, weights);
  // Into a slot only when one is free: an update should not push out adapters in use, nor
  // overtake Acquires waiting for room.
  if (room_.empty() && stats_.compute_bytes_used + bytes <= options_.compute_bytes) {
    InstallCompute(v, std::move(weights));
  }
  return v->number;
}

absl::Status StoreCore::Unregister(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
  }
  Retire(it->second.current);
  entries_.erase(it);
  return absl::OkStatus();
}

void StoreCore::Acquire(const std::string& name, Callback done) {
  absl::StatusOr<AdapterPin> result;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(name);
    if (stopping_) {
      result = absl::CancelledError("the adapter store is shutting down");
    } else if (it == entries_.end()) {
      result = absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
    } else {
      const VersionPtr& v = it->second.current;
      TouchHost(v);
      if (v->compute != nullptr) {
        ++stats_.compute_hits;
        compute_lru_.splice(compute_lru_.begin(), compute_lru_, v->compute_pos);
        result = MakePin(v);
      } else {
        v->waiters.push_back(std::move(done));
        if (v->flight == Flight::kNone) {
          v->flight = Flight::kQueued;
          jobs_.push_back(v);
          cv_.Signal();
        } else {
          ++stats_.joined;
        }
        return;
      }
    }
  }
  done(std::move(result));
}

void StoreCore::LoaderLoop() {
  std::vector<Ready> ready;
  for (;;) {
    VersionPtr job;
    WeightsPtr host;
    std::string dir;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && !admit_pending_ && jobs_.empty()) cv_.Wait(&mu_);
      if (stopping_) return;
      if (admit_pending_) {
        admit_pending_ = false;
        AdmitWaiting(&ready);
      } else {
        job = std::move(jobs_.front());
        jobs_.pop_front();
        job->flight = Flight::kLoading;
        host = job->host;
        dir = job->dir;
      }
    }
    if (job != nullptr) RunFlight(job, std::move(host), dir, &ready);
    Fire(&ready);
  }
}

void StoreCore::RunFlight(const VersionPtr& v, WeightsPtr host, const std::string& dir,
                          std::vector<Ready>* ready) {
  const bool from_disk = host == nullptr;
  absl::Status status;
  int64_t load_micros = 0;
  if (from_disk) {
    const absl::Time start = absl::Now();
    absl::StatusOr<WeightsPtr> loaded = LoadHost(v->name, dir);
    load_micros = absl::ToInt64Microseconds(absl::Now() - start);
    if (loaded.ok()) {
      host = *std::move(loaded);
    } else {
      status = loaded.status();
    }
  }
  if (status.ok()) status = CheckFits(v->name, dir, static_cast<int64_t>(host->bytes()));

  absl::MutexLock lock(&mu_);
  stats_.disk_load_micros += load_micros;
  if (stopping_) {
    FailWaiters(v.get(), absl::CancelledError("the adapter store is shutting down"), ready);
    return;
  }
  if (!status.ok()) {
    ++stats_.load_failures;  // not remembered: the next Acquire starts a new flight
    FailWaiters(v.get(), status, ready);
    return;
  }
  ++(from_disk ? stats_.disk_loads : stats_.host_hits);
  v->pending = host;  // the compute tier's copy is the host tier's object
  if (from_disk && !v->retired) InsertHost(v, std::move(host));
  if (!room_.empty() || !Admit(v, ready)) {
    v->flight = Flight::kWaitingRoom;
    room_.push_back(v);
  }
}

void StoreCore::FailWaiters(Version* v, const absl::Status& s, std::vector<Ready>* ready) {
  for (Callback& done : v->waiters) ready->emplace_back(std::move(done), s);
  v->waiters.clear();
  v->pending.reset();
  v->flight = Flight::kNone;
}

AdapterPin StoreCore::MakePin(const VersionPtr& v) {
  PREFT_CHECK(v->compute != nullptr);
  if (v->pins++ == 0) ++stats_.pinned;
  AdapterPin pin;
  pin.weights = WeightsPtr(v->compute.get(), Unpin{shared_from_this(), v, v->compute});
  pin.name = v->name;
  pin.version = v->number;
  return pin;
}

void StoreCore::Release(const VersionPtr& v) {
  absl::MutexLock lock(&mu_);
  PREFT_CHECK(v->pins > 0);
  if (--v->pins > 0) return;
  --stats_.pinned;
  if (v->retired) DropCompute(v.get());  // superseded or unregistered: nobody will ask again
  RoomFreed();                           // an unpinned copy can be evicted now
}

void StoreCore::TouchHost(const VersionPtr& v) {
  if (v->host != nullptr) host_lru_.splice(host_lru_.begin(), host_lru_, v->host_pos);
}

void StoreCore::InsertHost(const VersionPtr& v, WeightsPtr w) {
  PREFT_CHECK(v->host == nullptr);
  const int64_t bytes = static_cast<int64_t>(w->bytes());
  while (stats_.host_bytes_used + bytes > options_.host_bytes && !host_lru_.empty()) {
    DropHost(host_lru_.back().get());
    ++stats_.host_evictions;
  }
  v->host = std::move(w);
  v->host_bytes = bytes;
  stats_.host_bytes_used += bytes;
  host_lru_.push_front(v);
  v->host_pos = host_lru_.begin();
}

void StoreCore::DropHost(Version* v) {
  if (v->host == nullptr) return;
  stats_.host_bytes_used -= v->host_bytes;
  v->host.reset();
  host_lru_.erase(v->host_pos);  // may destroy the list's reference: v must be held elsewhere
}

// Makes room for v's pending copy by evicting unpinned LRU copies, installs it and answers its
// waiters. False, evicting nothing, when pinned copies leave too little room.
bool StoreCore::Admit(const VersionPtr& v, std::vector<Ready>* ready) {
  const int64_t need = static_cast<int64_t>(v->pending->bytes());
  const int64_t budget = options_.compute_bytes;
  if (stats_.compute_bytes_used + need > budget) {
    int64_t evictable = 0;
    for (const VersionPtr& e : compute_lru_) {
      if (e->pins == 0) evictable += e->compute_bytes;
    }
    if (stats_.compute_bytes_used - evictable + need > budget) return false;
    auto it = compute_lru_.end();
    while (stats_.compute_bytes_used + need > budget) {
      --it;
      if ((*it)->pins > 0) continue;
      VersionPtr e = *it;
      it = compute_lru_.erase(it);
      stats_.compute_bytes_used -= e->compute_bytes;
      e->compute.reset();
      ++stats_.compute_evictions;
    }
  }
  InstallCompute(v, std::move(v->pending));
  v->flight = Flight::kNone;
  for (Callback& done : v->waiters) ready->emplace_back(std::move(done), MakePin(v));
  v->waiters.clear();
  return true;
}

void StoreCore::InstallCompute(const VersionPtr& v, WeightsPtr w) {
  PREFT_CHECK(v->compute == nullptr);
  v->compute = std::move(w);
  v->compute_bytes = static_cast<int64_t>(v->compute->bytes());
  stats_.compute_bytes_used += v->compute_bytes;
  if (!v->retired) {  // a retired version's copy lives only for the pins it is about to get
    compute_lru_.push_front(v);
    v->compute_pos = compute_lru_.begin();
  }
}

void StoreCore::DropCompute(Version* v) {
  if (v->compute == nullptr) return;
  stats_.compute_bytes_used -= v->compute_bytes;
  v->compute.reset();
}

void StoreCore::AdmitWaiting(std::vector<Ready>* ready) {
  while (!room_.empty() && Admit(room_.front(), ready)) room_.pop_front();
}

void StoreCore::RoomFreed() {
  if (room_.empty()) return;
  admit_pending_ = true;
  cv_.Signal();
}

void StoreCore::Retire(const VersionPtr& v) {
  v->retired = true;
  DropHost(v.get());
  if (v->compute != nullptr) {
    compute_lru_.erase(v->compute_pos);
    if (v->pins == 0) DropCompute(v.get());
    RoomFreed();
  }
  // A flight in progress still answers its waiters: they asked before the version was retired.
}

std::vector<AdapterInfo> StoreCore::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<AdapterInfo> out;
  out.reserve(entries_.size());
  for (const auto& [name, e] : entries_) {
    const Version& v = *e.current;
    out.push_back({name, v.dir, v.number, v.host != nullptr, v.compute != nullptr, v.pins,
                   std::max(v.host_bytes, v.compute_bytes)});
  }
  return out;
}

AdapterStoreStats StoreCore::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void StoreCore::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  cv_.SignalAll();
}

void StoreCore::CancelPending() {
  std::vector<Ready> ready;
  {
    absl::MutexLock lock(&mu_);
    const absl::Status cancelled = absl::CancelledError("the adapter store is shutting down");
    for (const VersionPtr& v : jobs_) FailWaiters(v.get(), cancelled, &ready);
    for (const VersionPtr& v : room_) FailWaiters(v.get(), cancelled, &ready);
    jobs_.clear();
    room_.clear();
  }
  Fire(&ready);
}

namespace {

// Raises the calling thread's nice value by `by` (capped at 19). Linux schedules threads, and
// setpriority on a thread id changes only that thread. Failure (not expected when lowering a
// priority) leaves it as it was: a load then just costs the engine more.
void LowerThisThreadsPriority(int by) {
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int now = ::getpriority(PRIO_PROCESS, tid);
  if (errno != 0) return;
  (void)::setpriority(PRIO_PROCESS, tid, std::min(19, now + by));
}

}  // namespace

struct AdapterStore::Impl {
  std::shared_ptr<StoreCore> core;
  std::vector<std::thread> loaders;
};

AdapterStore::AdapterStore(const model::ModelConfig& base, const AdapterStoreOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->core = std::make_shared<StoreCore>(base, options);
  const int n = std::max(1, options.loader_threads);
  for (int i = 0; i < n; ++i) {
    impl_->loaders.emplace_back([core = impl_->core.get(), nice = options.loader_nice] {
      if (nice > 0) LowerThisThreadsPriority(nice);
      core->LoaderLoop();
    });
  }
}

AdapterStore::~AdapterStore() {
  impl_->core->Stop();
  for (std::thread& t : impl_->loaders) t.join();
  impl_->core->CancelPending();
}

absl::Status AdapterStore::Register(const std::string& name, const std::string& dir) {
  return impl_->core->Register(name, dir);
}

absl::StatusOr<int64_t> AdapterStore::Update(const std::string& name, const std::string& dir) {
  return impl_->core->Update(name, dir);
}

absl::Status AdapterStore::Unregister(const std::string& name) {
  return impl_->core->Unregister(name);
}

void AdapterStore::Acquire(const std::string& name, AcquireCallback done) {
  impl_->core->Acquire(name, std::move(done));
}

absl::StatusOr<AdapterPin> AdapterStore::AcquireBlocking(const std::string& name) {
  absl::Notification done;
  absl::StatusOr<AdapterPin> out;
  Acquire(name, [&](absl::StatusOr<AdapterPin> result) {
    out = std::move(result);
    done.Notify();
  });
  done.WaitForNotification();
  return out;
}

std::vector<AdapterInfo> AdapterStore::List() const { return impl_->core->List(); }

AdapterStoreStats AdapterStore::stats() const { return impl_->core->stats(); }

}  // namespace preft::adapters
