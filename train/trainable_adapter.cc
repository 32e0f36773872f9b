#include "train/trainable_adapter.h"

#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/adapters/adapter_loader.h"
#include "common/adapters/loader_util.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace preft::train {
namespace {

using model::AdapterKind;
using model::Projection;

std::string LoraKey(int64_t layer, Projection p, const char* which) {
  return absl::StrCat("base_model.model.", adapters::internal::ModuleName(layer, p), ".lora_",
                      which, ".weight");
}

std::string DireftKey(int64_t layer, const char* which) {
  return absl::StrCat("layers.", layer, ".direft.", which);
}

// A copy of `m` ([rows, cols], row-major, any dtype) as a tensor.
torch::Tensor ToTensor(const kernels::MatrixView& m, torch::Dtype dtype) {
  torch::Tensor t = torch::empty({m.rows, m.cols}, torch::kFloat64);
  double* out = t.data_ptr<double>();
  for (int64_t i = 0; i < m.rows * m.cols; ++i) out[i] = kernels::LoadAsF32(m.data, m.dtype, i);
  return t.to(dtype);
}

}  // namespace

TrainableAdapter::TrainableAdapter(const model::ModelConfig& base, adapters::AdapterSpec spec)
    : base_(base), spec_(std::move(spec)) {
  model::PromptSelection::Parse(spec_.prompt_positions, &selection_);
  lora_.resize(base_.num_layers);
  direft_.resize(base_.num_layers);
}

absl::StatusOr<std::unique_ptr<TrainableAdapter>> TrainableAdapter::Create(
    const model::ModelConfig& base, const adapters::AdapterSpec& spec, uint64_t seed,
    torch::Dtype dtype) {
  PREFT_RETURN_IF_ERROR(adapters::CheckAdapterSpec(base, spec));
  std::unique_ptr<TrainableAdapter> a(new TrainableAdapter(base, spec));
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (const auto& [name, shape] : adapters::AdapterTensorShapes(base, spec)) {
    torch::Tensor t = torch::zeros(shape, torch::TensorOptions().dtype(torch::kFloat64));
    // lora_A and learned_source.weight are [r, in]: uniform in +-1/sqrt(in); the rest zero.
    const bool random = name.ends_with(".lora_A.weight") || name.ends_with("learned_source.weight");
    if (random) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(shape[1]));
      t.uniform_(-bound, bound);
    }
    a->named_.emplace_back(name, t.to(dtype).set_requires_grad(true));
  }
  a->Index();
  return a;
}

