#include "common/model/make_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/fnv.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/checkpoint.h"
#include "common/model/safetensors.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace preft::model {
namespace {

using kernels::DType;

// Hidden-size-64 toys share the reference fixture's shapes (tiny-llama in shared/fixtures).
ModelConfig Tiny(Architecture arch) {
  ModelConfig c;
  c.architecture = arch;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 300;
  c.max_position_embeddings = 2048;
  c.rms_norm_eps = 1e-5;
  return c;
}

void Name(ModelConfig* c) {
  switch (c->architecture) {
    case Architecture::kLlama:
      c->architecture_name = "LlamaForCausalLM";
      c->model_type = "llama";
      break;
    case Architecture::kQwen2:
      c->architecture_name = "Qwen2ForCausalLM";
      c->model_type = "qwen2";
      break;
    case Architecture::kMistral:
      c->architecture_name = "MistralForCausalLM";
      c->model_type = "mistral";
      break;
  }
}

RopeScaling Llama3Scaling(double factor, int64_t original_max_position_embeddings) {
  RopeScaling r;
  r.type = RopeScaling::Type::kLlama3;
  r.factor = factor;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = original_max_position_embeddings;
  return r;
}

std::map<std::string, ModelConfig> Presets() {
  std::map<std::string, ModelConfig> p;
  {
    ModelConfig c = Tiny(Architecture::kLlama);
    c.rope_theta = 500000.0;
    // Short original context so the llama3 frequency scaling matters at test lengths.
    c.rope_scaling = Llama3Scaling(8.0, 64);
    p["tiny"] = c;
  }
  {
    ModelConfig c = Tiny(Architecture::kQwen2);
    c.vocab_size = 320;
    c.rope_theta = 1000000.0;
    c.rms_norm_eps = 1e-6;
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    p["tiny-qwen2"] = c;
  }
  {
    ModelConfig c = Tiny(Architecture::kMistral);
    c.rope_theta = 1000000.0;
    c.sliding_window = 32;  // short, so tests with longer prompts exercise the window
    p["tiny-mistral"] = c;
  }
  {
    ModelConfig c;
    c.architecture = Architecture::kQwen2;
    c.hidden_size = 896;
    c.intermediate_size = 4864;
    c.num_layers = 24;
    c.num_heads = 14;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.vocab_size = 151936;
    c.max_position_embeddings = 32768;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 1000000.0;
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    p["qwen2.5-0.5b"] = c;
  }
  {
    ModelConfig c;
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_layers = 16;
    c.num_heads = 32;
    c.num_kv_heads = 8;
    c.head_dim = 64;
    c.vocab_size = 128256;
    c.max_position_embeddings = 131072;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000.0;
    c.rope_scaling = Llama3Scaling(32.0, 8192);
    c.tie_word_embeddings = true;
    p["llama3.2-1b"] = c;
  }
  {
    ModelConfig c;
    c.hidden_size = 4096;
    c.intermediate_size = 14336;
    c.num_layers = 32;
    c.num_heads = 32;
    c.num_kv_heads = 8;
    c.head_dim = 128;
    c.vocab_size = 128256;
    c.max_position_embeddings = 131072;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000.0;
    c.rope_scaling = Llama3Scaling(8.0, 8192);
    c.tie_word_embeddings = false;
    p["llama3.1-8b"] = c;
  }
  {
    // Served split over GPUs (--tensor-parallel): 64 heads, 8 KV heads, 28672 MLP width.
    ModelConfig c = p["llama3.1-8b"];
    c.hidden_size = 8192;
    c.intermediate_size = 28672;
    c.num_layers = 80;
    c.num_heads = 64;
    p["llama3.1-70b"] = c;
  }
  for (auto& [name, c] : p) Name(&c);
  return p;
}

uint64_t HashName(std::string_view s) { return base::Fnv1a64(s); }

// murmur3's finalizer: 32-bit multiplies, so the fill loop vectorizes with AVX2.
inline uint32_t Fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

template <DType kType>
inline void Store(void* out, int64_t i, float v) {
  if constexpr (kType == DType::kF32) {
    static_cast<float*>(out)[i] = v;
  } else if constexpr (kType == DType::kBF16) {
    // Round to nearest even; v is finite, so F32ToBf16's NaN branch is not needed here.
    uint32_t u;
    std::memcpy(&u, &v, 4);
    static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  } else {
    static_cast<uint16_t*>(out)[i] = kernels::F32ToF16(v);
  }
}

// Elements [begin, end): 24 random bits each from a hash of (key, i). Indices wrap at 2^32,
// beyond any tensor a preset has.
template <DType kType>
void FillUniformRange(uint64_t key, float scale, float offset, int64_t begin, int64_t end,
                      void* out) {
  const uint32_t k1 = static_cast<uint32_t>(key), k2 = static_cast<uint32_t>(key >> 32);
  for (int64_t i = begin; i < end; ++i) {
    uint32_t h = Fmix32(Fmix32(static_cast<uint32_t>(i) * 0x9e3779b9u + k1) ^ k2);
    Store<kType>(out, i, static_cast<float>(h >> 8) * scale - offset);
  }
}

// Fills `out` (n elements of `dtype`) with uniform values of standard deviation `std`, element i
// a pure function of (key, i): the result is independent of threading and of sharding. Plain
// threads rather than OpenMP: spinning OpenMP workers lose badly on a busy 2-core machine.
void FillUniform(uint64_t key, double std, DType dtype, int64_t n, void* out) {
  const float half_width = static_cast<float>(std * std::sqrt(3.0));
  const float scale = 2.0f * half_width / 16777216.0f;
  auto fill = [&](int64_t begin, int64_t end) {
    switch (dtype) {
      case DType::kF32:
        FillUniformRange<DType::kF32>(key, scale, half_width, begin, end, out);
        break;
      case DType::kBF16:
        FillUniformRange<DType::kBF16>(key, scale, half_width, begin, end, out);
        break;
      case DType::kF16:
        FillUniformRange<DType::kF16>(key, scale, half_width, begin, end, out);
        break;
    }
  };
  const int64_t threads =
      n < (int64_t{1} << 20) ? 1 : std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 8);
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = std::min(n, t * per), end = std::min(n, (t + 1) * per);
    if (begin < end) workers.emplace_back(fill, begin, end);
  }
  fill(0, std::min(n, per));
  for (auto& w : workers) w.join();
}

