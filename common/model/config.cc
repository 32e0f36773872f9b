#include "common/model/config.h"

#include <cmath>
#include <exception>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace preft::model {
namespace {

using Json = nlohmann::json;

// Sizes above this are not a model we can serve; the bound also keeps every product of two
// sizes far from int64 overflow, whatever a (fuzzed) config says.
constexpr int64_t kMaxSize = int64_t{1} << 30;
// config.json is flat; deeper nesting is hostile input (and nlohmann recurses on it).
constexpr int kMaxJsonDepth = 16;

struct Architectures {
  const char* name;
  const char* model_type;
  Architecture arch;
};
constexpr Architectures kArchitectures[] = {
    {"LlamaForCausalLM", "llama", Architecture::kLlama},
    {"Qwen2ForCausalLM", "qwen2", Architecture::kQwen2},
    {"MistralForCausalLM", "mistral", Architecture::kMistral},
};

// Reads config fields and builds messages that start with the file name.
class Reader {
 public:
  Reader(const Json& j, std::string_view source) : j_(j), source_(source) {}

  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", std::string(what)));
  }

  bool Has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  absl::StatusOr<int64_t> Int(const char* key, const Json& v) const {
    if (!v.is_number_integer()) {
      return Error(absl::StrCat("\"", key, "\" must be an integer, got ", Show(v)));
    }
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxSize)) {
      return Error(absl::StrCat("\"", key, "\" = ", Show(v), " is too large"));
    }
    return v.get<int64_t>();
  }

  // A required positive size, bounded by kMaxSize.
  absl::StatusOr<int64_t> Size(const char* key) const {
    if (!Has(key)) return Error(absl::StrCat("missing required field \"", key, "\""));
    PREFT_ASSIGN_OR_RETURN(int64_t v, Int(key, j_.at(key)));
    if (v <= 0 || v > kMaxSize) {
      return Error(absl::StrCat("\"", key, "\" must be in [1, ", kMaxSize, "], got ", v));
    }
    return v;
  }

  absl::StatusOr<int64_t> OptionalSize(const char* key, int64_t fallback) const {
    if (!Has(key)) return fallback;
    return Size(key);
  }

  absl::StatusOr<double> PositiveNumber(const Json& obj, const char* key, double fallback) const {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    const Json& v = obj.at(key);
    if (!v.is_number()) return Error(absl::StrCat("\"", key, "\" must be a number, got ", Show(v)));
    double d = v.get<double>();
    if (!std::isfinite(d) || d <= 0) {
      return Error(absl::StrCat("\"", key, "\" must be a positive number, got ", Show(v)));
    }
    return d;
  }

  absl::StatusOr<bool> Bool(const char* key, bool fallback) const {
    if (!Has(key)) return fallback;
    const Json& v = j_.at(key);
    if (!v.is_boolean())
      return Error(absl::StrCat("\"", key, "\" must be true or false, got ", Show(v)));
    return v.get<bool>();
  }

  absl::StatusOr<int32_t> TokenId(const char* key, const Json& v) const {
    PREFT_ASSIGN_OR_RETURN(int64_t id, Int(key, v));
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
      return Error(absl::StrCat("\"", key, "\" = ", id, " is not a valid token id"));
    }
    return static_cast<int32_t>(id);
  }

  static std::string Show(const Json& v) {
    std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
    if (s.size() > 64) s = s.substr(0, 61) + "...";
    return s;
  }

 private:
  const Json& j_;
  std::string source_;
};

