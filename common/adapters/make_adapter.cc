#include "common/adapters/make_adapter.h"

#include <cmath>
#include <random>

#include "absl/strings/match.h"
#include "common/base/fnv.h"
#include "common/base/status_macros.h"

namespace preft::adapters {
namespace {

// The update's size relative to what it is added to (see make_adapter.h).
constexpr double kRelativeUpdate = 0.3;

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

// The standard deviation of a tensor of `shape` named `name` (see make_adapter.h).
double RandomStd(const RandomAdapterSpec& spec, const std::string& name,
                 const std::vector<int64_t>& shape) {
  const double rank = static_cast<double>(spec.rank);
  if (absl::EndsWith(name, ".lora_A.weight") || absl::EndsWith(name, "learned_source.weight")) {
    return 1.0 / std::sqrt(static_cast<double>(shape[1]));  // 1/sqrt(in)
  }
  if (absl::EndsWith(name, ".lora_B.weight")) {
    return kRelativeUpdate / (LoraScale(spec) * std::sqrt(rank));
  }
  if (absl::EndsWith(name, "learned_source.bias")) return 0.1;
  return kRelativeUpdate / std::sqrt(rank);  // proj_layer.weight
}

}  // namespace

absl::Status WriteRandomAdapter(const model::ModelConfig& base, const RandomAdapterSpec& spec,
                                const std::string& out_dir) {
  PREFT_RETURN_IF_ERROR(CheckAdapterSpec(base, spec));
  const auto shapes = AdapterTensorShapes(base, spec);
  auto fill = [&](const std::string& name, int64_t n, float* out) {
    const bool zeroed = spec.zero_update && (name.ends_with(".lora_B.weight") ||
                                             name.ends_with("proj_layer.weight") ||
                                             name.ends_with("learned_source.bias"));
    const double std = zeroed ? 0.0 : RandomStd(spec, name, shapes.at(name));
    Normal normal(base::SplitMix64(spec.seed ^ base::Fnv1a64(name)));
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(normal.Next() * std);
  };
  return WriteAdapter(base, spec, fill, out_dir);
}

}  // namespace preft::adapters
