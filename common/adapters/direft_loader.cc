// DiReFT folders (pyreft's NoDiReFT on block_output): per intervened layer
// h' = h + act(h W1^T + b1) W2 with identity act, stored as
// layers.{i}.direft.learned_source.{weight,bias} (W1 [r, d], b1 [r]) and
// layers.{i}.direft.proj_layer.weight (W2 [r, d]).

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/adapters/loader_util.h"
#include "common/base/status_macros.h"

namespace preft::adapters::internal {
namespace {

constexpr char kW1[] = "learned_source.weight";
constexpr char kB1[] = "learned_source.bias";
constexpr char kW2[] = "proj_layer.weight";

std::string TensorName(int64_t layer, const char* suffix) {
  return absl::StrCat("layers.", layer, ".direft.", suffix);
}

// "layers": a list of layer indices or "all".
absl::StatusOr<std::set<int64_t>> ReadLayers(const ConfigReader& r,
                                             const model::ModelConfig& base) {
  if (!r.Has("layers")) return r.Invalid("missing required field \"layers\" (a list or \"all\")");
  const Json& v = r.json().at("layers");
  std::set<int64_t> layers;
  if (v.is_string() && v.get<std::string>() == "all") {
    for (int64_t l = 0; l < base.num_layers; ++l) layers.insert(l);
    return layers;
  }
  if (!v.is_array()) {
    return r.Invalid(absl::StrCat("\"layers\" must be a list of layer indices or \"all\", got ",
                                  ConfigReader::Show(v)));
  }
  for (const Json& e : v) {
    int64_t l = 0;
    if (!SmallInt(e, &l)) {
      return r.Invalid(
          absl::StrCat("\"layers\" entries must be integers, got ", ConfigReader::Show(e)));
    }
    if (l < 0 || l >= base.num_layers) {
      return r.Invalid(absl::StrCat("\"layers\" names layer ", l,
                                    ", out of range: the base model has ", base.num_layers,
                                    " layers"));
    }
    if (!layers.insert(l).second) {
      return r.Invalid(absl::StrCat("\"layers\" lists layer ", l, " twice"));
    }
  }
  if (layers.empty()) return r.Invalid("\"layers\" is empty: the adapter would do nothing");
  return layers;
}

absl::Status ReadComponent(const ConfigReader& r) {
  PREFT_ASSIGN_OR_RETURN(std::string component, r.String("component", "block_output"));
  if (component != "block_output") {
    return r.Unimplemented(absl::StrCat("\"component\": \"", component,
                                        "\" is not supported (only \"block_output\", the decoder "
                                        "layer's output residual stream)"));
  }
  PREFT_ASSIGN_OR_RETURN(std::string act, r.String("act_fn", "linear"));
  if (act != "linear" && act != "identity") {
    return r.Unimplemented(absl::StrCat("\"act_fn\": \"", act,
                                        "\" is not supported (only \"linear\" / \"identity\")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<model::AdapterWeights>> LoadDireft(
    const ConfigReader& r, const model::SafetensorsFile& weights, const model::ModelConfig& base,
    const LoadOptions& options) {
  PREFT_ASSIGN_OR_RETURN(int64_t rank, r.Int("r"));
  if (rank < 1) return r.Invalid(absl::StrCat("\"r\" must be >= 1, got ", rank));
  if (rank > options.max_rank) {
    return r.Invalid(absl::StrCat("rank ", rank, " exceeds the maximum rank ", options.max_rank));
  }
  for (const char* key : {"hidden_size", "embed_dim"}) {
    if (!r.Has(key)) continue;
    PREFT_ASSIGN_OR_RETURN(int64_t d, r.Int(key));
    if (d != base.hidden_size) {
      return r.Invalid(absl::StrCat("\"", key, "\" is ", d, " but the base model's hidden_size is ",
                                    base.hidden_size, ": an adapter for another base model"));
    }
  }
  PREFT_RETURN_IF_ERROR(ReadComponent(r));
  PREFT_ASSIGN_OR_RETURN(std::set<int64_t> layers, ReadLayers(r, base));
  PREFT_ASSIGN_OR_RETURN(std::string positions_text, r.String("prompt_positions", "all"));
  model::PromptSelection selection;
  if (!model::PromptSelection::Parse(positions_text, &selection)) {
    return r.Invalid(absl::StrCat("\"prompt_positions\": \"", positions_text,
                                  "\" is not \"all\" or pyreft's \"fN+lM\" (e.g. \"f3+l3\")"));
  }
  PREFT_ASSIGN_OR_RETURN(model::AdapterPositions positions, ReadPositions(r));

  // Every tensor must belong to a listed layer: a stray one means the folder and its config
  // disagree.
  for (const auto& [name, t] : weights.tensors()) {
    const std::vector<std::string> parts = absl::StrSplit(name, absl::MaxSplits('.', 3));
    const std::string suffix = parts.size() == 4 ? parts[3] : "";
    int64_t layer = -1;
    if (parts.size() == 4 && parts[0] == "layers" && parts[2] == "direft" &&
        (suffix == kW1 || suffix == kB1 || suffix == kW2) && !parts[1].empty() &&
        parts[1].size() <= 9 && parts[1].find_first_not_of("0123456789") == std::string::npos) {
      layer = std::stoll(parts[1]);
    }
    if (layer < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          weights.path(), ": unexpected tensor '", name,
          "' (a DiReFT file holds layers.{i}.direft.{learned_source.weight, learned_source.bias, "
          "proj_layer.weight})"));
    }
    if (layer >= base.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(weights.path(), ": tensor '", name, "': layer ", layer,
                       " is out of range: the base model has ", base.num_layers, " layers"));
    }
    if (layers.count(layer) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(weights.path(), ": tensor '", name, "' is for layer ", layer,
                       ", which adapter_config.json's \"layers\" does not list"));
    }
  }

