#pragma once

// KvTransport between GPU workers of one node: KV blocks move device to device, never through
// host memory. Each peer's device cache is mapped once (CUDA IPC; a peer in the same process
// is reached through its pointer), a Write is one copy per layer and run of blocks
// consecutive on both sides, on a stream of the transport's own, and once the copies are done
// the DONE notice and its ACK travel over a control transport (UCX) as a transfer of no
// blocks. So reservations, generations, leases, timeouts and peer failures follow the
// control transport's rules exactly; only the bytes take another path (as NIXL does: one
// agent, a data path per memory kind).
//
// The prefill engine's forward must be finished with the blocks before Write: CudaBackend
// samples on its stream and waits for the tokens, so a prompt handed over after its first
// token is complete. The receiver's forward reads the blocks after the DONE notice, which
// follows the copies' completion.
//
// Across nodes an IPC handle cannot be opened: Connect refuses a peer on another node
// (FailedPrecondition naming both) before trying. The cache must be the start of its own
// device allocation (DeviceKvCache's is). The copy thread uses the current device of the
// thread that called Start.

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/kv/kv_cache.h"
#include "common/transport/kv_transport.h"

namespace preft::transport {

class CudaIpcTransport final : public KvTransport {
 public:
  // `cache`: the device cache transfers read and write; `control` carries the notices (it is
  // started with a one-block host cache of this transport's, which no transfer touches).
  CudaIpcTransport(kv::DeviceKvView cache, std::unique_ptr<KvTransport> control);
  ~CudaIpcTransport() override;
  CudaIpcTransport(const CudaIpcTransport&) = delete;
  CudaIpcTransport& operator=(const CudaIpcTransport&) = delete;

  // `host_cache` is not used (null is fine): the device cache given at construction is.
  // FailedPrecondition when the device cache cannot be exported or its shape differs from
  // `layout`.
  absl::Status Start(kv::KvCache* host_cache, const KvLayout& layout, DoneNotice on_done) override;
  std::string LocalAddress() const override;
  absl::StatusOr<PeerId> Connect(const std::string& peer_address) override;
  void Write(PeerId peer, const BlockTransfer& transfer,
             std::function<void(absl::Status)> done) override;
  TransportStats stats() const override;
  std::string name() const override;  // "cuda_ipc+" and the control's, "cuda_ipc+ucx(posix,self)"
  bool moves_device_memory() const override { return true; }

 private:
  struct Peer {
    PeerId control = 0;
    char* base = nullptr;  // the peer's layer 0, block 0, mapped here
    bool opened = false;   // mapped through IPC here (closed on destruction)
    int64_t num_blocks = 0;
    std::string handle;  // the peer's IPC handle
  };
  struct Command {
    PeerId peer = 0;
    BlockTransfer transfer;
    std::function<void(absl::Status)> done;
    double start = 0;  // seconds on the monotonic clock
  };

  // Where an earlier Connect mapped `handle`, or null (CUDA maps a handle once per process).
  char* MappedBase(const std::string& handle) const;
  void CopyLoop();
  // The copies of one command; OK once they are on the peer's device.
  absl::Status Copy(const Peer& peer, const BlockTransfer& transfer, int64_t* bytes);
  void Count(bool ok, int64_t bytes, double start);

  const kv::DeviceKvView cache_;
  std::unique_ptr<KvTransport> control_;  // reset first on destruction
  std::unique_ptr<kv::KvCache> control_cache_;  // the control transport's one block
  std::string handle_;
  std::string device_;
  void* stream_ = nullptr;

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<PeerId, Peer> peers_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<Command> queue_ ABSL_GUARDED_BY(mu_);
  TransportStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread copier_;
};

}  // namespace preft::transport
