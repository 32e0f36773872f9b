#include "common/transport/inproc_transport.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"

namespace preft::transport {

// A transport's receiving side. Deliveries into one transport are serialised by
// `deliver_mu` (so its DoneNotice runs on one thread at a time, as with UCX's progress thread);
// `busy` counts the one under way, so the owner going away waits for it and later ones find
// `alive` false. `cache`, `layout` and `on_done` are set by Start before `alive` and read by
// deliveries only while they hold `busy`.
struct InprocTransport::Endpoint {
  absl::Mutex deliver_mu;
  absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = false;  // between Start and destruction
  int busy ABSL_GUARDED_BY(mu) = 0;
  kv::KvCache* cache = nullptr;
  KvLayout layout;
  DoneNotice on_done;
};

namespace {

// Address -> endpoint of every started, live transport of this process.
class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry;  // never destroyed: transports may outlive main
    return *registry;
  }
  void Add(const std::string& address, std::shared_ptr<InprocTransport::Endpoint> endpoint) {
    absl::MutexLock lock(&mu_);
    endpoints_[address] = std::move(endpoint);
  }
  void Remove(const std::string& address) {
    absl::MutexLock lock(&mu_);
    endpoints_.erase(address);
  }
  std::shared_ptr<InprocTransport::Endpoint> Find(const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto it = endpoints_.find(address);
    return it == endpoints_.end() ? nullptr : it->second;
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<InprocTransport::Endpoint>> endpoints_
      ABSL_GUARDED_BY(mu_);
};

std::string NextAddress() {
  static std::atomic<int64_t> next{0};
  return absl::StrCat("inproc:", next.fetch_add(1));
}

}  // namespace

InprocTransport::InprocTransport() : address_(NextAddress()), self_(std::make_shared<Endpoint>()) {
  worker_ = std::thread([this] { Run(); });
}

InprocTransport::~InprocTransport() {
  Registry::Get().Remove(address_);
  {
    // Waits for a delivery into our cache that is under way; later ones find us dead.
    absl::MutexLock lock(&self_->mu);
    self_->alive = false;
    self_->mu.Await(absl::Condition(
        +[](Endpoint* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu) { return e->busy == 0; },
        self_.get()));
    self_->cache = nullptr;
    self_->on_done = nullptr;
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  worker_.join();
}

absl::Status InprocTransport::Start(kv::KvCache* cache, const KvLayout& layout,
                                    DoneNotice on_done) {
  if (cache == nullptr) return absl::InvalidArgumentError("inproc transport: cache is null");
  {
    absl::MutexLock lock(&self_->mu);
    if (self_->alive || self_->cache != nullptr) {
      return absl::FailedPreconditionError("inproc transport: Start called twice");
    }
    self_->cache = cache;
    self_->layout = layout;
    self_->on_done = std::move(on_done);
    self_->alive = true;
  }
  Registry::Get().Add(address_, self_);
  return absl::OkStatus();
}

absl::StatusOr<PeerId> InprocTransport::Connect(const std::string& peer_address) {
  KvLayout local;
  {
    absl::MutexLock lock(&self_->mu);
    if (!self_->alive) {
      return absl::FailedPreconditionError("inproc transport: Connect before Start");
    }
    local = self_->layout;
  }
  std::shared_ptr<Endpoint> peer = Registry::Get().Find(peer_address);
  if (peer == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("inproc transport: no live transport at '", peer_address, "'"));
  }
  {
    absl::MutexLock lock(&peer->mu);
    if (!peer->alive) {
      return absl::UnavailableError(
          absl::StrCat("inproc transport: ", peer_address, " has shut down"));
    }
    PREFT_RETURN_IF_ERROR(CheckPeerLayout(local, peer->layout.Hash(),
                                          absl::StrCat("peer ", peer_address),
                                          peer->layout.ToString()));
  }
  absl::MutexLock lock(&mu_);
  peers_.push_back(std::move(peer));
  return static_cast<PeerId>(peers_.size() - 1);
}

void InprocTransport::Write(PeerId peer, const BlockTransfer& transfer,
                            std::function<void(absl::Status)> done) {
  absl::MutexLock lock(&mu_);
  jobs_.push_back(Job{peer, transfer, std::move(done), absl::Now()});
}

TransportStats InprocTransport::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void InprocTransport::Run() {
  while (true) {
    Job job;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](InprocTransport* t)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) { return t->stopping_ || !t->jobs_.empty(); },
          this));
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
      stopping = stopping_;
    }
    int64_t bytes = 0;
    absl::Status status =
        stopping ? absl::UnavailableError("inproc transport: shut down") : Deliver(job, &bytes);
    {
      absl::MutexLock lock(&mu_);
      stats_.Record(status.ok(), bytes, absl::ToDoubleSeconds(absl::Now() - job.start));
    }
    if (job.done) job.done(std::move(status));
  }
}

absl::Status InprocTransport::Deliver(const Job& job, int64_t* bytes) {
  std::shared_ptr<Endpoint> peer;
  {
    absl::MutexLock lock(&mu_);
    if (job.peer < 0 || job.peer >= static_cast<PeerId>(peers_.size())) {
      return absl::UnavailableError(
          absl::StrCat("inproc transport: unknown peer ", job.peer, " (not from Connect)"));
    }
    peer = peers_[job.peer];
  }
  kv::KvCache* local = nullptr;
  {
    absl::MutexLock lock(&self_->mu);
    if (!self_->alive) return absl::FailedPreconditionError("inproc transport: not started");
    local = self_->cache;  // owned by the caller, which keeps it while writes are under way
  }
  absl::MutexLock deliver_lock(&peer->deliver_mu);
  {
    absl::MutexLock lock(&peer->mu);
    if (!peer->alive) return absl::UnavailableError("inproc transport: peer has shut down");
    ++peer->busy;
  }
  absl::Status status = Copy(job.transfer, *local, peer->cache, bytes);
  if (status.ok() && peer->on_done) {
    peer->on_done(job.transfer.reservation_id, job.transfer.generation);
  }
  absl::MutexLock lock(&peer->mu);
  --peer->busy;
  return status;
}

absl::Status InprocTransport::Copy(const BlockTransfer& t, kv::KvCache& local, kv::KvCache* remote,
                                   int64_t* bytes) {
  const kv::KvCacheShape& shape = local.shape();
  absl::Status valid = ValidateTransfer(t, shape.num_blocks, remote->shape().num_blocks);
  if (!valid.ok()) return valid;
  // Connect compared layouts, so block sizes and layer counts agree.
  const int64_t block_bytes = shape.block_bytes();
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    for (size_t i = 0; i < t.src_blocks.size(); ++i) {
      std::memcpy(remote->block_data(layer, t.dst_blocks[i]),
                  local.block_data(layer, t.src_blocks[i]), block_bytes);
    }
  }
  *bytes = block_bytes * static_cast<int64_t>(t.src_blocks.size()) * shape.num_layers;
  return absl::OkStatus();
}

}  // namespace preft::transport
