#pragma once

// The model forward on an NVIDIA GPU: the same ForwardBatch as Model::Forward, over weights
// copied to device memory (bf16), a paged KV cache in device memory with the CPU cache's
// layout (common/kernels/attention_types.h), and adapters uploaded to device slots. Built only
// with PREFT_ENABLE_CUDA; CUDA itself stays behind common/kernels/cuda (streams are void*).

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "common/backend/device_adapters.h"
#include "common/backend/device_kv_cache.h"
#include "common/backend/device_memory.h"
#include "common/backend/tensor_parallel.h"
#include "common/base/aligned_vector.h"
#include "common/base/step_lru.h"
#include "common/kernels/attention_types.h"
#include "common/kernels/cuda/collectives.cuh"
#include "common/kernels/cuda/linear.cuh"
#include "common/kernels/cuda/low_rank.cuh"
#include "common/kernels/cuda/sampling.cuh"
#include "common/kv/kv_cache.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"
#include "common/model/forward_batch.h"
#include "common/model/model.h"

namespace preft::backend {

// Owned by one thread (Forward reuses device scratch; not thread-safe), on the device that
// was current when it was made. Runs on its own stream; every call returns after its results
// are on the host.
//
// Under tensor parallelism (common/model/tensor_parallel.h) a DeviceModel is one rank: it holds
// its slice of the weights, its heads' KV cache (CacheShape) and its part of each adapter
// (its DeviceAdapterSlots), and sums the partial outputs of o and down over the ranks through
// `collective`. Every rank runs every step (rank 0 through Forward*, which computes the LM
// head and returns results; the others through ForwardRank), each from its own thread.
class DeviceModel {
 public:
  // Copies the host model's weights (matrices as bf16, converting f32/f16 ones; norms and
  // biases f32): all of them, or rank `shard`'s slice (then `collective` is the rank's).
  // FailedPrecondition without a CUDA device.
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Upload(
      const model::Model& host, const TensorShard& shard = {},
      kernels::cuda::Collective* collective = nullptr);
  // Random bf16 weights in `config`'s shapes and make-model's scales, made on the device (a
  // rank's slice: its own random values in the slice's shape).
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Random(
      const model::ModelConfig& config, uint64_t seed, const TensorShard& shard = {},
      kernels::cuda::Collective* collective = nullptr);
  ~DeviceModel();
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  const model::ModelConfig& config() const { return full_config_; }  // the whole model's
  const TensorShard& shard() const { return shard_; }
  size_t weight_bytes() const { return weights_.size(); }
  // The shape of this rank's cache: its own KV heads.
  kv::KvCacheShape CacheShape(int64_t num_blocks, int64_t block_tokens = 16,
                              kv::KvDtype dtype = kv::KvDtype::kF32) const;

  // As Model::Forward: K/V of the new tokens into `cache`, the logits of batch.logit_rows
  // into `logits` ([rows, vocab]); adapters resolved through `adapters`.
  absl::Status Forward(const model::ForwardBatch& batch, DeviceKvCache* cache,
                       DeviceAdapterSlots* adapters, base::AlignedVector<float>* logits);
  // The same forward, but only the greedy token of each logit row and its logprob come back.
  absl::Status ForwardGreedy(const model::ForwardBatch& batch, DeviceKvCache* cache,
                             DeviceAdapterSlots* adapters, std::vector<int32_t>* tokens,
                             std::vector<float>* logprobs);

  // The same forward, then each logit row sampled on the device with specs[row] (the CPU
  // sampler's choice for the same seed and step); only the tokens come back.
  absl::Status ForwardSample(const model::ForwardBatch& batch, DeviceKvCache* cache,
                             DeviceAdapterSlots* adapters,
                             const std::vector<kernels::cuda::SampleSpec>& specs,
                             std::vector<int32_t>* tokens);

  // A step on a rank other than 0: its share of the layers (no LM head), nothing returned.
  absl::Status ForwardRank(const model::ForwardBatch& batch, DeviceKvCache* cache,
                           DeviceAdapterSlots* adapters);
  // Tensor-parallel ranks: every step, once this rank has prepared it (or failed to) and
  // before any collective, `agree` is given that status and returns the step's: an error if
  // any rank failed. So a rank that cannot run a step (no device memory for an adapter) fails
  // it on every rank instead of leaving the others waiting in an all-reduce.
  void SetStepAgreement(std::function<absl::Status(const absl::Status&)> agree) {
    agree_ = std::move(agree);
  }

