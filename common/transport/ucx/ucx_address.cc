#include "common/transport/ucx/ucx_address.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace preft::transport {
namespace {

constexpr char kMagic[8] = {'P', 'R', 'E', 'F', 'T', 'U', 'C', 'X'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kMaxField = uint64_t{1} << 20;  // no legitimate field is near a MiB

// Little helpers for a fixed-width, length-prefixed encoding (both ends are this code).
class Writer {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    out_ += s;
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <typename T>
  bool Get(T* value) {
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s) {
    uint64_t size = 0;
    if (!Get(&size) || size > kMaxField || in_.size() - pos_ < size) return false;
    s->assign(in_.data() + pos_, size);
    pos_ += size;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  const std::string& in_;
  size_t pos_ = 0;
};

}  // namespace

std::string EncodeUcxPeerAddress(const UcxPeerAddress& address) {
  Writer w;
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
  Reader in(rest);
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
