#pragma once

// A decoder-only transformer (Llama, Qwen2, Mistral) over a memory-mapped Hugging Face
// checkpoint: one Forward runs a ForwardBatch and writes its K/V into a paged cache.

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/aligned_vector.h"
#include "common/kernels/cpu/low_rank.h"
#include "common/kernels/matrix.h"
#include "common/kv/kv_cache.h"
#include "common/model/adapter_weights.h"
#include "common/model/checkpoint.h"
#include "common/model/config.h"
#include "common/model/forward_batch.h"

namespace preft::model {

// InvalidArgument unless every matrix of `a` fits the projections of a model with `config`.
absl::Status CheckAdapterFits(const ModelConfig& config, const AdapterWeights& a);

// InvalidArgument unless `batch` is consistent (ForwardBatch::Validate), its blocks lie in a
// cache of `cache` shape, and that shape is this model's.
absl::Status CheckBatchFits(const ModelConfig& config, const kv::KvCacheShape& cache,
                            const ForwardBatch& batch);

// Owned by the engine thread (Forward reuses scratch buffers; not thread-safe).
class Model {
 public:
  // Reads config.json and the weights in `dir`; every tensor the config implies must exist
  // with its exact shape. Matrices stay in the mapping (f32, f16 or bf16); norms and biases
  // are copied to f32.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  // The dtype of the projection matrices (what adapters are converted to for compute).
  kernels::DType weight_dtype() const { return layers_.front().q.dtype; }
  // Bytes of weights read by one forward (the mapped checkpoint).
  size_t weight_bytes() const { return checkpoint_->total_bytes(); }
  // Of those, the bytes mapped in huge pages (see base::MappedFile).
  size_t weight_huge_page_bytes() const { return checkpoint_->huge_page_bytes(); }

  // A KV cache shape for this model with `num_blocks` blocks.
  kv::KvCacheShape CacheShape(int64_t num_blocks, int64_t block_tokens = 16,
                              kv::KvDtype dtype = kv::KvDtype::kF32) const;

  // Runs the batch: writes K/V of the new tokens into `cache` and puts the logits of
  // `batch.logit_rows` into `logits` ([rows, vocab], row-major). Each sequence's adapter is
  // applied to the tokens its mask selects: LoRA on the targeted projections, DiReFT on the
  // intervened layers' outputs, grouped per adapter (one kernel call per projection).
  absl::Status Forward(const ForwardBatch& batch, kv::KvCache* cache, base::AlignedVector<float>* logits);
  // Wall time all forwards so far spent in the adapters' low-rank products (LoRA and DiReFT),
  // so a benchmark can tell the multi-LoRA kernels' own time from the step around them.
  double adapter_seconds() const { return adapter_seconds_; }

  // The weights, for other backends to copy (DeviceModel). Matrices are views into the
  // mapping; norms and biases f32.
  struct LayerWeights {
    kernels::MatrixView q, k, v, o, gate, up, down;
    std::vector<float> q_bias, k_bias, v_bias, o_bias;  // empty without attention bias
    std::vector<float> input_norm, post_attention_norm;
    // Per KV head: what an fp8 KV cache stores K and V divided by (the checkpoint's
    // self_attn.k_scale / v_scale where present, else 1). Unused by f32 and bf16 caches.
    std::vector<float> k_scale, v_scale;
  };
  const LayerWeights& layer(int64_t i) const { return layers_[i]; }
  const kernels::MatrixView& embed() const { return embed_; }
  const kernels::MatrixView& lm_head() const { return lm_head_; }
  const std::vector<float>& final_norm() const { return final_norm_; }
  // RoPE inverse frequencies [head_dim / 2], llama3 scaling applied.
  const std::vector<float>& inv_freq() const { return inv_freq_; }

 private:
  Model() = default;
  absl::Status LoadWeights();
  void WriteKv(const ForwardBatch& batch, int64_t layer, kv::KvCache* cache);

  // The masked rows of one adapter in the current batch.
  struct AdapterRows {
    const AdapterWeights* adapter;
    std::vector<int32_t> rows;
  };
  // Adds every adapter's update for projections of layer `li` that read the same input `x`
  // ([T, in]) to their outputs ([T, out]), in one kernel call.
  struct LoraTarget {
    Projection projection;
    float* y;
    int64_t out;
  };
  void ApplyLora(int64_t li, const float* x, int64_t in, std::initializer_list<LoraTarget> targets);
  void ApplyDireft(int64_t li, float* x);
  // cpu::LowRankAdd over groups_, timed into adapter_seconds_.
  void RunLowRank(const float* x, int64_t x_stride, float* y, int64_t y_stride);

  ModelConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;
  kernels::MatrixView embed_;
  kernels::MatrixView lm_head_;
  std::vector<float> final_norm_;
  std::vector<LayerWeights> layers_;
  std::vector<float> inv_freq_;

  // Scratch, resized per batch.
  base::AlignedVector<float> x_, h_, q_, k_, v_, attn_, tmp_, gate_, up_, last_;
  std::vector<AdapterRows> lora_rows_, direft_rows_;
  std::vector<kernels::cpu::LowRankGroup> groups_;
  double adapter_seconds_ = 0;  // see adapter_seconds()
};

}  // namespace preft::model
