#pragma once

// Moving KV blocks between the caches of two workers (prefill -> decode). A transport writes a
// list of blocks of the local cache into blocks the peer reserved, then tells the peer the
// transfer is complete (a DONE notice carrying reservation id and generation, so late writes of
// an older generation can be told apart). Implementations: in-process (memcpy, for `preft
// serve` and tests), UCX (RMA put + active message; only transport/ucx sees UCX) and CUDA IPC
// (device-to-device copies between GPUs of one node, notices over UCX; transport/cuda_ipc).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kv/kv_cache.h"

namespace preft::transport {

// What both sides must agree on before a byte moves; compared once per peer (a mismatch is
// refused with both descriptions in the message, never a hang or garbage).
struct KvLayout {
  std::string model;  // a stable description of the base model (e.g. config hash)
  std::string dtype = "f32";
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_tokens = 0;
  int32_t layout_version = 1;  // kv::KvCache: [layer][block][K^T | V], K tiles transposed

  static KvLayout ForCache(const kv::KvCacheShape& shape, const std::string& model);
  uint64_t Hash() const;
  std::string ToString() const;
};

// OK if a peer's layout hash is `local`'s; else FailedPrecondition "KV layout mismatch: ..."
// naming `peer` (e.g. "decode worker 10.0.0.7:5") and both layouts (`peer_layout`: its
// ToString, as peers advertise it). Where the KV dtypes differ (tiers started with different
// --kv-dtype) the message says that first, naming both: KV is never converted on the way.
absl::Status CheckPeerLayout(const KvLayout& local, uint64_t peer_hash, const std::string& peer,
                             const std::string& peer_layout);

// One transfer: src_blocks[i] of the local cache -> dst_blocks[i] of the peer's, every layer.
struct BlockTransfer {
  uint64_t reservation_id = 0;
  uint32_t generation = 0;
  std::vector<int32_t> src_blocks;
  std::vector<int32_t> dst_blocks;
};

struct TransportStats {
  int64_t transfers = 0;  // completed
  int64_t failures = 0;
  int64_t bytes = 0;      // of completed transfers
  double seconds = 0;     // summed transfer latency (Write call to done), failures included

  // One transfer ended: every transport counts it here, the same way.
  void Record(bool ok, int64_t transfer_bytes, double transfer_seconds) {
    if (ok) {
      ++transfers;
      bytes += transfer_bytes;
    } else {
      ++failures;
    }
    seconds += transfer_seconds;
  }
};

// InvalidArgument (naming the list, index and id) unless both lists have the same length and
// every id is a block of its cache. Shared by the implementations.
absl::Status ValidateTransfer(const BlockTransfer& transfer, int64_t src_num_blocks,
                              int64_t dst_num_blocks);

using PeerId = int64_t;

class KvTransport {
 public:
  // Called on a transport thread when a peer's transfer into this cache is complete.
  using DoneNotice = std::function<void(uint64_t reservation_id, uint32_t generation)>;

  virtual ~KvTransport() = default;

  // Registers the local cache (once, before anything else) and where DONE notices go.
  virtual absl::Status Start(kv::KvCache* cache, const KvLayout& layout, DoneNotice on_done) = 0;
  // Opaque bytes a peer passes to Connect (exchanged over gRPC once per peer): address,
  // memory keys and the layout.
  virtual std::string LocalAddress() const = 0;
  // FailedPrecondition when the peer's layout differs (message names both).
  virtual absl::StatusOr<PeerId> Connect(const std::string& peer_address) = 0;
  // Writes and notifies; `done` fires once (on a transport thread) after the peer has the data
  // and the notice, or with the error. Blocks out of range are InvalidArgument.
  virtual void Write(PeerId peer, const BlockTransfer& transfer,
                     std::function<void(absl::Status)> done) = 0;
  virtual TransportStats stats() const = 0;
  virtual std::string name() const = 0;  // "inproc", "ucx(posix,self)", ...
  // True when the transport reads and writes a cache in device memory itself (so a GPU worker
  // keeps no host mirror of its cache, and Start's host cache is not used).
  virtual bool moves_device_memory() const { return false; }
};

}  // namespace preft::transport
