// PEFT LoRA folders (PEFT 0.12 semantics): which modules are adapted, their rank and alpha,
// and the lora_A / lora_B tensors, validated against the base model's projection shapes.

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/adapters/loader_util.h"
#include "common/base/status_macros.h"

namespace preft::adapters::internal {
namespace {

using model::Projection;

// A compiled PCRE2 pattern (close to Python's `re` for the patterns PEFT configs use).
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern,
                                                        const ConfigReader& r,
                                                        absl::string_view field) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      if (pcre2_get_error_message(error, message, sizeof(message)) < 0) message[0] = 0;
      return r.Invalid(absl::StrCat(field, ": regex \"", pattern, "\" does not compile at offset ",
                                    offset, ": ", reinterpret_cast<const char*>(message)));
    }
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() {
    pcre2_match_data_free(match_data_);
    pcre2_code_free(code_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Python's re.fullmatch(pattern, s) when `full`, else re.match(pattern, s).
  bool Match(absl::string_view s, bool full) const {
    const uint32_t options = PCRE2_ANCHORED | (full ? PCRE2_ENDANCHORED : 0);
    return pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, options,
                       match_data_, nullptr) >= 0;
  }

 private:
  explicit Regex(pcre2_code* code)
      : code_(code), match_data_(pcre2_match_data_create_from_pattern(code, nullptr)) {}

  pcre2_code* code_;
  pcre2_match_data* match_data_;
};

// target_modules / exclude_modules: a list of names (a module matches a name it equals or ends
// with after a dot) or a string, a regex the whole module name must match.
struct ModuleSelector {
  bool present = false;
  std::vector<std::string> names;
  std::unique_ptr<Regex> regex;

  bool Selects(const std::string& module) const {
    if (regex != nullptr) return regex->Match(module, /*full=*/true);
    for (const std::string& n : names) {
      if (module == n || absl::EndsWith(module, absl::StrCat(".", n))) return true;
    }
    return false;
  }
};

absl::StatusOr<ModuleSelector> ReadSelector(const ConfigReader& r, const char* key) {
  ModuleSelector s;
  if (!r.Has(key)) return s;
  s.present = true;
  const Json& v = r.json().at(key);
  if (v.is_string()) {
    const std::string pattern = v.get<std::string>();
    if (pattern == "all-linear") {  // PEFT's shorthand: every linear layer but the LM head
      for (Projection p : kProjections) s.names.push_back(model::ProjectionName(p));
      return s;
    }
    PREFT_ASSIGN_OR_RETURN(s.regex, Regex::Compile(pattern, r, key));
    return s;
  }
  if (!v.is_array()) {
    return r.Invalid(absl::StrCat("\"", key,
                                  "\" must be a list of module names or a regex string, got ",
                                  ConfigReader::Show(v)));
  }
  for (const Json& e : v) {
    if (!e.is_string()) {
      return r.Invalid(
          absl::StrCat("\"", key, "\" entries must be strings, got ", ConfigReader::Show(e)));
    }
    s.names.push_back(e.get<std::string>());
  }
  return s;
}

bool IsEmbeddingOrHead(absl::string_view name) {
  return absl::StrContains(name, "embed_tokens") || absl::StrContains(name, "lm_head");
}

absl::Status RefuseEmbedding(const ConfigReader& r, absl::string_view what) {
  return r.Unimplemented(
      absl::StrCat(what,
                   ": LoRA on embed_tokens / lm_head (embedding or LM-head LoRA) is not supported; "
                   "preft adapts q/k/v/o/gate/up/down_proj"));
}

