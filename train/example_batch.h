#pragma once

// Turns examples into one padded TorchBatch with the adapter masks the server would use, and
// scores completions: the logprob of every completion token given everything before it.
// Torch inside.

#include <torch/torch.h>

#include <vector>

#include "common/model/adapter_weights.h"
#include "train/example.h"
#include "train/torch_model.h"

namespace preft::train {

// Where an adapter applies, as the engine decides it (common/engine/engine.cc): prompt tokens
// that the DiReFT selection picks (every prompt token for LoRA), and completion tokens only with
// kAll. The first completion token is predicted from the last prompt position, so it is adapted
// either way; the completion's own positions are not, under PreFT.
struct AdapterMasking {
  model::AdapterPositions positions = model::AdapterPositions::kPrompt;
  model::PromptSelection selection;  // DiReFT's fN+lM; "all" for LoRA
};

struct ExampleBatch {
  TorchBatch batch;
  torch::Tensor targets;           // [N] int64: completion tokens, example by example
  std::vector<int64_t> num_targets;  // per example (its completion's length)
};

// The inputs are prompt + completion without its last token; the logit rows are the positions
// that predict each completion token (P - 1 ... P + C - 2).
ExampleBatch MakeExampleBatch(const std::vector<const Example*>& examples,
                              const AdapterMasking& masking, torch::Dtype dtype);

// log p(target | prefix) for every target of `b` ([N], in the model's dtype, differentiable
// with respect to the adapter), under softmax(logits / temperature): the distribution a
// sampler at that temperature (no other filter) draws from.
torch::Tensor CompletionLogprobs(const TorchModel& model, const TrainableAdapter* adapter,
                                 const ExampleBatch& b, double temperature = 1.0);

}  // namespace preft::train
