#include "common/transport/ucx/ucx_transport.h"

#include <poll.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "absl/strings/str_join.h"
#include "common/log/log.h"
#include "common/transport/ucx/ucx_context.h"
#include "common/transport/ucx/ucx_transport_impl.h"

namespace preft::transport {

using ucx_internal::kAmAck;
using ucx_internal::kAmDone;

// ---- Start and teardown (caller's thread) ----

absl::Status UcxTransport::Impl::Start(kv::KvCache* cache, const KvLayout& layout,
                                       DoneNotice on_done) {
  {
    absl::MutexLock lock(&mu_);
    if (started_ || context_ != nullptr) {
      return absl::FailedPreconditionError("UCX transport: Start called twice");
    }
  }
  if (cache == nullptr) return absl::InvalidArgumentError("UCX transport: cache is null");
  cache_ = cache;
  layout_ = layout;
  on_done_ = std::move(on_done);

  absl::StatusOr<ucp_context_h> context = CreateUcpContext(options_);
  if (!context.ok()) return context.status();
  context_ = *context;
  ucs_status_t st;

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Start (this thread) sets the worker up, then only the progress thread touches it.
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(context_, &worker_params, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return UcxError("ucp_worker_create", st);
  }
  if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;  // then poll with short sleeps

  for (auto [id, cb] : {std::pair{kAmDone, &OnDoneMessage}, std::pair{kAmAck, &OnAckMessage}}) {
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    handler.id = id;
    handler.cb = cb;
    handler.arg = this;
    handler.flags = UCP_AM_FLAG_WHOLE_MSG;
    st = ucp_worker_set_am_recv_handler(worker_, &handler);
    if (st != UCS_OK) return UcxError("ucp_worker_set_am_recv_handler", st);
  }

  ucp_mem_map_params_t map{};
  map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  map.address = cache->layer_data(0);
  map.length = cache->bytes();
  st = ucp_mem_map(context_, &map, &memh_);
  if (st != UCS_OK) {
    memh_ = nullptr;
    return UcxError("ucp_mem_map (KV cache)", st);
  }

  UcxPeerAddress self;
  self.layout = layout;
  self.num_blocks = cache->shape().num_blocks;
  self.base = reinterpret_cast<uint64_t>(cache->layer_data(0));
  self.bytes = cache->bytes();
  void* rkey = nullptr;
  size_t rkey_size = 0;
  st = ucp_rkey_pack(context_, memh_, &rkey, &rkey_size);
  if (st != UCS_OK) return UcxError("ucp_rkey_pack", st);
  self.rkey.assign(static_cast<const char*>(rkey), rkey_size);
  ucp_rkey_buffer_release(rkey);
  ucp_address_t* worker_address = nullptr;
  size_t worker_address_size = 0;
  st = ucp_worker_get_address(worker_, &worker_address, &worker_address_size);
  if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
  self.worker_address.assign(reinterpret_cast<const char*>(worker_address), worker_address_size);
  ucp_worker_release_address(worker_, worker_address);

  std::vector<std::string> transports = ContextTransports(context_);
  const char* env_tls = std::getenv("UCX_TLS");
  const char* env_devices = std::getenv("UCX_NET_DEVICES");
  log::Info(
      "ucx: started, transports {} (tls={} net_devices={}), {} bytes of KV registered, address {} "
      "bytes, {}",
      absl::StrJoin(transports, ","),
      !options_.tls.empty() ? options_.tls.c_str() : env_tls ? env_tls : "default",
      !options_.net_devices.empty() ? options_.net_devices.c_str()
      : env_devices                 ? env_devices
                                    : "default",
      cache->bytes(), worker_address_size,
      efd_ >= 0 ? "event-driven progress" : "polled progress (no event fd)");
  // Over shared memory a put is already a copy: gathering would add one. Over the network the
  // per-put cost dominates, so scattered source blocks are gathered first.
  gather_scattered_ = true;
  for (const std::string& t : transports) {
    if (t == "posix" || t == "sysv" || t == "cma" || t == "xpmem" || t == "knem") {
      gather_scattered_ = false;
    }
  }
  absl::MutexLock lock(&mu_);
  address_ = EncodeUcxPeerAddress(self);
  transports_ = std::move(transports);
  started_ = true;
  return absl::OkStatus();
}

UcxTransport::Impl::~Impl() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (worker_ != nullptr) ucp_worker_signal(worker_);
  thread_.join();
  // The progress thread has closed every endpoint it could; what is left goes with the worker.
  for (auto& [id, peer] : peers_) {
    if (peer->close_request != nullptr) ucp_request_free(peer->close_request);
    if (peer->rkey != nullptr) ucp_rkey_destroy(peer->rkey);
  }
  if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

// ---- Public calls (any thread) ----

absl::StatusOr<PeerId> UcxTransport::Impl::Connect(const std::string& peer_address) {
  {
    absl::MutexLock lock(&mu_);
    if (!started_) return absl::FailedPreconditionError("UCX transport: Connect before Start");
  }
  absl::StatusOr<UcxPeerAddress> address = DecodeUcxPeerAddress(peer_address);
  if (!address.ok()) return address.status();
  PREFT_RETURN_IF_ERROR(CheckPeerLayout(layout_, address->layout.Hash(), "the UCX peer",
                                        address->layout.ToString()));
  // The hashes matched, so the peer's elements are the size of ours (same dtype).
  const int64_t bytes_per_block = address->layout.num_layers * 2 * address->layout.num_kv_heads *
                                  address->layout.block_tokens * address->layout.head_dim *
                                  cache_->shape().element_bytes();
  if (address->num_blocks <= 0 ||
      address->bytes != static_cast<uint64_t>(address->num_blocks * bytes_per_block)) {
    return absl::InvalidArgumentError(absl::StrCat("UCX peer address: ", address->bytes,
                                                   " bytes registered for ", address->num_blocks,
                                                   " blocks of ", bytes_per_block, " bytes"));
  }
  auto command = std::make_shared<ConnectCommand>();
  command->address = *std::move(address);
  {
    absl::MutexLock lock(&mu_);
    commands_.push_back(command);
  }
  ucp_worker_signal(worker_);
  absl::MutexLock lock(&command->mu);
  const bool answered =
      command->mu.AwaitWithTimeout(absl::Condition(&command->answered), options_.connect_timeout);
  if (!answered) {
    return absl::DeadlineExceededError(absl::StrCat(
        "UCX transport: Connect not done within ", absl::FormatDuration(options_.connect_timeout)));
  }
  return command->result;
}

void UcxTransport::Impl::Write(PeerId peer, const BlockTransfer& transfer,
                               std::function<void(absl::Status)> done) {
  ucp_worker_h worker = nullptr;
  {
    absl::MutexLock lock(&mu_);
    commands_.push_back(WriteCommand{peer, transfer, std::move(done), Clock::now()});
    if (started_) worker = worker_;
  }
  if (worker != nullptr) ucp_worker_signal(worker);
}

// ---- Progress thread ----

bool UcxTransport::Impl::WaitForStart() {
  while (true) {
    std::deque<Command> early;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Impl* impl) ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl->mu_) {
            return impl->started_ || impl->stopping_ || !impl->commands_.empty();
          },
          this));
      if (started_) return true;
      early.swap(commands_);
      stopping = stopping_;
    }
    for (Command& command : early) {
      if (auto* write = std::get_if<WriteCommand>(&command)) {
        Complete(std::move(write->done),
                 absl::FailedPreconditionError("UCX transport: Write before Start"), write->start,
                 0);
      }
    }
    RunCompletions();
    if (stopping) return false;
  }
}

