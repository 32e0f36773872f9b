#include "common/adapters/make_adapter.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/adapters/loader_util.h"
#include "common/base/fnv.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/safetensors.h"

namespace preft::adapters {
namespace {

using internal::Json;
using kernels::DType;

// Ranks above this are no adapter anyone serves; the bound keeps sizes far from overflow.
constexpr int64_t kMaxWriteRank = int64_t{1} << 16;
// The update's size relative to what it is added to (see make_adapter.h).
constexpr double kRelativeUpdate = 0.3;

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t HashName(const std::string& s) { return base::Fnv1a64(s); }

// Box-Muller over mt19937_64: std::normal_distribution's algorithm differs between standard
// libraries, and a seed should give the same adapter wherever it is built.
class Normal {
 public:
  explicit Normal(uint64_t seed) : gen_(seed) {}
  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (static_cast<double>(gen_() >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
    const double u2 = static_cast<double>(gen_() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    constexpr double kTwoPi = 6.283185307179586476925;
    spare_ = radius * std::sin(kTwoPi * u2);
    has_spare_ = true;
    return radius * std::cos(kTwoPi * u2);
  }

 private:
  std::mt19937_64 gen_;
  bool has_spare_ = false;
  double spare_ = 0;
};

struct RandomTensor {
  std::vector<int64_t> shape;
  double std = 0;
};

absl::Status CheckSpec(const model::ModelConfig& base, const RandomAdapterSpec& spec,
                       const std::string& out_dir) {
  auto invalid = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (out_dir.empty()) return invalid("the output folder is empty");
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

absl::Status WriteTensors(const std::string& path, const std::map<std::string, RandomTensor>& all,
                          DType dtype, uint64_t seed) {
  std::vector<model::TensorSpec> specs;
  for (const auto& [name, t] : all) {
    specs.push_back({name, dtype, t.shape});
  }
  PREFT_ASSIGN_OR_RETURN(
      auto writer, model::SafetensorsWriter::Create(path, std::move(specs), {{"format", "pt"}}));
  std::vector<uint8_t> bytes;
  while (const model::TensorSpec* s = writer->next()) {
    const RandomTensor& t = all.at(s->name);
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    bytes.resize(static_cast<size_t>(n) * kernels::DTypeSize(s->dtype));
    Normal normal(SplitMix64(seed ^ HashName(s->name)));
    for (int64_t i = 0; i < n; ++i) {
      kernels::StoreFromF32(bytes.data(), s->dtype, i, static_cast<float>(normal.Next() * t.std));
    }
    PREFT_RETURN_IF_ERROR(writer->Append(bytes.data(), bytes.size()));
  }
  return writer->Close();
}

}  // namespace

absl::Status WriteRandomAdapter(const model::ModelConfig& base, const RandomAdapterSpec& spec,
                                const std::string& out_dir) {
  PREFT_RETURN_IF_ERROR(CheckSpec(base, spec, out_dir));
  std::vector<int64_t> layers = spec.layers;
  std::sort(layers.begin(), layers.end());
  const bool all_layers = layers.empty();
  if (all_layers) {
    for (int64_t l = 0; l < base.num_layers; ++l) layers.push_back(l);
  }
  const int64_t r = spec.rank;
  const double rank = static_cast<double>(r);

  std::map<std::string, RandomTensor> tensors;
  Json config;
  if (spec.kind == model::AdapterKind::kLora) {
    const double scale = spec.use_rslora ? spec.alpha / std::sqrt(rank) : spec.alpha / rank;
    std::vector<model::Projection> targets;
    for (model::Projection p : internal::kProjections) {  // module order, as PEFT writes
      if (std::find(spec.targets.begin(), spec.targets.end(), p) != spec.targets.end()) {
        targets.push_back(p);
      }
    }
    for (int64_t l : layers) {
      for (model::Projection p : targets) {
        const internal::ProjectionDims dims = internal::DimsOf(base, p);
        const std::string prefix = absl::StrCat("base_model.model.", internal::ModuleName(l, p));
        tensors[prefix + ".lora_A.weight"] = {{r, dims.in}, 1.0 / std::sqrt(dims.in)};
        tensors[prefix + ".lora_B.weight"] = {{dims.out, r},
                                              kRelativeUpdate / (scale * std::sqrt(rank))};
      }
    }
    Json names = Json::array();
    for (model::Projection p : targets) names.push_back(model::ProjectionName(p));
    config["peft_type"] = "LORA";
    config["task_type"] = "CAUSAL_LM";
    config["r"] = r;
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
    config["layers_to_transform"] = all_layers ? Json(nullptr) : Json(layers);
    config["inference_mode"] = true;
  } else {
    const int64_t d = base.hidden_size;
    for (int64_t l : layers) {
      const std::string prefix = absl::StrCat("layers.", l, ".direft.");
      tensors[prefix + "learned_source.weight"] = {{r, d}, 1.0 / std::sqrt(d)};
      tensors[prefix + "learned_source.bias"] = {{r}, 0.1};
      tensors[prefix + "proj_layer.weight"] = {{r, d}, kRelativeUpdate / std::sqrt(rank)};
    }
    config["peft_type"] = "DIREFT";
    config["r"] = r;
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

  const std::filesystem::path dir(out_dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(out_dir, ": cannot create directory: ", ec.message()));
  }
  // A stale pickle next to the new safetensors would only confuse readers.
  std::filesystem::remove(dir / "adapter_model.bin", ec);
  PREFT_RETURN_IF_ERROR(
      WriteTensors((dir / internal::kWeightsFile).string(), tensors, spec.dtype, spec.seed));
  return base::WriteStringToFile((dir / internal::kConfigFile).string(),
                                 config.dump(2, ' ', false, Json::error_handler_t::replace) + "\n");
}

}  // namespace preft::adapters