absl::Status ParseRopeScaling(const Reader& r, const Json& rs, RopeScaling* out) {
  *out = RopeScaling{};
  if (rs.is_null()) return absl::OkStatus();
  if (!rs.is_object()) return r.Error(absl::StrCat("\"rope_scaling\" must be an object or null"));
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    if (rs.contains(key) && rs.at(key).is_string()) {
      type = rs.at(key).get<std::string>();
      break;
    }
  }
  if (type.empty()) return r.Error("\"rope_scaling\" has no \"rope_type\" (or \"type\")");
  if (type == "default") return absl::OkStatus();
  if (type != "llama3" && type != "linear") {
    return r.Error(absl::StrCat("unsupported rope_scaling type \"", type,
                                "\" (supported: llama3, linear, default)"));
  }
  PREFT_ASSIGN_OR_RETURN(out->factor, r.PositiveNumber(rs, "factor", -1));
  if (out->factor <= 0) return r.Error("\"rope_scaling\" needs a positive \"factor\"");
  if (type == "linear") {
    out->type = RopeScaling::Type::kLinear;
    return absl::OkStatus();
  }
  out->type = RopeScaling::Type::kLlama3;
  PREFT_ASSIGN_OR_RETURN(out->low_freq_factor, r.PositiveNumber(rs, "low_freq_factor", 1.0));
  PREFT_ASSIGN_OR_RETURN(out->high_freq_factor, r.PositiveNumber(rs, "high_freq_factor", 4.0));
  if (!(out->high_freq_factor > out->low_freq_factor)) {
    return r.Error(absl::StrFormat(
        "rope_scaling high_freq_factor (%g) must be greater than low_freq_factor (%g)",
        out->high_freq_factor, out->low_freq_factor));
  }
  const char* kOrig = "original_max_position_embeddings";
  if (!rs.contains(kOrig))
    return r.Error(absl::StrCat("llama3 rope_scaling needs \"", kOrig, "\""));
  PREFT_ASSIGN_OR_RETURN(int64_t orig, r.Int(kOrig, rs.at(kOrig)));
  if (orig <= 0) return r.Error(absl::StrCat("\"", kOrig, "\" must be positive, got ", orig));
  out->original_max_position_embeddings = orig;
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> Parse(const Json& j, std::string_view source) {
  Reader r(j, source);
  if (!j.is_object()) return r.Error("top level must be a JSON object");
  ModelConfig c;

  // Architecture: "architectures"[0], else "model_type".
  std::string arch_name;
  if (r.Has("architectures")) {
    const Json& a = j.at("architectures");
    if (!a.is_array() || a.empty() || !a.at(0).is_string()) {
      return r.Error("\"architectures\" must be a non-empty list of strings");
    }
    arch_name = a.at(0).get<std::string>();
  }
  if (r.Has("model_type")) {
    if (!j.at("model_type").is_string()) return r.Error("\"model_type\" must be a string");
    c.model_type = j.at("model_type").get<std::string>();
  }
  bool found = false;
  for (const auto& a : kArchitectures) {
    if (arch_name.empty() ? c.model_type == a.model_type : arch_name == a.name) {
      c.architecture = a.arch;
      c.architecture_name = a.name;
      if (c.model_type.empty()) c.model_type = a.model_type;
      found = true;
      break;
    }
  }
  if (!found) {
    if (arch_name.empty() && c.model_type.empty()) {
      return r.Error("missing required field \"architectures\"");
    }
    return r.Error(
        absl::StrCat("unsupported architecture \"", arch_name.empty() ? c.model_type : arch_name,
                     "\" (supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)"));
  }

  PREFT_ASSIGN_OR_RETURN(c.hidden_size, r.Size("hidden_size"));
  PREFT_ASSIGN_OR_RETURN(c.intermediate_size, r.Size("intermediate_size"));
  PREFT_ASSIGN_OR_RETURN(c.num_layers, r.Size("num_hidden_layers"));
  PREFT_ASSIGN_OR_RETURN(c.num_heads, r.Size("num_attention_heads"));
  PREFT_ASSIGN_OR_RETURN(c.num_kv_heads, r.OptionalSize("num_key_value_heads", c.num_heads));
  PREFT_ASSIGN_OR_RETURN(c.vocab_size, r.Size("vocab_size"));
  PREFT_ASSIGN_OR_RETURN(c.max_position_embeddings,
                         r.OptionalSize("max_position_embeddings", 2048));
  if (c.num_heads % c.num_kv_heads != 0) {
    return r.Error(absl::StrCat("num_attention_heads (", c.num_heads,
                                ") must be a multiple of num_key_value_heads (", c.num_kv_heads,
                                ")"));
  }
  if (r.Has("head_dim")) {
    PREFT_ASSIGN_OR_RETURN(c.head_dim, r.Size("head_dim"));
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      return r.Error(absl::StrCat("hidden_size (", c.hidden_size,
                                  ") is not a multiple of num_attention_heads (", c.num_heads,
                                  ") and there is no \"head_dim\""));
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2 != 0)
    return r.Error(absl::StrCat("head_dim must be even for RoPE, got ", c.head_dim));

  PREFT_ASSIGN_OR_RETURN(c.rms_norm_eps, r.PositiveNumber(j, "rms_norm_eps", 1e-6));
  PREFT_ASSIGN_OR_RETURN(c.rope_theta, r.PositiveNumber(j, "rope_theta", 10000.0));
  if (j.contains("rope_scaling")) {
    PREFT_RETURN_IF_ERROR(ParseRopeScaling(r, j.at("rope_scaling"), &c.rope_scaling));
  }
  if (r.Has("hidden_act")) {
    const Json& act = j.at("hidden_act");
    if (!act.is_string() || act.get<std::string>() != "silu") {
      return r.Error(
          absl::StrCat("unsupported hidden_act ", Reader::Show(act), " (only \"silu\")"));
    }
  }
  PREFT_ASSIGN_OR_RETURN(bool mlp_bias, r.Bool("mlp_bias", false));
  if (mlp_bias) return r.Error("\"mlp_bias\": true is not supported");
  PREFT_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.Bool("tie_word_embeddings", false));

  switch (c.architecture) {
    case Architecture::kQwen2: {
      c.attention_bias = true;  // Qwen2's q/k/v projections always carry biases.
      PREFT_ASSIGN_OR_RETURN(bool use_sliding, r.Bool("use_sliding_window", false));
      if (use_sliding && r.Has("sliding_window")) {
        PREFT_ASSIGN_OR_RETURN(c.sliding_window, r.Size("sliding_window"));
      }
      break;
    }
    case Architecture::kLlama: {
      PREFT_ASSIGN_OR_RETURN(c.attention_bias, r.Bool("attention_bias", false));
      break;
    }
    case Architecture::kMistral: {
      if (r.Has("sliding_window")) {
        PREFT_ASSIGN_OR_RETURN(c.sliding_window, r.Size("sliding_window"));
      }
      break;
    }
  }

  if (r.Has("bos_token_id")) {
    PREFT_ASSIGN_OR_RETURN(c.bos_token_id, r.TokenId("bos_token_id", j.at("bos_token_id")));
  }
  if (r.Has("eos_token_id")) {
    const Json& eos = j.at("eos_token_id");
    if (eos.is_array()) {
      for (const Json& e : eos) {
        PREFT_ASSIGN_OR_RETURN(int32_t id, r.TokenId("eos_token_id", e));
        c.eos_token_ids.push_back(id);
      }
    } else {
      PREFT_ASSIGN_OR_RETURN(int32_t id, r.TokenId("eos_token_id", eos));
      c.eos_token_ids.push_back(id);
    }
  }

  // Newer transformers write "dtype"; older ones "torch_dtype".
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (!r.Has(key)) continue;
    const Json& d = j.at(key);
    std::string s = d.is_string() ? d.get<std::string>() : "";
    if (s == "float32") {
      c.torch_dtype = kernels::DType::kF32;
    } else if (s == "bfloat16") {
      c.torch_dtype = kernels::DType::kBF16;
    } else if (s == "float16") {
      c.torch_dtype = kernels::DType::kF16;
    } else {
      return r.Error(absl::StrCat("unsupported \"", key, "\" ", Reader::Show(d),
                                  " (supported: float32, bfloat16, float16)"));
    }
    break;
  }
  return c;
}