  // Decode steps (one new token per sequence) record a CUDA graph per shape and replay it,
  // one launch instead of ~13 per layer (not with a collective that cannot be captured).
  // Off by default.
  void UseGraphs(bool on) { use_graphs_ = on; }
  // Decode graphs recorded so far (each costs a capture and an instantiation on the host).
  int64_t graph_captures() const { return graph_captures_; }

  // From now on every forward first fills its device scratch with 0xff (NaN), so a test sees
  // any value a kernel should have written and did not.
  void PoisonScratchForTesting() { poison_scratch_ = true; }

 private:
  struct DeviceLayer {
    const uint16_t *q, *k, *v, *o, *gate, *up, *down;
    const float *q_bias, *k_bias, *v_bias, *o_bias;  // null without attention bias
    const float *input_norm, *post_attention_norm;
    // The fp8 KV scales of this rank's KV heads (model::Model::LayerWeights; 1 for Random).
    const float *k_scale, *v_scale;
  };
  // The metadata of one forward, in one host buffer copied to the device at once.
  struct Meta;
  class LowRankWork;
  // One forward's shape and the device addresses of its metadata.
  struct Step {
    int64_t tokens, rows, seqs, max_new;
    const int32_t* token_ids;
    const int32_t* positions;
    const int64_t* slots;
    const int32_t* logit_rows;
    const kernels::AttentionSeq* attention;
  };
  static constexpr size_t kMaxGraphs = 64;

  DeviceModel() = default;
  // `config` is the whole model's; the rank's slice is planned.
  absl::Status Init(const model::ModelConfig& config, const TensorShard& shard,
                    kernels::cuda::Collective* collective);
  // Sums a row-parallel layer's partial output over the ranks (nothing with one rank).
  absl::Status AllReduce(float* y, int64_t n);
  // Runs the layers and the LM head; leaves [rows, vocab] logits in logits_ on the device.
  // Takes part in the step's agreement exactly once, whether or not the step was prepared.
  absl::Status Run(const model::ForwardBatch& batch, DeviceKvCache* cache,
                   DeviceAdapterSlots* adapters);
  // Run's work: `agree` is called with OK once the step is prepared (every fallible host-side
  // check, adapter copy and allocation done), before its first kernel; a step that fails
  // before then returns without calling it.
  absl::Status RunStep(const model::ForwardBatch& batch, DeviceKvCache* cache,
                       DeviceAdapterSlots* adapters,
                       const std::function<absl::Status(absl::Status)>& agree);
  // Queues the kernels of one planned step on the stream (or into a graph being captured).
  absl::Status Launch(const Step& step, DeviceKvCache* cache, const LowRankWork& lora,
                      const LowRankWork& direft);
  void ClearGraphs();
  absl::Status EnsureScratch(int64_t tokens, int64_t rows);
  // Grows `buffer` to at least `bytes` (after the stream's work that may still read it).
  absl::Status Reserve(DeviceBuffer* buffer, size_t bytes);

  model::ModelConfig full_config_;
  model::ModelConfig config_;  // this rank's slice (ShardConfig): what the kernels run
  TensorShard shard_;
  kernels::cuda::Collective* collective_ = nullptr;  // borrowed; null with one rank
  std::function<absl::Status(const absl::Status&)> agree_;  // tensor-parallel ranks only
  void* stream_ = nullptr;
  kernels::cuda::Blas* blas_ = nullptr;
  DeviceBuffer weights_;  // every matrix (bf16), then norms, biases, KV scales, inv_freq (f32)
  const uint16_t* embed_ = nullptr;
  const uint16_t* lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  const float* inv_freq_ = nullptr;
  std::vector<DeviceLayer> layers_;

  // Scratch, grown on demand.
  DeviceBuffer scratch_;
  int64_t scratch_tokens_ = 0, scratch_rows_ = 0;
  float *x_ = nullptr, *h_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr,
        *attn_ = nullptr, *tmp_ = nullptr, *gate_ = nullptr, *up_ = nullptr, *last_ = nullptr,
        *logits_ = nullptr;
  DeviceBuffer meta_;
  std::vector<uint8_t> meta_host_;
  DeviceBuffer picks_;  // greedy tokens and logprobs; or sample specs and tokens
  DeviceBuffer sample_workspace_;
  DeviceBuffer attention_parts_;  // the decode attention's split partials
  bool poison_scratch_ = false;
  bool use_graphs_ = false;
  std::map<std::vector<int64_t>, void*> graphs_;  // shape key -> cudaGraphExec_t
  int64_t graphs_blas_generation_ = -1;
  int64_t graph_captures_ = 0;
};

}  // namespace preft::backend
