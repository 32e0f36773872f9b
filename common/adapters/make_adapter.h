#pragma once

// Writes random adapters for a model config in the formats LoadAdapter reads: PEFT LoRA and
// DiReFT folders. Tests, benchmarks and `preft make-adapter` use them; B (LoRA) and W2
// (DiReFT) are random, not zero as at the start of training, so adapters change outputs.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/kernels/dtype.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::adapters {

struct RandomAdapterSpec {
  model::AdapterKind kind = model::AdapterKind::kLora;
  int64_t rank = 8;
  // LoRA
  double alpha = 16;
  bool use_rslora = false;
  std::vector<model::Projection> targets = {model::Projection::kQ,    model::Projection::kK,
                                            model::Projection::kV,    model::Projection::kO,
                                            model::Projection::kGate, model::Projection::kUp,
                                            model::Projection::kDown};
  // Layers adapted; empty: every layer. LoRA writes them as "layers_to_transform".
  std::vector<int64_t> layers;
  // DiReFT
  std::string prompt_positions = "all";  // or pyreft's "fN+lM"
  // Written as "preft_positions" when set.
  std::optional<model::AdapterPositions> preft_positions;
  kernels::DType dtype = kernels::DType::kF32;
  uint64_t seed = 0;
  // Written as "base_model_name_or_path"; empty: the base config's model_type.
  std::string base_model_name_or_path;
};

// Creates `out_dir` if needed and writes adapter_config.json + adapter_model.safetensors.
// Values are normal, drawn from a seeded mt19937_64 per tensor (a tensor depends only on the
// seed and its name), and scaled so an update is about 0.3x the size of what it is added to:
//   LoRA:   s*B*A*x against W*x for make-model's W: A ~ N(0, 1/in), B ~ N(0, (0.3/(s*sqrt(r)))^2)
//   DiReFT: (W1 h + b1) W2 against h: W1 ~ N(0, 1/d), W2 ~ N(0, 0.09/r), b1 ~ N(0, 0.01)
// InvalidArgument for a spec the loader would refuse (rank < 1, a layer out of range, ...).
absl::Status WriteRandomAdapter(const model::ModelConfig& base, const RandomAdapterSpec& spec,
                                const std::string& out_dir);

}  // namespace preft::adapters
