#pragma once

// The bytes CudaIpcTransport::LocalAddress hands to peers: the control transport's own address
// (which carries the KV layout), where the device cache lives, and the CUDA IPC handle another
// process on the same node opens to reach it. Plain data, no CUDA types, so it is tested (and
// fed hostile bytes) without a GPU.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace preft::transport {

struct CudaIpcPeerAddress {
  std::string control;  // the control transport's LocalAddress
  // This node (host name and boot id): an IPC handle opens only on the node that made it.
  std::string node;
  int64_t pid = 0;      // a peer in the same process is reached through `base` itself
  uint64_t base = 0;    // the device cache's layer 0, block 0, in the owner's process
  std::string handle;   // the CUDA IPC handle of the allocation that starts at `base`
  std::string device;   // the GPU's PCI bus id, for messages and logs
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t block_bytes = 0;  // one block of one layer
};

inline constexpr size_t kCudaIpcHandleBytes = 64;

std::string EncodeCudaIpcPeerAddress(const CudaIpcPeerAddress& address);
// InvalidArgument on anything but the output of EncodeCudaIpcPeerAddress (same format
// version) with a handle of kCudaIpcHandleBytes and a cache of positive, bounded size.
absl::StatusOr<CudaIpcPeerAddress> DecodeCudaIpcPeerAddress(const std::string& bytes);

// "hostname/boot-id" of this machine (the boot id tells apart two containers that share a
// host name but not a kernel, and so cannot share device memory).
std::string ThisNode();

}  // namespace preft::transport
