#pragma once

// The engine's forward on an NVIDIA GPU: a DeviceModel (weights uploaded from the host
// model), a device KV cache sized from free memory, and device slots (a byte budget, LRU) for
// the adapters that batches name. Tokens are sampled on the device (the CPU sampler's choice,
// so only they cross to the host); Forward still returns logits for steps that need them. The
// KV cache stays on the device: no host_cache(), so this backend serves colocated engines
// (preft generate, one engine per worker) until the GPU KV transport exists.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "common/model/device_model.h"
#include "common/model/forward_backend.h"

namespace preft::model {

class CudaBackend : public ForwardBackend {
 public:
  struct Options {
    int64_t kv_blocks = 0;          // 0: memory_fraction of the free memory after the weights
    double memory_fraction = 0.85;  // of the free device memory, for the KV cache
    int64_t block_tokens = 16;
    bool graphs = true;  // decode steps replay CUDA graphs
    // Device memory for adapter copies (LRU beyond it), kept out of the KV cache's share.
    size_t adapter_bytes = size_t{4} << 30;
  };
  // FailedPrecondition without a CUDA device.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const Model& model,
                                                             const Options& options);

  const ModelConfig& config() const override { return device_->config(); }
  const kv::KvCacheShape& cache_shape() const override { return cache_->shape(); }
  absl::Status Forward(const ForwardBatch& batch, base::AlignedVector<float>* logits) override {
    return device_->Forward(batch, cache_.get(), &slots_, logits);
  }
  bool samples_on_device() const override { return true; }
  absl::Status ForwardSample(const ForwardBatch& batch, const std::vector<RowSampling>& rows,
                             std::vector<int32_t>* tokens) override;
  void PrepareAdapter(const std::shared_ptr<const AdapterWeights>& adapter) override {
    slots_.Prefetch(adapter);
  }
  absl::StatusOr<bool> AdapterReady(const std::shared_ptr<const AdapterWeights>& adapter) override {
    return slots_.Ready(adapter);
  }
  kernels::DType adapter_dtype() const override { return kernels::DType::kBF16; }
  const char* name() const override { return "cuda"; }

 private:
  explicit CudaBackend(size_t adapter_bytes) : slots_(adapter_bytes) {}
  std::unique_ptr<DeviceModel> device_;
  std::unique_ptr<DeviceKvCache> cache_;
  DeviceAdapterSlots slots_;
};

}  // namespace preft::model