void FillOnes(DType dtype, int64_t n, void* out) {
  for (int64_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::kF32:
        static_cast<float*>(out)[i] = 1.0f;
        break;
      case DType::kBF16:
        static_cast<uint16_t*>(out)[i] = kernels::F32ToBf16(1.0f);
        break;
      case DType::kF16:
        static_cast<uint16_t*>(out)[i] = kernels::F32ToF16(1.0f);
        break;
    }
  }
}

// fp8 KV scales, in [0.008, 0.032): K and V of these models are O(1), so divided by a scale
// they land in e4m3's upper range, where calibrated scales (amax / 448) put them.
void FillKvScales(uint64_t key, DType dtype, int64_t n, void* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = Fmix32(static_cast<uint32_t>(i) * 0x9e3779b9u + static_cast<uint32_t>(key));
    const float v = 0.008f * (1.f + 3.f * static_cast<float>(h >> 8) / 16777216.f);
    switch (dtype) {
      case DType::kF32: Store<DType::kF32>(out, i, v); break;
      case DType::kBF16: Store<DType::kBF16>(out, i, v); break;
      case DType::kF16: Store<DType::kF16>(out, i, v); break;
    }
  }
}

absl::Status WriteShard(const std::string& path, const std::vector<const ExpectedTensor*>& tensors,
                        DType dtype, uint64_t seed, std::vector<uint8_t>* buffer,
                        const std::function<void(int64_t)>& wrote) {
  std::vector<TensorSpec> specs;
  std::map<std::string_view, const ExpectedTensor*> by_name;
  for (const ExpectedTensor* t : tensors) {
    specs.push_back(TensorSpec{t->name, dtype, t->shape});
    by_name[t->name] = t;
  }
  PREFT_ASSIGN_OR_RETURN(auto writer,
                         SafetensorsWriter::Create(path, std::move(specs), {{"format", "pt"}}));
  while (const TensorSpec* s = writer->next()) {
    const ExpectedTensor* t = by_name.at(s->name);
    const int64_t n = s->num_bytes() / static_cast<int64_t>(kernels::DTypeSize(dtype));
    if (buffer->size() < static_cast<size_t>(s->num_bytes())) buffer->resize(s->num_bytes());
    if (t->is_norm) {
      FillOnes(dtype, n, buffer->data());
    } else if (t->is_kv_scale) {
      FillKvScales(base::SplitMix64(seed ^ HashName(t->name)), dtype, n, buffer->data());
    } else {
      FillUniform(base::SplitMix64(seed ^ HashName(t->name)), InitStd(*t), dtype, n, buffer->data());
    }
    PREFT_RETURN_IF_ERROR(writer->Append(buffer->data(), static_cast<size_t>(s->num_bytes())));
    wrote(s->num_bytes());
  }
  return writer->Close();
}

}  // namespace

