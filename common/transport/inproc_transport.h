#pragma once

// KvTransport between transports of one process: a process-wide registry maps each
// transport's address ("inproc:<n>") to it, and a write is a memcpy per (layer, block) done on
// the writer's own worker thread, followed by the peer's DoneNotice and then `done`. Used by
// `preft serve` (router, prefill and decode in one process) and by tests.
//
// Thread-safe. Writes of one transport run in order on its worker thread; `done` and the peer's
// DoneNotice are never called on the caller's thread, so a caller may hold its own locks while
// calling Write. Destruction fails queued writes with Unavailable and waits for writes into
// this transport's cache that are in progress; do not destroy a transport from its own `done`
// or DoneNotice callback.

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transport/kv_transport.h"

namespace preft::transport {

class InprocTransport final : public KvTransport {
 public:
  InprocTransport();
  ~InprocTransport() override;
  InprocTransport(const InprocTransport&) = delete;
  InprocTransport& operator=(const InprocTransport&) = delete;

  absl::Status Start(kv::KvCache* cache, const KvLayout& layout, DoneNotice on_done) override;
  std::string LocalAddress() const override { return address_; }
  absl::StatusOr<PeerId> Connect(const std::string& peer_address) override;
  void Write(PeerId peer, const BlockTransfer& transfer,
             std::function<void(absl::Status)> done) override;
  TransportStats stats() const override;
  std::string name() const override { return "inproc"; }

  // What the registry and connected peers share; lives as long as any of them holds it.
  struct Endpoint;

 private:
  struct Job {
    PeerId peer;
    BlockTransfer transfer;
    std::function<void(absl::Status)> done;
    absl::Time start;
  };

  void Run();
  absl::Status Deliver(const Job& job, int64_t* bytes);
  static absl::Status Copy(const BlockTransfer& transfer, kv::KvCache& local, kv::KvCache* remote,
                           int64_t* bytes);

  const std::string address_;
  const std::shared_ptr<Endpoint> self_;

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Endpoint>> peers_ ABSL_GUARDED_BY(mu_);
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  TransportStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

}  // namespace preft::transport
