#pragma once

// An adapter whose tensors are torch parameters: what `preft train` optimises. LoRA pairs
// (A [r, in], B [out, r], scale s) on the targeted projections of the adapted layers, or DiReFT
// (W1 [r, d], b1 [r], W2 [r, d]) on the adapted layers' outputs: the same maths and the same
// file keys as the server's (docs/ADAPTERS.md), only differentiable. Torch inside: included by
// the trainer's own sources and tests only.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/adapters/adapter_writer.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::train {

// Not thread-safe; one owner (the training loop).
class TrainableAdapter {
 public:
  struct Lora {
    torch::Tensor a;  // [r, in]
    torch::Tensor b;  // [out, r]
    double scale = 1;
  };
  struct Direft {
    torch::Tensor w1;  // [r, d]  learned_source.weight
    torch::Tensor b1;  // [r]     learned_source.bias
    torch::Tensor w2;  // [r, d]  proj_layer.weight
  };

  // A fresh adapter whose update is zero, as training starts: LoRA A ~ U(+-1/sqrt(in)) (PEFT's
  // kaiming_uniform_(a=sqrt(5))) and B = 0; DiReFT W1 ~ U(+-1/sqrt(d)) (nn.Linear's default),
  // b1 = 0 and W2 = 0. Seeded: the same seed gives the same tensors.
  static absl::StatusOr<std::unique_ptr<TrainableAdapter>> Create(
      const model::ModelConfig& base, const adapters::AdapterSpec& spec, uint64_t seed,
      torch::Dtype dtype);
  // An adapter folder (a checkpoint, or the starting point of RL). Every adapted module must
  // share one rank and scale (no rank_pattern / alpha_pattern) and every adapted layer the
  // same targets: Unimplemented otherwise.
  static absl::StatusOr<std::unique_ptr<TrainableAdapter>> Load(const std::string& dir,
                                                                const model::ModelConfig& base,
                                                                torch::Dtype dtype);

  const adapters::AdapterSpec& spec() const { return spec_; }
  // The preft_positions its folder is written with.
  void set_positions(model::AdapterPositions p) { spec_.preft_positions = p; }
  model::AdapterKind kind() const { return spec_.kind; }
  // pyreft's prompt selection (DiReFT; "all" for LoRA).
  const model::PromptSelection& prompt_selection() const { return selection_; }

  // Null when the projection is not adapted in that layer.
  const Lora* lora(int64_t layer, model::Projection p) const;
  const Direft* direft(int64_t layer) const;
  // Every trainable tensor, in file-key order (the optimizer's parameter order).
  std::vector<torch::Tensor> parameters() const;
  // The tensors by file key (for the writer and checkpoints).
  const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters() const {
    return named_;
  }

  // Writes the adapter folder the server loads (f32 values; atomic per file).
  absl::Status Write(const std::string& dir) const;

 private:
  TrainableAdapter(const model::ModelConfig& base, adapters::AdapterSpec spec);
  void Index();

  model::ModelConfig base_;
  adapters::AdapterSpec spec_;
  model::PromptSelection selection_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;
  // [layer][projection] and [layer]; empty tensors where not adapted.
  std::vector<std::array<Lora, model::kNumProjections>> lora_;
  std::vector<Direft> direft_;
};

}  // namespace preft::train
