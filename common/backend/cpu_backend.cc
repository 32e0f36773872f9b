#include "common/backend/cpu_backend.h"

#include "common/base/status_macros.h"

namespace preft::backend {

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(model::Model* model, int64_t blocks,
                                                               int64_t block_tokens,
                                                               kv::KvDtype kv_dtype) {
  PREFT_ASSIGN_OR_RETURN(auto cache,
                         kv::KvCache::Create(model->CacheShape(blocks, block_tokens, kv_dtype)));
  return std::unique_ptr<CpuBackend>(new CpuBackend(model, std::move(cache)));
}

}  // namespace preft::backend
