#pragma once

// The engine's forward (Llama, Qwen2, Mistral: GQA, RoPE with llama3/linear scaling, QKV bias,
// tied embeddings, Mistral's sliding window) as a differentiable libtorch graph over a frozen
// base: the weights stay in the memory-mapped checkpoint (f32 models: torch::from_blob, no
// copy) and only a TrainableAdapter's tensors get gradients. Adapters apply where the batch's
// masks say, exactly as the engine applies them (common/model/model.cc). Torch inside: included
// by the trainer's own sources and tests only.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/checkpoint.h"
#include "common/model/config.h"
#include "train/trainable_adapter.h"

namespace preft::train {

// Sets the trainer's compute threads: libtorch's GEMMs run in OpenBLAS, which has threads of
// its own; torch's OpenMP threads spinning beside them halve the GEMM rate (bench/NOTES.md), so
// torch's own (elementwise) ops run on one thread and BLAS on `n` (0: every core).
void SetComputeThreads(int n);

// A right-padded batch of B sequences of up to T tokens, all starting at position 0.
struct TorchBatch {
  torch::Tensor ids;          // [B, T] int64; padding may be any valid id
  torch::Tensor lora_mask;    // [B, T, 1] model dtype: 1 where a LoRA applies, else 0
  torch::Tensor direft_mask;  // [B, T, 1]: 1 where a DiReFT intervenes
  torch::Tensor logit_rows;   // [N] int64: flat rows (b * T + t) whose logits are wanted
};

// Immutable after Load; Forward may run on one thread at a time (torch's own pool inside).
class TorchModel {
 public:
  // Reads `dir` (config.json + safetensors). `dtype` is the compute dtype: kFloat32 for
  // training (bf16/f16 checkpoints are converted), kFloat64 for gradient checks.
  static absl::StatusOr<std::unique_ptr<TorchModel>> Load(const std::string& dir,
                                                          torch::Dtype dtype);

  const model::ModelConfig& config() const { return config_; }
  torch::Dtype dtype() const { return dtype_; }
  // Parameters of the frozen base (for the performance bound: ~4 x this x tokens FLOPs/step).
  int64_t num_parameters() const;

  // Logits [N, vocab] of batch.logit_rows, the adapter (may be null) applied under the masks.
  torch::Tensor Forward(const TorchBatch& batch, const TrainableAdapter* adapter) const;

 private:
  struct Layer {
    torch::Tensor q, k, v, o, gate, up, down;  // [out, in]
    torch::Tensor q_bias, k_bias, v_bias, o_bias;  // undefined without attention bias
    torch::Tensor input_norm, post_attention_norm;
  };
  TorchModel() = default;
  torch::Tensor Weight(const model::TensorInfo* t) const;

  model::ModelConfig config_;
  torch::Dtype dtype_ = torch::kFloat32;
  std::unique_ptr<model::Checkpoint> checkpoint_;  // owns the mapping the weights view
  torch::Tensor embed_, lm_head_, final_norm_;
  std::vector<Layer> layers_;
  torch::Tensor inv_freq_;  // [head_dim / 2], f64
};

}  // namespace preft::train