const char* TorchDTypeName(kernels::DType t) {
  switch (t) {
    case kernels::DType::kF32:
      return "float32";
    case kernels::DType::kF16:
      return "float16";
    case kernels::DType::kBF16:
      return "bfloat16";
  }
  return "float32";
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromJson(std::string_view json_text,
                                                  std::string_view source) {
  try {
    Json::parser_callback_t limit_depth = [](int depth, Json::parse_event_t, Json&) {
      if (depth > kMaxJsonDepth) throw std::length_error("JSON nested too deeply");
      return true;
    };
    Json j = Json::parse(json_text.begin(), json_text.end(), limit_depth);
    return Parse(j, source);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source), ": not valid JSON: ", e.what()));
  }
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  PREFT_ASSIGN_OR_RETURN(std::string text, base::ReadFileToString(path));
  return FromJson(text, path);
}

std::string ModelConfig::ToJson() const {
  std::string arch_name = architecture_name;
  std::string type = model_type;
  for (const auto& a : kArchitectures) {
    if (a.arch != architecture) continue;
    if (arch_name.empty()) arch_name = a.name;
    if (type.empty()) type = a.model_type;
  }
  Json j;
  j["architectures"] = Json::array({arch_name});
  j["model_type"] = type;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["torch_dtype"] = TorchDTypeName(torch_dtype);
  switch (rope_scaling.type) {
    case RopeScaling::Type::kNone:
      j["rope_scaling"] = nullptr;
      break;
    case RopeScaling::Type::kLinear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rope_scaling.factor}};
      break;
    case RopeScaling::Type::kLlama3:
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", rope_scaling.factor},
          {"low_freq_factor", rope_scaling.low_freq_factor},
          {"high_freq_factor", rope_scaling.high_freq_factor},
          {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
      break;
  }
  switch (architecture) {
    case Architecture::kLlama:
      j["attention_bias"] = attention_bias;
      j["mlp_bias"] = false;
      break;
    case Architecture::kQwen2:
      j["use_sliding_window"] = sliding_window > 0;
      j["sliding_window"] = sliding_window > 0 ? Json(sliding_window) : Json(nullptr);
      break;
    case Architecture::kMistral:
      j["sliding_window"] = sliding_window > 0 ? Json(sliding_window) : Json(nullptr);
      break;
  }
  j["bos_token_id"] = bos_token_id >= 0 ? Json(bos_token_id) : Json(nullptr);
  if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace preft::model
