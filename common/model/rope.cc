#include "common/model/rope.h"

#include <cmath>
#include <numbers>

namespace preft::model {

std::vector<float> RopeInverseFrequencies(const ModelConfig& config) {
  const int64_t dim = config.head_dim;
  std::vector<float> out(dim / 2);
  const RopeScaling& rs = config.rope_scaling;
  for (int64_t i = 0; i < dim / 2; ++i) {
    // HF builds inv_freq in float32 from an int64 arange; mirror that rounding.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    double f = 1.0 / std::pow(config.rope_theta, static_cast<double>(exponent));
    if (rs.type == RopeScaling::Type::kLinear) {
      f /= rs.factor;
    } else if (rs.type == RopeScaling::Type::kLlama3) {
      const double orig = static_cast<double>(rs.original_max_position_embeddings);
      const double low_freq_wavelen = orig / rs.low_freq_factor;
      const double high_freq_wavelen = orig / rs.high_freq_factor;
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f /= rs.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth =
            (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        f = (1 - smooth) * f / rs.factor + smooth * f;
      }
    }
    out[i] = static_cast<float>(f);
  }
  return out;
}

}  // namespace preft::model
