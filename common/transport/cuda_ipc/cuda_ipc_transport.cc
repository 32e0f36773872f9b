#include "common/transport/cuda_ipc/cuda_ipc_transport.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/runtime.cuh"
#include "common/log/log.h"
#include "common/transport/cuda_ipc/cuda_ipc_address.h"

namespace preft::transport {
namespace {

namespace cuda = kernels::cuda;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status CudaError(const char* what, int code) {
  return absl::InternalError(absl::StrCat("CUDA IPC transport: ", what, ": ",
                                          cuda::ErrorString(code)));
}

}  // namespace

CudaIpcTransport::CudaIpcTransport(kv::DeviceKvView cache, std::unique_ptr<KvTransport> control)
    : cache_(cache), control_(std::move(control)) {}

CudaIpcTransport::~CudaIpcTransport() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (copier_.joinable()) copier_.join();
  // The control transport fails the notices still waiting for their ACK, whose callbacks
  // count here: before anything else goes.
  control_.reset();
  for (auto& [id, peer] : peers_) {
    if (peer.opened) cuda::IpcClose(peer.base);
  }
  if (stream_ != nullptr) cuda::StreamDestroy(stream_);
}

absl::Status CudaIpcTransport::Start(kv::KvCache* /*host_cache*/, const KvLayout& layout,
                                     DoneNotice on_done) {
  {
    absl::MutexLock lock(&mu_);
    if (started_) return absl::FailedPreconditionError("CUDA IPC transport: started twice");
  }
  if (cache_.base == nullptr) {
    return absl::FailedPreconditionError(
        "CUDA IPC transport: the KV cache is not in device memory (run the worker with "
        "--device cuda)");
  }
  const KvLayout own = KvLayout::ForCache(cache_.shape, layout.model);
  if (own.Hash() != layout.Hash()) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA IPC transport: layout ",
                                                      layout.ToString(),
                                                      " does not describe the device cache ",
                                                      own.ToString()));
  }
  char handle[cuda::kIpcHandleBytes];
  if (int e = cuda::IpcExport(cache_.base, handle); e != 0) return CudaError("export", e);
  handle_.assign(handle, sizeof(handle));
  char bus[32] = {};
  if (int e = cuda::DevicePciBusId(bus, sizeof(bus)); e != 0) return CudaError("device id", e);
  device_ = bus;
  if (int e = cuda::StreamCreate(&stream_); e != 0) return CudaError("stream", e);
  kv::KvCacheShape one = cache_.shape;
  one.num_blocks = 1;
  PREFT_ASSIGN_OR_RETURN(control_cache_, kv::KvCache::Create(one));
  PREFT_RETURN_IF_ERROR(control_->Start(control_cache_.get(), layout, std::move(on_done)));
  absl::MutexLock lock(&mu_);
  started_ = true;
  copier_ = std::thread([this] { CopyLoop(); });
  log::Info("cuda_ipc: KV blocks device to device on GPU {} ({} blocks), notices over {}",
            device_, cache_.shape.num_blocks, control_->name());
  return absl::OkStatus();
}

std::string CudaIpcTransport::LocalAddress() const {
  CudaIpcPeerAddress a;
  a.control = control_->LocalAddress();
  a.node = ThisNode();
  a.pid = getpid();
  a.base = reinterpret_cast<uint64_t>(cache_.base);
  a.handle = handle_;
  a.device = device_;
  a.num_layers = cache_.shape.num_layers;
  a.num_blocks = cache_.shape.num_blocks;
  a.block_bytes = cache_.shape.block_bytes();
  return EncodeCudaIpcPeerAddress(a);
}

absl::StatusOr<PeerId> CudaIpcTransport::Connect(const std::string& peer_address) {
  PREFT_ASSIGN_OR_RETURN(const CudaIpcPeerAddress a, DecodeCudaIpcPeerAddress(peer_address));
  const std::string node = ThisNode();
  if (a.node != node) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA IPC transport: the peer's GPU (", a.device, ") is on node ", a.node,
        ", this worker on ", node, ": CUDA IPC reaches GPUs of one node (use --transport ucx "
        "across nodes)"));
  }
  // The control transport compares the layouts first: its message names a --kv-dtype mismatch,
  // which the block sizes below would only show as a size.
  PREFT_ASSIGN_OR_RETURN(const PeerId control, control_->Connect(a.control));
  if (a.num_layers != cache_.shape.num_layers || a.block_bytes != cache_.shape.block_bytes()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA IPC transport: the peer's cache has ", a.num_layers, " layers of ", a.block_bytes,
        "-byte blocks, this one ", cache_.shape.num_layers, " of ", cache_.shape.block_bytes()));
  }
  Peer peer;
  peer.control = control;
  peer.num_blocks = a.num_blocks;
  peer.handle = a.handle;
  if (a.pid == getpid()) {
    peer.base = reinterpret_cast<char*>(a.base);  // one process: one address space
  } else if (char* earlier = MappedBase(a.handle); earlier != nullptr) {
    peer.base = earlier;  // connected again (after a failure, say): a handle opens once
  } else {
    char handle[cuda::kIpcHandleBytes];
    a.handle.copy(handle, sizeof(handle));
    void* mapped = nullptr;
    if (int e = cuda::IpcOpen(handle, &mapped); e != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CUDA IPC transport: cannot map the peer's cache on GPU ", a.device, " (process ",
          a.pid, "): ", cuda::ErrorString(e)));
    }
    peer.base = static_cast<char*>(mapped);
    peer.opened = true;
  }
  log::Info("cuda_ipc: peer on GPU {} connected (process {}, {})", a.device, a.pid,
            peer.opened ? "mapped through IPC" : "same process");
  absl::MutexLock lock(&mu_);
  const PeerId id = next_peer_++;
  peers_[id] = peer;
  return id;
}