// Every target_modules entry must name one of the model's projections: anything else is a
// module preft has no LoRA kernel for.
absl::Status CheckTargets(const ConfigReader& r, const ModuleSelector& targets,
                          const std::vector<std::string>& modules) {
  if (!targets.present) return absl::OkStatus();
  if (targets.regex != nullptr) {
    for (const char* other : {"lm_head", "model.embed_tokens"}) {
      if (targets.regex->Match(other, true)) {
        return RefuseEmbedding(r, absl::StrCat("target_modules matches \"", other, "\""));
      }
    }
    for (const std::string& m : modules) {
      if (targets.Selects(m)) return absl::OkStatus();
    }
    return r.Invalid("the target_modules regex matches none of the model's projections");
  }
  for (const std::string& n : targets.names) {
    bool known = false;
    for (const std::string& m : modules) {
      if (m == n || absl::EndsWith(m, absl::StrCat(".", n))) {
        known = true;
        break;
      }
    }
    if (known) continue;
    if (IsEmbeddingOrHead(n)) return RefuseEmbedding(r, absl::StrCat("target_modules \"", n, "\""));
    return r.Unimplemented(absl::StrCat(
        "target_modules names unknown module \"", n,
        "\" (preft adapts q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"));
  }
  return absl::OkStatus();
}

// rank_pattern / alpha_pattern, resolved as PEFT 0.12 does: the first key k of
// list(rank_pattern) + list(alpha_pattern) with re.match(rf".*\.{k}$", module) picks
// r = rank_pattern.get(k, r) and alpha = alpha_pattern.get(k, alpha); with no such key the
// module's full name is looked up instead.
struct Patterns {
  struct Entry {
    std::string key;
    std::unique_ptr<Regex> regex;
  };
  std::vector<Entry> keys;
  std::map<std::string, int64_t> rank;
  std::map<std::string, double> alpha;
  int64_t default_rank = 0;
  double default_alpha = 0;

  std::pair<int64_t, double> Resolve(const std::string& module) const {
    std::string key = module;
    for (const Entry& e : keys) {
      if (e.regex->Match(module, /*full=*/false)) {
        key = e.key;
        break;
      }
    }
    auto r = rank.find(key);
    auto a = alpha.find(key);
    return {r != rank.end() ? r->second : default_rank,
            a != alpha.end() ? a->second : default_alpha};
  }
};

absl::Status ReadPatterns(const ConfigReader& r, Patterns* out) {
  for (const char* field : {"rank_pattern", "alpha_pattern"}) {
    if (!r.Has(field)) continue;
    const Json& obj = r.json().at(field);
    if (!obj.is_object()) {
      return r.Invalid(
          absl::StrCat("\"", field, "\" must be an object, got ", ConfigReader::Show(obj)));
    }
    const bool is_rank = absl::string_view(field) == "rank_pattern";
    for (const auto& [key, v] : obj.items()) {
      if (is_rank) {
        int64_t rank = 0;
        if (!SmallInt(v, &rank) || rank < 1) {
          return r.Invalid(absl::StrCat("rank_pattern[\"", key, "\"] must be a rank >= 1, got ",
                                        ConfigReader::Show(v)));
        }
        out->rank[key] = rank;
      } else {
        if (!v.is_number() || !std::isfinite(v.get<double>())) {
          return r.Invalid(absl::StrCat("alpha_pattern[\"", key, "\"] must be a number, got ",
                                        ConfigReader::Show(v)));
        }
        out->alpha[key] = v.get<double>();
      }
      Patterns::Entry e{key, nullptr};
      PREFT_ASSIGN_OR_RETURN(
          e.regex, Regex::Compile(absl::StrCat(".*\\.", key, "$"), r, absl::StrCat(field, " key")));
      out->keys.push_back(std::move(e));
    }
  }
  return absl::OkStatus();
}

// layers_to_transform: an int or a list of ints (null or empty: every layer).
absl::StatusOr<std::optional<std::set<int64_t>>> ReadLayersToTransform(
    const ConfigReader& r, const model::ModelConfig& base) {
  if (!r.Has("layers_to_transform")) return std::nullopt;
  const Json& v = r.json().at("layers_to_transform");
  std::set<int64_t> layers;
  int64_t layer = 0;
  if (SmallInt(v, &layer)) {
    layers.insert(layer);
  } else if (v.is_array()) {
    if (v.empty()) return std::nullopt;
    for (const Json& e : v) {
      if (!SmallInt(e, &layer)) {
        return r.Invalid(absl::StrCat("\"layers_to_transform\" entries must be integers, got ",
                                      ConfigReader::Show(e)));
      }
      layers.insert(layer);
    }
  } else {
    return r.Invalid(absl::StrCat("\"layers_to_transform\" must be an integer or a list, got ",
                                  ConfigReader::Show(v)));
  }
  for (int64_t l : layers) {
    if (l < 0 || l >= base.num_layers) {
      return r.Invalid(absl::StrCat("\"layers_to_transform\" names layer ", l,
                                    ", out of range: the base model has ", base.num_layers,
                                    " layers"));
    }
  }
  if (r.Has("layers_pattern")) {
    const Json& p = r.json().at("layers_pattern");
    const bool ok = (p.is_string() && (p == "layers" || p == "")) ||
                    (p.is_array() && (p.empty() || (p.size() == 1 && p.at(0) == "layers")));
    if (!ok) {
      return r.Invalid(absl::StrCat("\"layers_pattern\" ", ConfigReader::Show(p),
                                    " does not name the model's layer list (\"layers\")"));
    }
  }
  return layers;
}

