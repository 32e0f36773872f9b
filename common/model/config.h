#pragma once

// A model's architecture hyper-parameters, read from Hugging Face's config.json.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/kernels/dtype.h"

namespace preft::model {

enum class Architecture { kLlama, kQwen2, kMistral };

// Llama 3.1 style frequency-dependent RoPE scaling ("rope_type": "llama3"), or none.
struct RopeScaling {
  enum class Type { kNone, kLlama3, kLinear };
  Type type = Type::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  std::string architecture_name;  // e.g. "LlamaForCausalLM"
  std::string model_type;         // e.g. "llama"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;  // num_hidden_layers
  int64_t num_heads = 0;   // num_attention_heads
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;    // "head_dim" if present, else hidden_size / num_heads
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases: true for Qwen2, config "attention_bias" for Llama
  int64_t sliding_window = 0;   // Mistral; 0 = none (recorded, not applied: see docs)
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;
  kernels::DType torch_dtype = kernels::DType::kF32;

  // Parses config.json text. `source` names the file in error messages. Rejects unknown
  // architectures, missing or non-positive sizes, and inconsistent heads
  // (num_heads % num_kv_heads != 0), with InvalidArgument naming the field and value.
  static absl::StatusOr<ModelConfig> FromJson(std::string_view json_text,
                                              std::string_view source = "config.json");
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);

  // Hugging Face config.json text for this config (what make-model writes).
  std::string ToJson() const;
};

}  // namespace preft::model