char* CudaIpcTransport::MappedBase(const std::string& handle) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, peer] : peers_) {
    if (peer.opened && peer.handle == handle) return peer.base;
  }
  return nullptr;
}

void CudaIpcTransport::Write(PeerId peer, const BlockTransfer& transfer,
                             std::function<void(absl::Status)> done) {
  absl::MutexLock lock(&mu_);
  if (!started_ || stopping_) {
    // Not on the caller's thread, as the interface promises: the copy thread is not running.
    std::thread([done = std::move(done), started = started_] {
      done(absl::UnavailableError(started ? "CUDA IPC transport: shutting down"
                                          : "CUDA IPC transport: not started"));
    }).detach();
    return;
  }
  queue_.push_back(Command{peer, transfer, std::move(done), Now()});
}

void CudaIpcTransport::CopyLoop() {
  for (;;) {
    Command command;
    Peer peer;
    bool known = false;
    std::deque<Command> abandoned;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CudaIpcTransport* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) {
            return t->stopping_ || !t->queue_.empty();
          },
          this));
      if (stopping_) {
        abandoned.swap(queue_);
      } else {
        command = std::move(queue_.front());
        queue_.pop_front();
        auto it = peers_.find(command.peer);
        if (it != peers_.end()) {
          peer = it->second;
          known = true;
        }
      }
    }
    if (!abandoned.empty() || !command.done) {
      for (Command& c : abandoned) {
        c.done(absl::UnavailableError("CUDA IPC transport: shutting down"));
      }
      return;
    }
    if (!known) {
      Count(false, 0, command.start);
      command.done(absl::UnavailableError(absl::StrCat(
          "CUDA IPC transport: unknown peer ", command.peer, " (not from Connect)")));
      continue;
    }
    int64_t bytes = 0;
    if (absl::Status s = Copy(peer, command.transfer, &bytes); !s.ok()) {
      Count(false, 0, command.start);
      command.done(std::move(s));
      continue;
    }
    // The bytes are on the peer's device: now the notice, as a transfer of no blocks.
    BlockTransfer notice;
    notice.reservation_id = command.transfer.reservation_id;
    notice.generation = command.transfer.generation;
    control_->Write(peer.control, notice,
                    [this, bytes, start = command.start,
                     done = std::move(command.done)](absl::Status s) {
                      Count(s.ok(), s.ok() ? bytes : 0, start);
                      done(std::move(s));
                    });
  }
}

absl::Status CudaIpcTransport::Copy(const Peer& peer, const BlockTransfer& transfer,
                                    int64_t* bytes) {
  PREFT_RETURN_IF_ERROR(ValidateTransfer(transfer, cache_.shape.num_blocks, peer.num_blocks));
  const int64_t block_bytes = cache_.shape.block_bytes();
  const int64_t local_layer = cache_.shape.num_blocks * block_bytes;
  const int64_t remote_layer = peer.num_blocks * block_bytes;
  const char* local = static_cast<const char*>(cache_.base);
  const std::vector<int32_t>& src = transfer.src_blocks;
  const std::vector<int32_t>& dst = transfer.dst_blocks;
  for (int64_t layer = 0; layer < cache_.shape.num_layers; ++layer) {
    for (size_t i = 0; i < src.size();) {
      size_t run = 1;
      while (i + run < src.size() && src[i + run] == src[i] + static_cast<int32_t>(run) &&
             dst[i + run] == dst[i] + static_cast<int32_t>(run)) {
        ++run;
      }
      const int e = cuda::CopyPeer(peer.base + layer * remote_layer + dst[i] * block_bytes,
                                   local + layer * local_layer + src[i] * block_bytes,
                                   run * block_bytes, stream_);
      if (e != 0) {
        cuda::StreamSynchronize(stream_);  // copies queued before it may still be running
        return CudaError("copy", e);
      }
      *bytes += static_cast<int64_t>(run) * block_bytes;
      i += run;
    }
  }
  if (int e = cuda::StreamSynchronize(stream_); e != 0) return CudaError("copy", e);
  return absl::OkStatus();
}

void CudaIpcTransport::Count(bool ok, int64_t bytes, double start) {
  absl::MutexLock lock(&mu_);
  stats_.Record(ok, bytes, Now() - start);
}

TransportStats CudaIpcTransport::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

std::string CudaIpcTransport::name() const { return absl::StrCat("cuda_ipc+", control_->name()); }

}  // namespace preft::transport