// Features of LoraConfig that change the maths or the files beyond what preft serves.
absl::Status RefuseUnsupported(const ConfigReader& r) {
  PREFT_ASSIGN_OR_RETURN(bool dora, r.Bool("use_dora", false));
  if (dora) return r.Unimplemented("\"use_dora\": true (DoRA) is not supported");
  PREFT_ASSIGN_OR_RETURN(std::string bias, r.String("bias", "none"));
  if (bias != "none") {
    return r.Unimplemented(absl::StrCat("\"bias\": \"", bias,
                                        "\" is not supported (only \"none\": bias training "
                                        "changes the base model's biases)"));
  }
  PREFT_ASSIGN_OR_RETURN(bool lora_bias, r.Bool("lora_bias", false));
  if (lora_bias) return r.Unimplemented("\"lora_bias\": true (a bias on lora_B) is not supported");
  if (r.Has("modules_to_save")) {
    const Json& m = r.json().at("modules_to_save");
    if (!m.is_array()) {
      return r.Invalid(
          absl::StrCat("\"modules_to_save\" must be a list or null, got ", ConfigReader::Show(m)));
    }
    if (!m.empty()) {
      return r.Unimplemented(
          absl::StrCat("\"modules_to_save\" ", ConfigReader::Show(m),
                       " is not supported (fully trained copies of base modules are not served)"));
    }
  }
  if (r.Has("layer_replication")) {
    return r.Unimplemented("\"layer_replication\" is not supported");
  }
  if (r.Has("prompt_positions")) {
    PREFT_ASSIGN_OR_RETURN(std::string pp, r.String("prompt_positions", "all"));
    if (pp != "all") {
      return r.Unimplemented(absl::StrCat("\"prompt_positions\": \"", pp,
                                          "\" applies to DiReFT only; a LoRA adapter runs on "
                                          "all prompt tokens"));
    }
  }
  // fan_in_fan_out describes the base layer (GPT-2's Conv1D). PEFT resets it to false for
  // nn.Linear bases like these, and lora_A / lora_B are nn.Linear either way: the stored
  // shapes do not depend on it.
  PREFT_RETURN_IF_ERROR(r.Bool("fan_in_fan_out", false).status());
  return absl::OkStatus();
}

// A tensor name parsed as "[base_model.model.][model.]layers.{i}.{block}.{module}.lora_{A|B}
// [.{adapter_name}].weight".
struct LoraKey {
  int64_t layer = 0;
  Projection projection = Projection::kQ;
  bool is_a = false;
};

