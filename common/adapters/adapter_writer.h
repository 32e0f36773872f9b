#pragma once

// Writes adapter folders in the formats LoadAdapter reads (PEFT LoRA, DiReFT; docs/ADAPTERS.md)
// from an AdapterSpec (what the adapter adapts) and the tensors' values (from a caller: random
// for `preft make-adapter`, trained for `preft train`). The folder's two files are written
// under temporary names and renamed into place, so a reader (the server, a registry) never sees
// a half-written file.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/kernels/dtype.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::adapters {

struct AdapterSpec {
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
  kernels::DType dtype = kernels::DType::kF32;  // of the stored matrices
  // Written as "base_model_name_or_path"; empty: the base config's model_type.
  std::string base_model_name_or_path;
};

// InvalidArgument for a spec the loader would refuse (rank < 1, a layer out of range, a target
// listed twice, prompt positions on a LoRA, ...).
absl::Status CheckAdapterSpec(const model::ModelConfig& base, const AdapterSpec& spec);

// LoRA's scale s: alpha / r, or alpha / sqrt(r) with rsLoRA.
double LoraScale(const AdapterSpec& spec);

// The layers a spec adapts, sorted (every layer when spec.layers is empty).
std::vector<int64_t> AdaptedLayers(const model::ModelConfig& base, const AdapterSpec& spec);

// The tensors a folder for `spec` holds, by file key, with their shapes as stored: LoRA
// "base_model.model.model.layers.{i}.{self_attn|mlp}.{p}_proj.lora_{A,B}.weight" ([r, in],
// [out, r]); DiReFT "layers.{i}.direft.{learned_source.weight, learned_source.bias,
// proj_layer.weight}" ([r, d], [r], [r, d]).
std::map<std::string, std::vector<int64_t>> AdapterTensorShapes(const model::ModelConfig& base,
                                                                const AdapterSpec& spec);

// Fills `out` (`n` floats, row-major in the stored shape) with the tensor named `name`.
using TensorFill = std::function<void(const std::string& name, int64_t n, float* out)>;

// Creates `out_dir` if needed and writes adapter_config.json + adapter_model.safetensors
// (values converted to spec.dtype), each atomically (temp file + rename). The spec is checked
// first (CheckAdapterSpec); nothing is written when it fails.
absl::Status WriteAdapter(const model::ModelConfig& base, const AdapterSpec& spec,
                          const TensorFill& fill, const std::string& out_dir);

}  // namespace preft::adapters