  const int64_t d = base.hidden_size;
  auto adapter =
      std::make_unique<model::AdapterWeights>(model::AdapterKind::kDireft, base.num_layers);
  ReserveStorageFor(weights, options.dtype, adapter.get());
  adapter->default_positions = positions;
  adapter->prompt_selection = selection;
  for (int64_t l : layers) {
    const model::TensorInfo* w[2] = {weights.Find(TensorName(l, kW1)),
                                     weights.Find(TensorName(l, kW2))};
    for (int i = 0; i < 2; ++i) {
      const std::string expected = TensorName(l, i == 0 ? kW1 : kW2);
      if (w[i] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(weights.path(), ": missing tensor '", expected, "' for layer ", l,
                         ", which adapter_config.json's \"layers\" lists"));
      }
      if (w[i]->shape.size() != 2 || w[i]->shape[1] != d) {
        PREFT_RETURN_IF_ERROR(
            ExpectShape(*w[i], {rank, d},
                        absl::StrCat("[r, hidden_size]; the base model's hidden_size is ", d)));
      }
      if (w[i]->shape[0] != rank) {
        return absl::InvalidArgumentError(absl::StrCat(w[i]->file, ": tensor '", w[i]->name,
                                                       "' has rank ", w[i]->shape[0],
                                                       " but adapter_config.json says r = ", rank));
      }
    }
    const model::TensorInfo* b = weights.Find(TensorName(l, kB1));
    if (b != nullptr) PREFT_RETURN_IF_ERROR(ExpectShape(*b, {rank}, "b1 is [r]"));

    model::LowRank& lr = adapter->mutable_direft(l);
    // Matrices before the bias: AdapterWeights takes its dtype from the first allocation.
    const bool chunked = ChunkPair(options, rank, d, d);
    PREFT_ASSIGN_OR_RETURN(
        lr.shrink, CopyMatrix(*w[0], false, options.dtype, adapter.get(),
                              chunked ? CopyLayout::kChunked : CopyLayout::kRowMajor));
    PREFT_ASSIGN_OR_RETURN(
        lr.expand, CopyMatrix(*w[1], false, options.dtype, adapter.get(),
                              chunked ? CopyLayout::kChunkedPaired : CopyLayout::kRowMajor));
    if (b != nullptr) {
      PREFT_ASSIGN_OR_RETURN(lr.shrink_bias, CopyVector(*b, adapter.get()));
    }
    lr.scale = 1.0f;
  }
  return adapter;
}

}  // namespace preft::adapters::internal
