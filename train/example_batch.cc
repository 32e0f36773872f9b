#include "train/example_batch.h"

#include <algorithm>

namespace preft::train {

ExampleBatch MakeExampleBatch(const std::vector<const Example*>& examples,
                              const AdapterMasking& masking, torch::Dtype dtype) {
  const int64_t B = static_cast<int64_t>(examples.size());
  int64_t T = 1, N = 0;
  for (const Example* e : examples) {
    T = std::max(T, e->num_tokens() - 1);
    N += static_cast<int64_t>(e->completion_ids.size());
  }
  torch::Tensor ids = torch::zeros({B, T}, torch::kInt64);
  torch::Tensor lora = torch::zeros({B, T, 1}, torch::kFloat64);
  torch::Tensor direft = torch::zeros({B, T, 1}, torch::kFloat64);
  torch::Tensor rows = torch::empty({N}, torch::kInt64);
  torch::Tensor targets = torch::empty({N}, torch::kInt64);
  auto id = ids.accessor<int64_t, 2>();
  auto lm = lora.accessor<double, 3>();
  auto dm = direft.accessor<double, 3>();
  auto row = rows.accessor<int64_t, 1>();
  auto target = targets.accessor<int64_t, 1>();
  ExampleBatch out;
  const bool all = masking.positions == model::AdapterPositions::kAll;
  int64_t n = 0;
  for (int64_t b = 0; b < B; ++b) {
    const Example& e = *examples[b];
    const int64_t P = static_cast<int64_t>(e.prompt_ids.size());
    const int64_t C = static_cast<int64_t>(e.completion_ids.size());
    for (int64_t t = 0; t < P + C - 1; ++t) {
      id[b][t] = t < P ? e.prompt_ids[t] : e.completion_ids[t - P];
      lm[b][t][0] = t < P || all ? 1.0 : 0.0;
      dm[b][t][0] = (t < P ? masking.selection.Selected(t, P) : all) ? 1.0 : 0.0;
    }
    for (int64_t i = 0; i < C; ++i, ++n) {
      row[n] = b * T + P - 1 + i;
      target[n] = e.completion_ids[i];
    }
    out.num_targets.push_back(C);
  }
  out.batch = {ids, lora.to(dtype), direft.to(dtype), rows};
  out.targets = targets;
  return out;
}

torch::Tensor CompletionLogprobs(const TorchModel& model, const TrainableAdapter* adapter,
                                 const ExampleBatch& b, double temperature) {
  torch::Tensor logits = model.Forward(b.batch, adapter);
  if (temperature != 1.0) logits = logits / temperature;
  return torch::log_softmax(logits, -1).gather(1, b.targets.unsqueeze(1)).squeeze(1);
}

}  // namespace preft::train
