#pragma once

// Writes random adapters for a model config in the formats LoadAdapter reads: PEFT LoRA and
// DiReFT folders. Tests, benchmarks and `preft make-adapter` use them; B (LoRA) and W2
// (DiReFT) are random, not zero as at the start of training, so adapters change outputs.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/adapters/adapter_writer.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::adapters {

struct RandomAdapterSpec : AdapterSpec {
  uint64_t seed = 0;
  // LoRA's B and DiReFT's W2 (and b1) zero: the update is zero, as when training starts.
  bool zero_update = false;
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
