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
//
// With tensor_parallel N > 1 the model is split over N GPUs (common/backend/tensor_parallel.h):
// one DeviceModel, KV cache (its KV heads) and adapter slots per rank, each rank driven by a
// thread of its own on its device, NCCL summing the row-parallel outputs. Its host mirror
// holds every head, each rank copying its own in or out, so the KV transport sees the layout
// of an unsplit worker and tiers split differently (or not at all) hand KV to each other.
// There is no single device pool to map (device_cache() is empty: no CUDA IPC transport).

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/backend/device_model.h"
#include "common/backend/forward_backend.h"
#include "common/base/status_rendezvous.h"

namespace preft::backend {

class CudaBackend : public ForwardBackend {
 public:
  struct Options {
    int64_t kv_blocks = 0;          // 0: memory_fraction of the free memory after the weights
    double memory_fraction = 0.85;  // of the free device memory, for the KV cache
    int64_t block_tokens = 16;
    kv::KvDtype kv_dtype = kv::KvDtype::kF32;  // the device cache's (and its host mirror's)
    bool graphs = true;  // decode steps replay CUDA graphs
    // Device memory for adapter copies (LRU beyond it), kept out of the KV cache's share.
    size_t adapter_bytes = size_t{4} << 30;
    // A host copy of the cache's blocks for the KV transport (as much host memory as the
    // device pool: size that with kv_blocks).
    bool host_mirror = false;
    // GPUs the model is split over (devices 0 .. N-1); kv_blocks and adapter_bytes are per GPU.
    int tensor_parallel = 1;
    // Every rank on device 0, summing through the host instead of NCCL: checks the split on a
    // single GPU (tests). Slow; never for serving.
    bool ranks_share_device = false;
  };
  // FailedPrecondition without a CUDA device, or with fewer GPUs than tensor_parallel;
  // InvalidArgument when tensor_parallel does not divide the model's heads and MLP.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const model::Model& model,
                                                             const Options& options);
  // The same over random bf16 weights in `config`'s shapes, made on the devices (benchmarks:
  // a 70B-shaped model split over GPUs without a checkpoint).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> CreateRandom(const model::ModelConfig& config,
                                                                   uint64_t seed,
                                                                   const Options& options);
  ~CudaBackend() override;

  const model::ModelConfig& config() const override { return ranks_[0].model->config(); }
  // The whole model's KV heads (each rank holds its share of them in as many blocks).
  const kv::KvCacheShape& cache_shape() const override { return shape_; }
  absl::Status Forward(const model::ForwardBatch& batch, base::AlignedVector<float>* logits) override;
  bool samples_on_device() const override { return true; }
  absl::Status ForwardSample(const model::ForwardBatch& batch, const std::vector<RowSampling>& rows,
                             std::vector<int32_t>* tokens) override;
  void PrepareAdapter(const std::shared_ptr<const model::AdapterWeights>& adapter) override;
  absl::StatusOr<bool> AdapterReady(const std::shared_ptr<const model::AdapterWeights>& adapter) override;
  kernels::DType adapter_dtype() const override { return kernels::DType::kBF16; }
  bool cpu_adapter_kernels() const override { return false; }
  kv::KvCache* host_cache() override { return mirror_.get(); }
  kv::DeviceKvView device_cache() const override;
  absl::Status KvToHost(const std::vector<int32_t>& blocks) override;
  absl::Status KvFromHost(const std::vector<int32_t>& blocks) override;
  const char* name() const override { return "cuda"; }
  std::string description() const override;
  int tensor_parallel() const { return static_cast<int>(ranks_.size()); }
  // "nccl" or "shared-device" with several ranks, "" with one.
  const char* collective_kind() const;

 private:
  struct Rank {
    std::unique_ptr<kernels::cuda::Collective> collective;
    std::unique_ptr<DeviceModel> model;
    std::unique_ptr<DeviceKvCache> cache;
    std::unique_ptr<DeviceAdapterSlots> slots;
  };
  class RankThreads;
  // Makes rank `shard`'s DeviceModel on the calling thread's device.
  using MakeRank = std::function<absl::StatusOr<std::unique_ptr<DeviceModel>>(
      const TensorShard& shard, kernels::cuda::Collective* collective)>;
  CudaBackend() = default;
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Build(const model::ModelConfig& config,
                                                            const Options& options,
                                                            const MakeRank& make_rank);
  // Runs fn(rank) for every rank at once, each on its rank's thread (inline with one rank);
  // the first error, by rank.
  absl::Status OnRanks(const std::function<absl::Status(int)>& fn);

  std::vector<Rank> ranks_;
  std::unique_ptr<RankThreads> threads_;        // several ranks only
  std::unique_ptr<base::StatusRendezvous> agreement_;  // several ranks: once per step
  kv::KvCacheShape shape_;
  std::unique_ptr<kv::KvCache> mirror_;  // host_mirror only
};

}  // namespace preft::backend
