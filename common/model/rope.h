#pragma once

// RoPE inverse frequencies, with Llama 3.1 ("llama3") and linear scaling as Hugging Face
// computes them (transformers' modeling_rope_utils).

#include <vector>

#include "common/model/config.h"

namespace preft::model {

std::vector<float> RopeInverseFrequencies(const ModelConfig& config);

}  // namespace preft::model
