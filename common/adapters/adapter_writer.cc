#include "common/adapters/adapter_writer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/adapters/loader_util.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/safetensors.h"

namespace preft::adapters {
namespace {

using internal::Json;
using kernels::DType;

// Ranks above this are no adapter anyone serves; the bound keeps sizes far from overflow.
constexpr int64_t kMaxWriteRank = int64_t{1} << 16;

absl::Status WriteTensors(const std::string& path,
                          const std::map<std::string, std::vector<int64_t>>& shapes, DType dtype,
                          const TensorFill& fill) {
  std::vector<model::TensorSpec> specs;
  for (const auto& [name, shape] : shapes) specs.push_back({name, dtype, shape});
  PREFT_ASSIGN_OR_RETURN(
      auto writer, model::SafetensorsWriter::Create(path, std::move(specs), {{"format", "pt"}}));
  std::vector<float> values;
  std::vector<uint8_t> bytes;
  while (const model::TensorSpec* s = writer->next()) {
    int64_t n = 1;
    for (int64_t d : s->shape) n *= d;
    values.assign(static_cast<size_t>(n), 0.f);
    fill(s->name, n, values.data());
    bytes.resize(static_cast<size_t>(n) * kernels::DTypeSize(s->dtype));
    for (int64_t i = 0; i < n; ++i) kernels::StoreFromF32(bytes.data(), s->dtype, i, values[i]);
    PREFT_RETURN_IF_ERROR(writer->Append(bytes.data(), bytes.size()));
  }
  return writer->Close();
}

absl::Status RenameIntoPlace(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot rename ", from, " to ", to));
  }
  return absl::OkStatus();
}

Json ConfigJson(const model::ModelConfig& base, const AdapterSpec& spec) {
  const std::vector<int64_t> layers = AdaptedLayers(base, spec);
  Json config;
  if (spec.kind == model::AdapterKind::kLora) {
    Json names = Json::array();
    for (model::Projection p : internal::kProjections) {  // module order, as PEFT writes
      if (std::find(spec.targets.begin(), spec.targets.end(), p) != spec.targets.end()) {
        names.push_back(model::ProjectionName(p));
      }
    }
    config["peft_type"] = "LORA";
    config["task_type"] = "CAUSAL_LM";
    config["r"] = spec.rank;
    if (spec.alpha == std::floor(spec.alpha) && spec.alpha < 1e9) {
      config["lora_alpha"] = static_cast<int64_t>(spec.alpha);  // PEFT writes an int
    } else {
      config["lora_alpha"] = spec.alpha;
    }
    config["target_modules"] = names;
    config["use_rslora"] = spec.use_rslora;
    config["bias"] = "none";
    config["fan_in_fan_out"] = false;
    config["lora_dropout"] = 0.0;
    config["use_dora"] = false;
    config["modules_to_save"] = nullptr;
    config["rank_pattern"] = Json::object();
    config["alpha_pattern"] = Json::object();
    config["layers_to_transform"] = spec.layers.empty() ? Json(nullptr) : Json(layers);
    config["inference_mode"] = true;
  } else {
    config["peft_type"] = "DIREFT";
    config["r"] = spec.rank;
    config["layers"] = layers;
    config["component"] = "block_output";
    config["act_fn"] = "linear";
    config["prompt_positions"] = spec.prompt_positions;
  }
  config["base_model_name_or_path"] =
      spec.base_model_name_or_path.empty() ? base.model_type : spec.base_model_name_or_path;
  if (spec.preft_positions) {
    config["preft_positions"] = model::AdapterPositionsName(*spec.preft_positions);
  }
  return config;
}

}  // namespace

