#pragma once

// The bytes UcxTransport::LocalAddress hands to peers (over gRPC, once per peer): the worker
// address and packed rkey UCX needs, where the KV cache lives in the owner's address space, and
// its layout. Plain data, no UCX types, so it is tested without a UCX context.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/transport/kv_transport.h"

namespace preft::transport {

struct UcxPeerAddress {
  KvLayout layout;
  int64_t num_blocks = 0;
  uint64_t base = 0;   // address of layer 0, block 0 in the owner's process
  uint64_t bytes = 0;  // registered bytes from `base`
  std::string worker_address;
  std::string rkey;
};

std::string EncodeUcxPeerAddress(const UcxPeerAddress& address);
// InvalidArgument on anything but the output of EncodeUcxPeerAddress (same format version).
absl::StatusOr<UcxPeerAddress> DecodeUcxPeerAddress(const std::string& bytes);

}  // namespace preft::transport
