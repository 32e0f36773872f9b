#include "common/model/cuda_backend.h"

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/sampling.cuh"

namespace preft::model {

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Model& model,
                                                                 const Options& options) {
  std::unique_ptr<CudaBackend> b(new CudaBackend(options.adapter_bytes));
  PREFT_ASSIGN_OR_RETURN(b->device_, DeviceModel::Upload(model));
  b->device_->UseGraphs(options.graphs);
  int64_t blocks = options.kv_blocks;
  const kv::KvCacheShape one = b->device_->CacheShape(1, options.block_tokens);
  if (blocks <= 0) {
    PREFT_ASSIGN_OR_RETURN(blocks, DeviceKvCache::BlocksThatFit(one, options.memory_fraction,
                                                                options.adapter_bytes));
  }
  if (blocks <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no KV block (", one.bytes_per_block_all_layers(), " bytes) fits in device memory"));
  }
  PREFT_ASSIGN_OR_RETURN(b->cache_,
                         DeviceKvCache::Create(b->device_->CacheShape(blocks, options.block_tokens)));
  if (options.host_mirror) {
    absl::StatusOr<std::unique_ptr<kv::KvCache>> mirror = kv::KvCache::Create(b->cache_->shape());
    if (!mirror.ok()) {
      return absl::Status(mirror.status().code(),
                          absl::StrCat("host mirror of the KV cache: ", mirror.status().message()));
    }
    b->mirror_ = *std::move(mirror);
  }
  return b;
}

absl::Status CudaBackend::KvToHost(const std::vector<int32_t>& blocks) {
  if (mirror_ == nullptr) return absl::OkStatus();
  return cache_->CopyBlocksToHost(blocks, mirror_.get());
}

absl::Status CudaBackend::KvFromHost(const std::vector<int32_t>& blocks) {
  if (mirror_ == nullptr) return absl::OkStatus();
  return cache_->CopyBlocksFromHost(*mirror_, blocks);
}

absl::Status CudaBackend::ForwardSample(const ForwardBatch& batch,
                                        const std::vector<RowSampling>& rows,
                                        std::vector<int32_t>* tokens) {
  std::vector<kernels::cuda::SampleSpec> specs(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    specs[r] = {rows[r].temperature, rows[r].top_p, rows[r].min_p,
                rows[r].top_k,       rows[r].seed,  rows[r].step};
  }
  return device_->ForwardSample(batch, cache_.get(), &slots_, specs, tokens);
}

}  // namespace preft::model
