#pragma once

// The forward on the CPU: the CPU model (common/model/model.h) over a host KV cache.

#include <memory>

#include "absl/status/statusor.h"
#include "common/backend/forward_backend.h"
#include "common/kv/kv_cache.h"
#include "common/model/model.h"

namespace preft::backend {

// Model::Forward over a KvCache of its own.
class CpuBackend : public ForwardBackend {
 public:
  // `blocks` blocks of `block_tokens` tokens stored as `kv_dtype`; `model` is borrowed.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(
      model::Model* model, int64_t blocks, int64_t block_tokens,
      kv::KvDtype kv_dtype = kv::KvDtype::kF32);

  const model::ModelConfig& config() const override { return model_->config(); }
  const kv::KvCacheShape& cache_shape() const override { return cache_->shape(); }
  absl::Status Forward(const model::ForwardBatch& batch, base::AlignedVector<float>* logits) override {
    return model_->Forward(batch, cache_.get(), logits);
  }
  kernels::DType adapter_dtype() const override { return model_->weight_dtype(); }
  kv::KvCache* host_cache() override { return cache_.get(); }
  const char* name() const override { return "cpu"; }

 private:
  CpuBackend(model::Model* model, std::unique_ptr<kv::KvCache> cache)
      : model_(model), cache_(std::move(cache)) {}
  model::Model* model_;
  std::unique_ptr<kv::KvCache> cache_;
};

}  // namespace preft::backend