absl::Status CheckAdapterSpec(const model::ModelConfig& base, const AdapterSpec& spec) {
  auto invalid = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (base.hidden_size <= 0 || base.num_layers <= 0 || base.num_heads <= 0 ||
      base.num_kv_heads <= 0 || base.head_dim <= 0 || base.intermediate_size <= 0) {
    return invalid("the base model config has non-positive sizes");
  }
  if (spec.rank < 1 || spec.rank > kMaxWriteRank) {
    return invalid("rank must be in [1, ", kMaxWriteRank, "], got ", spec.rank);
  }
  std::set<int64_t> layers;
  for (int64_t l : spec.layers) {
    if (l < 0 || l >= base.num_layers) {
      return invalid("layer ", l, " is out of range: the base model has ", base.num_layers,
                     " layers");
    }
    if (!layers.insert(l).second) return invalid("layer ", l, " is listed twice");
  }
  model::PromptSelection selection;
  if (!model::PromptSelection::Parse(spec.prompt_positions, &selection)) {
    return invalid("prompt positions \"", spec.prompt_positions,
                   "\" are not \"all\" or pyreft's \"fN+lM\"");
  }
  if (spec.kind == model::AdapterKind::kLora) {
    if (!std::isfinite(spec.alpha) || spec.alpha <= 0) {
      return invalid("alpha must be a positive number, got ", spec.alpha);
    }
    if (spec.targets.empty()) return invalid("a LoRA adapter needs at least one target");
    std::set<model::Projection> seen;
    for (model::Projection p : spec.targets) {
      if (!seen.insert(p).second) {
        return invalid("target ", model::ProjectionName(p), " is listed twice");
      }
    }
    if (!selection.all) {
      return invalid("prompt positions (\"", spec.prompt_positions,
                     "\") apply to DiReFT only; LoRA runs on every prompt token");
    }
  }
  return absl::OkStatus();
}

double LoraScale(const AdapterSpec& spec) {
  const double r = static_cast<double>(spec.rank);
  return spec.use_rslora ? spec.alpha / std::sqrt(r) : spec.alpha / r;
}

std::vector<int64_t> AdaptedLayers(const model::ModelConfig& base, const AdapterSpec& spec) {
  std::vector<int64_t> layers = spec.layers;
  std::sort(layers.begin(), layers.end());
  if (layers.empty()) {
    for (int64_t l = 0; l < base.num_layers; ++l) layers.push_back(l);
  }
  return layers;
}

std::map<std::string, std::vector<int64_t>> AdapterTensorShapes(const model::ModelConfig& base,
                                                                const AdapterSpec& spec) {
  std::map<std::string, std::vector<int64_t>> shapes;
  const int64_t r = spec.rank;
  for (int64_t l : AdaptedLayers(base, spec)) {
    if (spec.kind == model::AdapterKind::kLora) {
      for (model::Projection p : spec.targets) {
        const internal::ProjectionDims dims = internal::DimsOf(base, p);
        const std::string prefix = absl::StrCat("base_model.model.", internal::ModuleName(l, p));
        shapes[prefix + ".lora_A.weight"] = {r, dims.in};
        shapes[prefix + ".lora_B.weight"] = {dims.out, r};
      }
    } else {
      const int64_t d = base.hidden_size;
      const std::string prefix = absl::StrCat("layers.", l, ".direft.");
      shapes[prefix + "learned_source.weight"] = {r, d};
      shapes[prefix + "learned_source.bias"] = {r};
      shapes[prefix + "proj_layer.weight"] = {r, d};
    }
  }
  return shapes;
}

absl::Status WriteAdapter(const model::ModelConfig& base, const AdapterSpec& spec,
                          const TensorFill& fill, const std::string& out_dir) {
  if (out_dir.empty()) return absl::InvalidArgumentError("the output folder is empty");
  PREFT_RETURN_IF_ERROR(CheckAdapterSpec(base, spec));
  const std::filesystem::path dir(out_dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(out_dir, ": cannot create directory: ", ec.message()));
  }
  // A stale pickle next to the new safetensors would only confuse readers.
  std::filesystem::remove(dir / "adapter_model.bin", ec);
  const std::string weights = (dir / internal::kWeightsFile).string();
  const std::string config = (dir / internal::kConfigFile).string();
  const std::string suffix = ".tmp";
  PREFT_RETURN_IF_ERROR(
      WriteTensors(weights + suffix, AdapterTensorShapes(base, spec), spec.dtype, fill));
  PREFT_RETURN_IF_ERROR(base::WriteStringToFile(
      config + suffix,
      ConfigJson(base, spec).dump(2, ' ', false, Json::error_handler_t::replace) + "\n"));
  // Weights first: a reader that sees the new config sees the new weights.
  PREFT_RETURN_IF_ERROR(RenameIntoPlace(weights + suffix, weights));
  return RenameIntoPlace(config + suffix, config);
}

}  // namespace preft::adapters