absl::StatusOr<LoraKey> ParseKey(const model::TensorInfo& t, const model::ModelConfig& base) {
  const std::string& name = t.name;
  auto unimplemented = [&](absl::string_view what) {
    return absl::UnimplementedError(absl::StrCat(t.file, ": tensor '", name, "': ", what));
  };
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor '", name, "': ", what));
  };
  if (absl::StrContains(name, "lora_magnitude_vector")) {
    return unimplemented("DoRA (lora_magnitude_vector) is not supported");
  }
  if (absl::StrContains(name, "lora_embedding_")) {
    return unimplemented("embedding LoRA (lora_embedding_A/B) is not supported");
  }
  if (absl::StrContains(name, "modules_to_save") || absl::StrContains(name, "original_module")) {
    return unimplemented("modules_to_save (a fully trained module copy) is not supported");
  }
  absl::string_view key = name;
  if (absl::StartsWith(key, "base_model.model.")) key.remove_prefix(17);
  const std::vector<std::string> parts = absl::StrSplit(key, '.');
  if (parts.back() == "bias") {
    return unimplemented(
        "bias tensors (\"bias\" other than \"none\", or lora_bias) are not supported");
  }
  const size_t i = parts[0] == "model" ? 1 : 0;
  const size_t n = parts.size() - i;  // layers, idx, block, module, lora_X, [adapter], weight
  if (n < 6 || parts[i] != "layers") {
    if (IsEmbeddingOrHead(key)) {
      return unimplemented("LoRA on embed_tokens / lm_head is not supported");
    }
    return invalid(
        "not a LoRA tensor of this format (expected base_model.model.model.layers.{i}."
        "{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A|B}.weight)");
  }
  const std::string& index = parts[i + 1];
  const std::string& block = parts[i + 2];
  const std::string& module = parts[i + 3];
  const std::string& lora = parts[i + 4];
  if ((lora != "lora_A" && lora != "lora_B") || parts.back() != "weight" || n > 7) {
    return invalid("not a LoRA tensor of this format (expected ...{module}.lora_{A|B}.weight)");
  }
  if (index.empty() || index.size() > 9 ||
      index.find_first_not_of("0123456789") != std::string::npos) {
    return invalid(absl::StrCat("bad layer index \"", index, "\""));
  }
  LoraKey k;
  k.layer = std::stoll(index);
  k.is_a = lora == "lora_A";
  bool found = false;
  for (Projection p : kProjections) {
    if (module == model::ProjectionName(p) && block == BlockName(p)) {
      k.projection = p;
      found = true;
    }
  }
  if (!found) {
    return unimplemented(
        absl::StrCat("unknown module \"", block, ".", module,
                     "\" (preft adapts self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj)"));
  }
  if (k.layer >= base.num_layers) {
    return invalid(absl::StrCat("layer ", k.layer, " is out of range: the base model has ",
                                base.num_layers, " layers"));
  }
  return k;
}

}  // namespace