void UcxTransport::Impl::Run() {
  if (!WaitForStart()) return;
  auto last_activity = Clock::now();
  while (true) {
    std::deque<Command> commands;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      commands.swap(commands_);
    }
    bool active = !commands.empty();
    for (Command& command : commands) Execute(std::move(command));
    // Bounded, so commands and deadlines are looked at even under a stream of events.
    for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) active = true;
    active |= HandleEvents();
    ReapClosedPeers();
    CheckDeadlines();
    RunCompletions();
    const auto now = Clock::now();
    if (active) {
      last_activity = now;
    } else if (now - last_activity > absl::ToChronoMicroseconds(options_.spin)) {
      Sleep(!transfers_.empty());
    }
  }
  Shutdown();
}

void UcxTransport::Impl::Sleep(bool in_flight) {
  // With work in flight wake up often anyway: not every transport raises an event for every
  // completion (a send that waited for room, say).
  const int timeout_ms = in_flight ? 1 : 100;
  if (efd_ < 0) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](Impl* impl) ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl->mu_) {
                               return impl->stopping_ || !impl->commands_.empty();
                             },
                             this),
                         in_flight ? absl::Microseconds(50) : absl::Milliseconds(2));
    return;
  }
  const ucs_status_t st = ucp_worker_arm(worker_);
  if (st == UCS_ERR_BUSY) return;  // events pending: progress again
  {
    // A command queued before the arm consumed its signal would otherwise wait for the timeout.
    absl::MutexLock lock(&mu_);
    if (stopping_ || !commands_.empty()) return;
  }
  pollfd fd{efd_, POLLIN, 0};
  ::poll(&fd, 1, timeout_ms);
}

