#pragma once

// UcxTransport's implementation, shared by ucx_transport.cc (start-up, the progress loop,
// teardown) and ucx_transfer.cc (the write protocol: puts, flush, DONE, ACK, failures).
// Internal to transport/ucx.

#include <ucp/api/ucp.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/transport/ucx/ucx_address.h"
#include "common/transport/ucx/ucx_transport.h"

namespace preft::transport {
namespace ucx_internal {

// Active message ids of this protocol (a worker serves only this protocol).
constexpr unsigned kAmDone = 1;
constexpr unsigned kAmAck = 2;
constexpr uint32_t kDoneMagic = 0x4b56444e;  // "KVDN"

struct DoneHeader {
  uint64_t seq;  // the writer's transfer number, echoed in the ACK
  uint64_t reservation_id;
  uint32_t generation;
  uint32_t magic;
};

struct AckHeader {
  uint64_t seq;
};

}  // namespace ucx_internal

// Owns the UCP context, worker and registration; every UCX call after Start is made on its
// progress thread (see UcxTransport's comment for the contract).
class UcxTransport::Impl {
 public:
  using Clock = std::chrono::steady_clock;
  using DoneHeader = ucx_internal::DoneHeader;

  explicit Impl(UcxTransportOptions options) : options_(std::move(options)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Impl();

  absl::Status Start(kv::KvCache* cache, const KvLayout& layout, DoneNotice on_done);
  std::string LocalAddress() const {
    absl::MutexLock lock(&mu_);
    return address_;
  }
  absl::StatusOr<PeerId> Connect(const std::string& peer_address);
  void Write(PeerId peer, const BlockTransfer& transfer, std::function<void(absl::Status)> done);
  TransportStats stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }
  std::vector<std::string> transports() const {
    absl::MutexLock lock(&mu_);
    return transports_;
  }

 private:
  // A connected peer. Owned by the progress thread; never erased before the worker is
  // destroyed (its address is the endpoint's error-callback argument).
  struct Peer {
    Impl* impl = nullptr;
    PeerId id = 0;
    ucp_ep_h ep = nullptr;
    ucp_rkey_h rkey = nullptr;
    void* close_request = nullptr;  // a force-close under way
    UcxPeerAddress address;
    absl::Status failed;  // OK while usable
  };

  // A write under way. Lives until `done` has been called and no UCX operation refers to it.
  struct Transfer {
    Impl* impl = nullptr;
    uint64_t seq = 0;
    PeerId peer = 0;
    BlockTransfer blocks;
    std::function<void(absl::Status)> done;
    Clock::time_point start;
    Clock::time_point deadline;
    int64_t bytes = 0;
    DoneHeader header{};
    int pending_ops = 0;  // UCX requests whose callbacks will still name this transfer
    bool finished = false;
    // Scattered source blocks bound for one run of destination blocks, gathered so the run
    // goes out as one put (read by UCX until the flush completes).
    std::vector<std::vector<char>> staging;
  };

  struct ConnectCommand {
    UcxPeerAddress address;
    absl::Mutex mu;
    bool answered ABSL_GUARDED_BY(mu) = false;
    absl::StatusOr<PeerId> result ABSL_GUARDED_BY(mu) = absl::UnknownError("unanswered");
  };
  struct WriteCommand {
    PeerId peer;
    BlockTransfer blocks;
    std::function<void(absl::Status)> done;
    Clock::time_point start;
  };
  using Command = std::variant<std::shared_ptr<ConnectCommand>, WriteCommand>;

  struct OpEvent {
    uint64_t seq;
    ucs_status_t status;
  };
  struct Notice {
    ucp_ep_h reply_ep;
    DoneHeader header;
  };

  // Progress thread.
  void Run();
  bool WaitForStart();
  void Execute(Command command);
  void Answer(ConnectCommand& command, absl::StatusOr<PeerId> result);
  absl::StatusOr<PeerId> DoConnect(const UcxPeerAddress& address);
  void StartTransfer(WriteCommand command);
  void SendDone(Transfer& transfer);
  void Finish(Transfer& transfer, absl::Status status);
  void FailPeer(Peer& peer, const absl::Status& status);
  bool HandleEvents();
  void ReapClosedPeers();
  void CheckDeadlines();
  void Sleep(bool in_flight);
  void Shutdown();
  void RunCompletions();
  void Release(uint64_t seq);
  void Complete(std::function<void(absl::Status)> done, absl::Status status,
                Clock::time_point start, int64_t bytes);

  // UCX callbacks: they run inside ucp_worker_progress on the progress thread and only record
  // what happened; HandleEvents acts on it after progress returns.
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnFlushed(void* request, ucs_status_t status, void* user_data);
  static void OnDoneSent(void* request, ucs_status_t status, void* user_data);
  static void OnAckSent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnDoneMessage(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAckMessage(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);

  const UcxTransportOptions options_;

  // Written by Start before `started_`, then read-only.
  kv::KvCache* cache_ = nullptr;
  KvLayout layout_;
  DoneNotice on_done_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  int efd_ = -1;

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Command> commands_ ABSL_GUARDED_BY(mu_);
  std::string address_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> transports_ ABSL_GUARDED_BY(mu_);
  TransportStats stats_ ABSL_GUARDED_BY(mu_);

  // Progress thread only.
  std::map<PeerId, std::unique_ptr<Peer>> peers_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Transfer>> transfers_;
  // Staging buffers are reused (same pages, same UCX registration-cache entries: a fresh
  // buffer per put cost more than the puts it saved). Those of a transfer that failed with puts
  // possibly in flight are retired until the transport goes.
  std::vector<std::vector<char>> staging_pool_;
  bool gather_scattered_ = false;  // set at Start: network transports only
  std::vector<std::vector<char>> retired_staging_;
  uint64_t next_seq_ = 1;
  std::vector<OpEvent> flushed_, done_sent_;
  std::vector<uint64_t> acked_;
  std::vector<Notice> notices_;
  std::vector<std::pair<PeerId, ucs_status_t>> peer_errors_;
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> completions_;
  bool shutting_down_ = false;  // peers dropped from now on are not news

  std::thread thread_;  // last: starts after every field above is constructed
};

}  // namespace preft::transport
