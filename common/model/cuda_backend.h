#pragma once

// The engine's forward on an NVIDIA GPU: a DeviceModel (weights uploaded from the host
// model), a device KV cache sized from free memory, and device slots (a byte budget, LRU) for
// the adapters that batches name. Tokens are sampled on the device (the CPU sampler's choice,
// so only they cross to the host); Forward still returns logits for steps that need them. The
// KV cache stays on the device. For disaggregated serving (prefill and decode tiers) it keeps
// a host mirror of the same blocks, which the KV transport moves between workers: a prompt's
// blocks are copied out after its prefill and in before its decode (staging through host
// memory); a CUDA IPC transport instead moves the device blocks themselves (device_cache()),
// and then no mirror is kept.

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
    // A host copy of the cache's blocks for the KV transport (as much host memory as the
    // device pool: size that with kv_blocks).
    bool host_mirror = false;
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
  bool cpu_adapter_kernels() const override { return false; }
  kv::KvCache* host_cache() override { return mirror_.get(); }
  kv::DeviceKvView device_cache() const override { return {cache_->layer_base(0), cache_->shape()}; }
  absl::Status KvToHost(const std::vector<int32_t>& blocks) override;
  absl::Status KvFromHost(const std::vector<int32_t>& blocks) override;
  const char* name() const override { return "cuda"; }

 private:
  explicit CudaBackend(size_t adapter_bytes) : slots_(adapter_bytes) {}
  std::unique_ptr<DeviceModel> device_;
  std::unique_ptr<DeviceKvCache> cache_;
  std::unique_ptr<kv::KvCache> mirror_;  // host_mirror only
  DeviceAdapterSlots slots_;
};

}  // namespace preft::model
