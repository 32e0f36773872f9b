#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/fnv.h"
#include "common/transport/kv_transport.h"

namespace preft::transport {
namespace {

void Mix(uint64_t* h, const std::string& field) {
  // Length-prefixed, so no two field lists share a byte string ("ab","c" vs "a","bc").
  *h = base::Fnv1a64(absl::StrCat(field.size(), ":", field, ";"), *h);
}

}  // namespace

KvLayout KvLayout::ForCache(const kv::KvCacheShape& shape, const std::string& model) {
  KvLayout layout;
  layout.model = model;
  layout.dtype = std::string(kv::KvDtypeName(shape.dtype));
  layout.num_layers = shape.num_layers;
  layout.num_kv_heads = shape.num_kv_heads;
  layout.head_dim = shape.head_dim;
  layout.block_tokens = shape.block_tokens;
  return layout;
}

uint64_t KvLayout::Hash() const {
  uint64_t h = base::kFnv1a64Offset;
  Mix(&h, "preft.kv_layout");
  Mix(&h, model);
  Mix(&h, dtype);
  Mix(&h, absl::StrCat(num_layers));
  Mix(&h, absl::StrCat(num_kv_heads));
  Mix(&h, absl::StrCat(head_dim));
  Mix(&h, absl::StrCat(block_tokens));
  Mix(&h, absl::StrCat(layout_version));
  return h;
}

std::string KvLayout::ToString() const {
  return absl::StrCat("{model=", model, " dtype=", dtype, " layers=", num_layers,
                      " kv_heads=", num_kv_heads, " head_dim=", head_dim,
                      " block_tokens=", block_tokens, " layout=v", layout_version, "}");
}

namespace {

// The dtype= field of a KvLayout::ToString, or "" if there is none.
std::string DtypeIn(const std::string& layout) {
  const size_t at = layout.find(" dtype=");
  if (at == std::string::npos) return {};
  const size_t end = layout.find_first_of(" }", at + 7);
  return layout.substr(at + 7, end == std::string::npos ? std::string::npos : end - at - 7);
}

}  // namespace

absl::Status CheckPeerLayout(const KvLayout& local, uint64_t peer_hash, const std::string& peer,
                             const std::string& described) {
  if (peer_hash == local.Hash()) return absl::OkStatus();
  const std::string peer_layout = described.empty() ? "(not described)" : described;
  const std::string peer_dtype = DtypeIn(peer_layout);
  if (!peer_dtype.empty() && peer_dtype != local.dtype) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV layout mismatch: ", peer, " stores KV as ", peer_dtype, ", this worker as ",
        local.dtype, "; start prefill and decode workers with the same --kv-dtype (its layout ",
        peer_layout, ", this worker's ", local.ToString(), ")"));
  }
  return absl::FailedPreconditionError(absl::StrCat("KV layout mismatch: ", peer, " has ",
                                                    peer_layout, ", this worker has ",
                                                    local.ToString()));
}

absl::Status ValidateTransfer(const BlockTransfer& transfer, int64_t src_num_blocks,
                              int64_t dst_num_blocks) {
  if (transfer.src_blocks.size() != transfer.dst_blocks.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV transfer ", transfer.reservation_id, ": src_blocks has ", transfer.src_blocks.size(),
        " ids but dst_blocks has ", transfer.dst_blocks.size()));
  }
  for (size_t i = 0; i < transfer.src_blocks.size(); ++i) {
    const int32_t src = transfer.src_blocks[i], dst = transfer.dst_blocks[i];
    if (src < 0 || src >= src_num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV transfer ", transfer.reservation_id, ": src_blocks[", i, "] = ", src,
                       " is not a block of the local cache (", src_num_blocks, " blocks)"));
    }
    if (dst < 0 || dst >= dst_num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV transfer ", transfer.reservation_id, ": dst_blocks[", i, "] = ", dst,
                       " is not a block of the peer's cache (", dst_num_blocks, " blocks)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace preft::transport