// Fan-in scaled, so activations stay O(1) through the layers, and a sharper LM head, so the
// next-token distribution is peaked as in a trained model: tests then compare models with
// clear argmax margins and logprobs far from uniform.
double InitStd(const ExpectedTensor& t) {
  if (t.is_bias) return 0.1;
  const double fan_in = static_cast<double>(t.shape.back());
  // Embeddings may be tied to the LM head; RMSNorm makes their input scale irrelevant.
  if (t.name == "lm_head.weight" || t.name == "model.embed_tokens.weight") {
    return 2.5 / std::sqrt(fan_in);
  }
  return 1.0 / std::sqrt(fan_in);
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const auto& [name, config] : Presets()) names.push_back(name);
  return names;
}

absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset) {
  auto presets = Presets();
  auto it = presets.find(preset);
  if (it == presets.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown model preset \"", preset, "\" (known: ", absl::StrJoin(PresetNames(), ", "), ")"));
  }
  return it->second;
}

absl::Status MakeModel(const MakeModelOptions& options) {
  PREFT_ASSIGN_OR_RETURN(ModelConfig config, PresetConfig(options.preset));
  if (options.out_dir.empty()) return absl::InvalidArgumentError("make-model: out_dir is empty");
  if (options.max_shard_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "make-model: max_shard_bytes must be positive, got ", options.max_shard_bytes));
  }
  const std::filesystem::path dir(options.out_dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(options.out_dir, ": cannot create directory: ", ec.message()));
  }

  text::SyntheticTokenizerOptions tok;
  tok.vocab_size = static_cast<int32_t>(config.vocab_size);
  tok.style = config.architecture == Architecture::kQwen2 ? "qwen2" : "llama3";
  tok.chat_template = text::BuiltinChatTemplate(
      config.architecture == Architecture::kMistral ? "mistral" : tok.style);
  int32_t bos = -1, eos = -1;
  PREFT_RETURN_IF_ERROR(text::WriteSyntheticTokenizer(options.out_dir, tok, &bos, &eos));
  config.bos_token_id = bos;
  config.eos_token_ids.clear();
  if (eos >= 0) config.eos_token_ids.push_back(eos);
  config.torch_dtype = options.dtype;

  PREFT_RETURN_IF_ERROR(base::WriteStringToFile((dir / "config.json").string(), config.ToJson()));
  nlohmann::json gen = {{"bos_token_id", bos >= 0 ? nlohmann::json(bos) : nlohmann::json(nullptr)},
                        {"eos_token_id", eos >= 0 ? nlohmann::json(eos) : nlohmann::json(nullptr)},
                        {"do_sample", false}};
  PREFT_RETURN_IF_ERROR(
      base::WriteStringToFile((dir / "generation_config.json").string(), gen.dump(2) + "\n"));

  // Greedy packing in module order, as transformers' save_pretrained does.
  std::vector<ExpectedTensor> tensors = ExpectedTensors(config);
  if (options.kv_scales) {
    for (int64_t i = 0; i < config.num_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".self_attn.");
      tensors.push_back({p + "k_scale", {}, false, false, /*is_kv_scale=*/true});
      tensors.push_back({p + "v_scale", {config.num_kv_heads}, false, false, true});
    }
  }
  std::vector<std::vector<const ExpectedTensor*>> shards(1);
  int64_t shard_bytes = 0, total_bytes = 0;
  for (const ExpectedTensor& t : tensors) {
    int64_t bytes = TensorSpec{t.name, options.dtype, t.shape}.num_bytes();
    if (!shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&t);
    shard_bytes += bytes;
    total_bytes += bytes;
  }

  // Stale files from an earlier run with another shard count would confuse Checkpoint::Open.
  std::vector<std::filesystem::path> stale;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "model.safetensors" || name == "model.safetensors.index.json" ||
        (name.rfind("model-", 0) == 0 && entry.path().extension() == ".safetensors")) {
      stale.push_back(entry.path());
    }
  }
  for (const auto& p : stale) std::filesystem::remove(p, ec);

  std::vector<uint8_t> buffer;
  int64_t written = 0;
  auto wrote = [&](int64_t bytes) {
    written += bytes;
    if (options.progress) options.progress(written, total_bytes);
  };
  if (shards.size() == 1) {
    return WriteShard((dir / "model.safetensors").string(), shards[0], options.dtype, options.seed,
                      &buffer, wrote);
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file =
        absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
    PREFT_RETURN_IF_ERROR(
        WriteShard((dir / file).string(), shards[i], options.dtype, options.seed, &buffer, wrote));
    for (const ExpectedTensor* t : shards[i]) weight_map[t->name] = file;
  }
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  return base::WriteStringToFile((dir / "model.safetensors.index.json").string(),
                                 index.dump(2) + "\n");
}

}  // namespace preft::model
