#include "common/transport/cuda_ipc/cuda_ipc_address.h"

#include <unistd.h>

#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/transport/address_codec.h"

namespace preft::transport {
namespace {

constexpr char kMagic[8] = {'P', 'R', 'E', 'F', 'T', 'C', 'I', 'P'};
constexpr uint32_t kVersion = 1;
// A cache beyond this (1 PiB) is a corrupt address, not a GPU.
constexpr int64_t kMaxCacheBytes = int64_t{1} << 50;

}  // namespace

std::string EncodeCudaIpcPeerAddress(const CudaIpcPeerAddress& a) {
  AddressWriter w;
  w.out().append(kMagic, sizeof(kMagic));
  w.Put(kVersion);
  w.PutString(a.control);
  w.PutString(a.node);
  w.Put(a.pid);
  w.Put(a.base);
  w.PutString(a.handle);
  w.PutString(a.device);
  w.Put(a.num_layers);
  w.Put(a.num_blocks);
  w.Put(a.block_bytes);
  return std::move(w.out());
}

absl::StatusOr<CudaIpcPeerAddress> DecodeCudaIpcPeerAddress(const std::string& bytes) {
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA IPC peer address: not a preft CUDA IPC address (", bytes.size(),
        " bytes; is the peer on another transport?)"));
  }
  const std::string rest = bytes.substr(sizeof(kMagic));
  AddressReader in(rest);
  uint32_t version = 0;
  if (!in.Get(&version)) return absl::InvalidArgumentError("CUDA IPC peer address: truncated");
  if (version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA IPC peer address: format version ",
                                                   version, ", this build reads ", kVersion));
  }
  CudaIpcPeerAddress a;
  const bool ok = in.GetString(&a.control) && in.GetString(&a.node) && in.Get(&a.pid) &&
                  in.Get(&a.base) && in.GetString(&a.handle) && in.GetString(&a.device) &&
                  in.Get(&a.num_layers) && in.Get(&a.num_blocks) && in.Get(&a.block_bytes) &&
                  in.done();
  if (!ok) return absl::InvalidArgumentError("CUDA IPC peer address: truncated or malformed");
  if (a.handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA IPC peer address: a handle of ",
                                                   a.handle.size(), " bytes, expected ",
                                                   kCudaIpcHandleBytes));
  }
  if (a.control.empty() || a.node.empty() || a.base == 0 || a.pid <= 0) {
    return absl::InvalidArgumentError(
        "CUDA IPC peer address: empty control address, node, process id or cache address");
  }
  const bool sized = a.num_layers > 0 && a.num_blocks > 0 && a.block_bytes > 0 &&
                     a.num_layers <= kMaxCacheBytes / a.num_blocks &&
                     a.num_layers * a.num_blocks <= kMaxCacheBytes / a.block_bytes;
  if (!sized) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA IPC peer address: a cache of ", a.num_layers, " layers x ", a.num_blocks,
        " blocks x ", a.block_bytes, " bytes"));
  }
  return a;
}

std::string ThisNode() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string boot_id;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot_id);
  return absl::StrCat(host, "/", absl::StripAsciiWhitespace(boot_id));
}

}  // namespace preft::transport