void UcxTransport::Impl::Execute(Command command) {
  if (auto* write = std::get_if<WriteCommand>(&command)) {
    StartTransfer(std::move(*write));
    return;
  }
  auto& connect = *std::get<std::shared_ptr<ConnectCommand>>(command);
  Answer(connect, DoConnect(connect.address));
}

void UcxTransport::Impl::Answer(ConnectCommand& command, absl::StatusOr<PeerId> result) {
  absl::MutexLock lock(&command.mu);
  command.result = std::move(result);
  command.answered = true;
}

absl::StatusOr<PeerId> UcxTransport::Impl::DoConnect(const UcxPeerAddress& address) {
  auto peer = std::make_unique<Peer>();
  peer->impl = this;
  peer->id = peers_.empty() ? 0 : peers_.rbegin()->first + 1;
  peer->address = address;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.worker_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &OnEpError;
  params.err_handler.arg = peer.get();
  ucs_status_t st = ucp_ep_create(worker_, &params, &peer->ep);
  if (st != UCS_OK) return UcxError("ucp_ep_create", st);
  st = ucp_ep_rkey_unpack(peer->ep, address.rkey.data(), &peer->rkey);
  if (st != UCS_OK) {
    peer->rkey = nullptr;
    Peer& kept = *peer;
    peers_[peer->id] = std::move(peer);  // kept: the endpoint's error callback may name it
    FailPeer(kept, UcxError("ucp_ep_rkey_unpack", st));
    return kept.failed;
  }
  log::Info("ucx: peer {} connected ({} blocks, {} bytes): {}", peer->id, address.num_blocks,
            address.bytes, EndpointLanes(peer->ep));
  const PeerId id = peer->id;
  peers_[id] = std::move(peer);
  return id;
}

void UcxTransport::Impl::Shutdown() {
  std::deque<Command> commands;
  {
    absl::MutexLock lock(&mu_);
    commands.swap(commands_);
  }
  const absl::Status down = absl::UnavailableError("UCX transport: shut down");
  for (Command& command : commands) {
    if (auto* write = std::get_if<WriteCommand>(&command)) {
      Complete(std::move(write->done), down, write->start, 0);
    } else {
      Answer(*std::get<std::shared_ptr<ConnectCommand>>(command), down);
    }
  }
  shutting_down_ = true;
  for (auto& [id, peer] : peers_) FailPeer(*peer, down);
  // Bounded: force-closes complete locally, without the peers.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    bool closing = false;
    for (auto& [id, peer] : peers_) closing |= peer->close_request != nullptr;
    bool busy = false;
    for (auto& [seq, transfer] : transfers_) busy |= transfer->pending_ops > 0;
    if (!closing && !busy) break;
    if (ucp_worker_progress(worker_) == 0) std::this_thread::yield();
    HandleEvents();
    ReapClosedPeers();
  }
  RunCompletions();
}

// ---- UcxTransport ----

UcxTransport::UcxTransport(UcxTransportOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
UcxTransport::~UcxTransport() = default;

absl::Status UcxTransport::Start(kv::KvCache* cache, const KvLayout& layout, DoneNotice on_done) {
  return impl_->Start(cache, layout, std::move(on_done));
}
std::string UcxTransport::LocalAddress() const { return impl_->LocalAddress(); }
absl::StatusOr<PeerId> UcxTransport::Connect(const std::string& peer_address) {
  return impl_->Connect(peer_address);
}
void UcxTransport::Write(PeerId peer, const BlockTransfer& transfer,
                         std::function<void(absl::Status)> done) {
  impl_->Write(peer, transfer, std::move(done));
}
TransportStats UcxTransport::stats() const { return impl_->stats(); }
std::string UcxTransport::name() const {
  std::vector<std::string> tls = impl_->transports();
  return tls.empty() ? "ucx" : absl::StrCat("ucx(", absl::StrJoin(tls, ","), ")");
}
std::vector<std::string> UcxTransport::transports() const { return impl_->transports(); }

}  // namespace preft::transport