absl::StatusOr<std::unique_ptr<TrainableAdapter>> TrainableAdapter::Load(
    const std::string& dir, const model::ModelConfig& base, torch::Dtype dtype) {
  PREFT_ASSIGN_OR_RETURN(auto weights, adapters::LoadAdapter(dir, base));
  PREFT_ASSIGN_OR_RETURN(std::string config_text,
                         base::ReadFileToString(dir + "/" + adapters::internal::kConfigFile));
  const nlohmann::json config = nlohmann::json::parse(config_text, nullptr, false);
  auto unimplemented = [&](auto&&... parts) {
    return absl::UnimplementedError(absl::StrCat(dir, ": ", parts...));
  };

  adapters::AdapterSpec spec;
  spec.kind = weights->kind();
  spec.rank = weights->max_rank();
  spec.dtype = kernels::DType::kF32;
  if (config.contains("preft_positions") && config["preft_positions"].is_string()) {
    spec.preft_positions = weights->default_positions;
  }
  if (config.contains("base_model_name_or_path") && config["base_model_name_or_path"].is_string()) {
    spec.base_model_name_or_path = config["base_model_name_or_path"].get<std::string>();
  }
  std::vector<int64_t> layers;
  if (spec.kind == AdapterKind::kLora) {
    spec.alpha = config.value("lora_alpha", 8.0);
    spec.use_rslora = config.value("use_rslora", false);
    const double scale = adapters::LoraScale(spec);
    std::set<Projection> targets;
    for (int64_t l = 0; l < base.num_layers; ++l)
      for (Projection p : adapters::internal::kProjections)
        if (!weights->lora(l, p).empty()) targets.insert(p);
    spec.targets.assign(targets.begin(), targets.end());
    for (int64_t l = 0; l < base.num_layers; ++l) {
      int n = 0;
      for (Projection p : spec.targets) {
        const model::LowRank& lr = weights->lora(l, p);
        if (lr.empty()) continue;
        ++n;
        if (lr.rank() != spec.rank || std::abs(lr.scale - scale) > 1e-6 * scale) {
          return unimplemented("training an adapter whose modules differ in rank or scale "
                               "(rank_pattern / alpha_pattern) is not supported");
        }
      }
      if (n == 0) continue;
      if (n != static_cast<int>(spec.targets.size())) {
        return unimplemented("training an adapter whose layers adapt different projections is "
                             "not supported");
      }
      layers.push_back(l);
    }
  } else {
    spec.prompt_positions = weights->prompt_selection.ToString();
    for (int64_t l = 0; l < base.num_layers; ++l) {
      if (weights->direft(l).empty()) continue;
      if (weights->direft(l).rank() != spec.rank) {
        return unimplemented("training a DiReFT whose layers differ in rank is not supported");
      }
      layers.push_back(l);
    }
  }
  if (static_cast<int64_t>(layers.size()) != base.num_layers) spec.layers = layers;

  std::unique_ptr<TrainableAdapter> a(new TrainableAdapter(base, spec));
  torch::NoGradGuard no_grad;
  for (const auto& [name, shape] : adapters::AdapterTensorShapes(base, spec)) {
    a->named_.emplace_back(name, torch::Tensor());
  }
  for (int64_t l : layers) {
    auto set = [&](const std::string& key, torch::Tensor t) {
      for (auto& [name, tensor] : a->named_)
        if (name == key) tensor = t.contiguous().set_requires_grad(true);
    };
    if (spec.kind == AdapterKind::kLora) {
      for (Projection p : spec.targets) {
        const model::LowRank& lr = weights->lora(l, p);
        set(LoraKey(l, p, "A"), ToTensor(lr.shrink, dtype));
        set(LoraKey(l, p, "B"), ToTensor(lr.expand, dtype).t());  // expand is B^T
      }
    } else {
      const model::LowRank& lr = weights->direft(l);
      set(DireftKey(l, "learned_source.weight"), ToTensor(lr.shrink, dtype));
      torch::Tensor bias = torch::zeros({spec.rank}, torch::kFloat64);
      if (lr.shrink_bias != nullptr)
        for (int64_t i = 0; i < spec.rank; ++i) bias[i] = lr.shrink_bias[i];
      set(DireftKey(l, "learned_source.bias"), bias.to(dtype));
      set(DireftKey(l, "proj_layer.weight"), ToTensor(lr.expand, dtype));
    }
  }
  a->Index();
  return a;
}

void TrainableAdapter::Index() {
  auto find = [&](const std::string& key) {
    for (const auto& [name, tensor] : named_)
      if (name == key) return tensor;
    return torch::Tensor();
  };
  const double scale = adapters::LoraScale(spec_);
  for (int64_t l : adapters::AdaptedLayers(base_, spec_)) {
    if (spec_.kind == AdapterKind::kLora) {
      for (Projection p : spec_.targets) {
        lora_[l][static_cast<int>(p)] = {find(LoraKey(l, p, "A")), find(LoraKey(l, p, "B")),
                                         scale};
      }
    } else {
      direft_[l] = {find(DireftKey(l, "learned_source.weight")),
                    find(DireftKey(l, "learned_source.bias")),
                    find(DireftKey(l, "proj_layer.weight"))};
    }
  }
}

const TrainableAdapter::Lora* TrainableAdapter::lora(int64_t layer, Projection p) const {
  const Lora& l = lora_[layer][static_cast<int>(p)];
  return l.a.defined() ? &l : nullptr;
}

const TrainableAdapter::Direft* TrainableAdapter::direft(int64_t layer) const {
  const Direft& d = direft_[layer];
  return d.w1.defined() ? &d : nullptr;
}

std::vector<torch::Tensor> TrainableAdapter::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& [name, tensor] : named_) out.push_back(tensor);
  return out;
}

absl::Status TrainableAdapter::Write(const std::string& dir) const {
  adapters::AdapterSpec spec = spec_;
  spec.dtype = kernels::DType::kF32;
  auto fill = [&](const std::string& name, int64_t n, float* out) {
    for (const auto& [key, tensor] : named_) {
      if (key != name) continue;
      torch::Tensor t = tensor.detach().to(torch::kFloat32).contiguous();
      std::memcpy(out, t.data_ptr<float>(), n * sizeof(float));
    }
  };
  return adapters::WriteAdapter(base_, spec, fill, dir);
}

}  // namespace preft::train