absl::StatusOr<std::unique_ptr<model::AdapterWeights>> LoadLora(
    const ConfigReader& r, const model::SafetensorsFile& weights, const model::ModelConfig& base,
    const LoadOptions& options) {
  PREFT_RETURN_IF_ERROR(RefuseUnsupported(r));
  Patterns patterns;
  PREFT_ASSIGN_OR_RETURN(patterns.default_rank, r.Int("r"));
  if (patterns.default_rank < 1) {
    return r.Invalid(absl::StrCat("\"r\" must be >= 1, got ", patterns.default_rank));
  }
  PREFT_ASSIGN_OR_RETURN(patterns.default_alpha, r.Number("lora_alpha", 8.0));  // PEFT's default
  PREFT_ASSIGN_OR_RETURN(bool rslora, r.Bool("use_rslora", false));
  PREFT_RETURN_IF_ERROR(ReadPatterns(r, &patterns));
  PREFT_ASSIGN_OR_RETURN(ModuleSelector targets, ReadSelector(r, "target_modules"));
  PREFT_ASSIGN_OR_RETURN(ModuleSelector excluded, ReadSelector(r, "exclude_modules"));
  PREFT_ASSIGN_OR_RETURN(std::optional<std::set<int64_t>> layers, ReadLayersToTransform(r, base));
  PREFT_ASSIGN_OR_RETURN(model::AdapterPositions positions, ReadPositions(r));

  std::vector<std::string> modules;
  for (int64_t l = 0; l < base.num_layers; ++l) {
    for (Projection p : kProjections) modules.push_back(ModuleName(l, p));
  }
  PREFT_RETURN_IF_ERROR(CheckTargets(r, targets, modules));

  // (layer, projection) -> its lora_A and lora_B.
  std::map<std::pair<int64_t, int>, std::pair<const model::TensorInfo*, const model::TensorInfo*>>
      found;
  for (const auto& [name, t] : weights.tensors()) {
    PREFT_ASSIGN_OR_RETURN(LoraKey k, ParseKey(t, base));
    auto& slot = found[{k.layer, static_cast<int>(k.projection)}];
    const model::TensorInfo*& dst = k.is_a ? slot.first : slot.second;
    if (dst != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(weights.path(), ": tensors '", dst->name,
                                                     "' and '", name, "' are the same matrix"));
    }
    dst = &t;
  }

  auto adapter =
      std::make_unique<model::AdapterWeights>(model::AdapterKind::kLora, base.num_layers);
  ReserveStorageFor(weights, options.dtype, adapter.get());
  adapter->default_positions = positions;
  int64_t num_modules = 0;
  for (int64_t l = 0; l < base.num_layers; ++l) {
    for (Projection p : kProjections) {
      const std::string module = ModuleName(l, p);
      auto it = found.find({l, static_cast<int>(p)});
      // PEFT's check_target_module_exists: layers_to_transform narrows a list, not a regex.
      bool targeted = targets.Selects(module) && !(excluded.present && excluded.Selects(module));
      if (targeted && layers && targets.regex == nullptr &&
          std::find(targets.names.begin(), targets.names.end(), module) == targets.names.end()) {
        targeted = layers->count(l) > 0;
      }
      if (!targets.present) targeted = it != found.end();  // no list: the file says
      if (it == found.end()) {
        if (!targeted) continue;
        return absl::InvalidArgumentError(
            absl::StrCat(weights.path(), ": no lora_A / lora_B tensors for module ", module,
                         ", which adapter_config.json's target_modules selects"));
      }
      const auto [a, b] = it->second;
      if (!targeted) {
        return absl::InvalidArgumentError(absl::StrCat(
            weights.path(), ": tensor '", (a != nullptr ? a : b)->name, "' adapts module ", module,
            ", which adapter_config.json's target_modules does not select"));
      }
      if (a == nullptr || b == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(weights.path(), ": tensor '", (a != nullptr ? a : b)->name, "' has no ",
                         a != nullptr ? "lora_B" : "lora_A", " partner for module ", module));
      }
      const auto [rank, alpha] = patterns.Resolve(module);
      if (rank > options.max_rank) {
        return r.Invalid(absl::StrCat("rank ", rank, " of module ", module,
                                      " exceeds the maximum rank ", options.max_rank));
      }
      const ProjectionDims dims = DimsOf(base, p);
      if (a->shape.size() != 2 || a->shape[1] != dims.in) {
        return ExpectShape(*a, {rank, dims.in},
                           absl::StrCat("lora_A is [r, in]; ", model::ProjectionName(p),
                                        " of the base model takes ", dims.in, " inputs"));
      }
      if (a->shape[0] != rank) {
        return absl::InvalidArgumentError(
            absl::StrCat(a->file, ": tensor '", a->name, "' has rank ", a->shape[0],
                         " but adapter_config.json gives module ", module, " r = ", rank,
                         patterns.rank.empty() ? "" : " (after rank_pattern)"));
      }
      PREFT_RETURN_IF_ERROR(
          ExpectShape(*b, {dims.out, rank},
                      absl::StrCat("lora_B is [out, r]; ", model::ProjectionName(p),
                                   " of the base model has ", dims.out, " outputs")));
      model::LowRank& lr = adapter->mutable_lora(l, p);
      const bool chunked = ChunkPair(options, rank, dims.in, dims.out);
      PREFT_ASSIGN_OR_RETURN(
          lr.shrink, CopyMatrix(*a, /*transpose=*/false, options.dtype, adapter.get(),
                                chunked ? CopyLayout::kChunked : CopyLayout::kRowMajor));
      PREFT_ASSIGN_OR_RETURN(
          lr.expand, CopyMatrix(*b, /*transpose=*/true, options.dtype, adapter.get(),
                                chunked ? CopyLayout::kChunkedPaired : CopyLayout::kRowMajor));
      lr.scale = static_cast<float>(rslora ? alpha / std::sqrt(static_cast<double>(rank))
                                           : alpha / static_cast<double>(rank));
      ++num_modules;
    }
  }
  if (num_modules == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(weights.path(), ": holds no LoRA tensors for this model"));
  }
  return adapter;
}

}  // namespace preft::adapters::internal
