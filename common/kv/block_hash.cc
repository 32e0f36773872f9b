#include "common/kv/block_hash.h"

#include <openssl/evp.h>

#include <cstring>
#include <vector>

#include "common/base/check.h"

namespace preft::kv {

BlockHash HashBlock(const BlockHash& parent, uint64_t salt, const int32_t* tokens,
                    const uint8_t* mask, int64_t n) {
  // parent | salt | n | tokens | mask bits: fixed-width fields, so no two inputs share bytes.
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(parent.size() + 2 * sizeof(uint64_t) + n * (sizeof(int32_t) + 1));
  uint8_t* p = buffer.data();
  std::memcpy(p, parent.data(), parent.size());
  p += parent.size();
  std::memcpy(p, &salt, sizeof(salt));
  p += sizeof(salt);
  const uint64_t count = static_cast<uint64_t>(n);
  std::memcpy(p, &count, sizeof(count));
  p += sizeof(count);
  std::memcpy(p, tokens, n * sizeof(int32_t));
  p += n * sizeof(int32_t);
  for (int64_t i = 0; i < n; ++i) *p++ = mask != nullptr && mask[i] ? 1 : 0;
  BlockHash out;
  unsigned int len = 0;
  PREFT_CHECK(EVP_Digest(buffer.data(), buffer.size(), out.data(), &len, EVP_sha256(), nullptr) == 1);
  PREFT_CHECK(len == out.size());
  return out;
}

}  // namespace preft::kv
