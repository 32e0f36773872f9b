#include "common/transport/ucx/ucx_address.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/transport/address_codec.h"

namespace preft::transport {
namespace {

constexpr char kMagic[8] = {'P', 'R', 'E', 'F', 'T', 'U', 'C', 'X'};
constexpr uint32_t kVersion = 1;

}  // namespace

std::string EncodeUcxPeerAddress(const UcxPeerAddress& address) {
  AddressWriter w;
  w.out().append(kMagic, sizeof(kMagic));
  w.Put(kVersion);
  w.Put(address.layout.Hash());
  w.PutString(address.layout.model);
  w.PutString(address.layout.dtype);
  w.Put(address.layout.num_layers);
  w.Put(address.layout.num_kv_heads);
  w.Put(address.layout.head_dim);
  w.Put(address.layout.block_tokens);
  w.Put(address.layout.layout_version);
  w.Put(address.num_blocks);
  w.Put(address.base);
  w.Put(address.bytes);
  w.PutString(address.worker_address);
  w.PutString(address.rkey);
  return std::move(w.out());
}

absl::StatusOr<UcxPeerAddress> DecodeUcxPeerAddress(const std::string& bytes) {
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX peer address: not a preft UCX address (", bytes.size(), " bytes)"));
  }
  std::string rest = bytes.substr(sizeof(kMagic));
  AddressReader in(rest);
  uint32_t version = 0;
  uint64_t hash = 0;
  UcxPeerAddress a;
  if (!in.Get(&version)) return absl::InvalidArgumentError("UCX peer address: truncated");
  if (version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("UCX peer address: format version ", version,
                                                   ", this build reads ", kVersion));
  }
  const bool ok = in.Get(&hash) && in.GetString(&a.layout.model) && in.GetString(&a.layout.dtype) &&
                  in.Get(&a.layout.num_layers) && in.Get(&a.layout.num_kv_heads) &&
                  in.Get(&a.layout.head_dim) && in.Get(&a.layout.block_tokens) &&
                  in.Get(&a.layout.layout_version) && in.Get(&a.num_blocks) && in.Get(&a.base) &&
                  in.Get(&a.bytes) && in.GetString(&a.worker_address) && in.GetString(&a.rkey) &&
                  in.done();
  if (!ok) return absl::InvalidArgumentError("UCX peer address: truncated or malformed");
  if (hash != a.layout.Hash()) {
    return absl::InvalidArgumentError("UCX peer address: layout hash does not match its layout");
  }
  if (a.worker_address.empty() || a.rkey.empty()) {
    return absl::InvalidArgumentError("UCX peer address: empty worker address or rkey");
  }
  return a;
}

}  // namespace preft::transport
