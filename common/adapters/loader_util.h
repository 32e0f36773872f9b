#pragma once

// Pieces the LoRA and DiReFT loaders (and the writer) share: typed access to adapter_config.json
// that turns every wrong type into InvalidArgument (nlohmann's throwing accessors are never reached
// with a wrong type), and tensor copies that validate values and convert the dtype. Internal to
// common/adapters.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/adapters/adapter_loader.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace preft::adapters::internal {

// Ordered: PEFT gives rank_pattern / alpha_pattern keys priority in file order.
using Json = nlohmann::ordered_json;

inline constexpr char kConfigFile[] = "adapter_config.json";
inline constexpr char kWeightsFile[] = "adapter_model.safetensors";

// Reads fields of one JSON object; errors start with the file's path.
class ConfigReader {
 public:
  ConfigReader(const Json& j, std::string path) : j_(j), path_(std::move(path)) {}

  const std::string& path() const { return path_; }
  const Json& json() const { return j_; }

  absl::Status Invalid(absl::string_view what) const;
  absl::Status Unimplemented(absl::string_view what) const;

  // Present and not null.
  bool Has(const char* key) const;
  // Required integer / optional number, bool, string; a wrong type is InvalidArgument.
  absl::StatusOr<int64_t> Int(const char* key) const;
  absl::StatusOr<double> Number(const char* key, double fallback) const;
  absl::StatusOr<bool> Bool(const char* key, bool fallback) const;
  absl::StatusOr<std::string> String(const char* key, const std::string& fallback) const;

  // A JSON value for messages, cut to 64 characters.
  static std::string Show(const Json& v);

 private:
  const Json& j_;
  std::string path_;
};

// The seven projections in Hugging Face module order.
inline constexpr model::Projection kProjections[] = {
    model::Projection::kQ,   model::Projection::kK,    model::Projection::kV,
    model::Projection::kO,   model::Projection::kGate, model::Projection::kUp,
    model::Projection::kDown};

// "self_attn" for q/k/v/o, "mlp" for gate/up/down.
const char* BlockName(model::Projection p);
// The module's name in the base model, as PEFT matches it: "model.layers.0.self_attn.q_proj".
std::string ModuleName(int64_t layer, model::Projection p);

using model::DimsOf;
using model::ProjectionDims;

// Integer value of `v` if it is a JSON integer within int32; false otherwise.
bool SmallInt(const Json& v, int64_t* out);

// "preft_positions": "prompt" | "all"; absent or null gives kAll.
absl::StatusOr<model::AdapterPositions> ReadPositions(const ConfigReader& r);

// Copies a 2-D tensor into `dst`'s storage in `dtype`, transposed when `transpose` (rows and
// columns swap). Fails with InvalidArgument naming the file and tensor on NaN/Inf, or on a
// value that overflows `dtype`.
// `layout`: row-major, or (only where ChunkPair says so) the CPU kernels' chunked layout of a
// shrink matrix or of an expand matrix (MatrixView::chunked, ::paired).
enum class CopyLayout { kRowMajor, kChunked, kChunkedPaired };
absl::StatusOr<kernels::MatrixView> CopyMatrix(const model::TensorInfo& t, bool transpose,
                                               kernels::DType dtype, model::AdapterWeights* dst,
                                               CopyLayout layout = CopyLayout::kRowMajor);
// Whether a low-rank pair of `rank` with these widths is stored chunked under `options`
// (LoadOptions::cpu_layout and kernels::cpu::LowRankChunkable for both matrices).
bool ChunkPair(const LoadOptions& options, int64_t rank, int64_t in, int64_t out);
// Reserves `dst`'s storage for every tensor of `weights`: 2-D ones in `dtype`, 1-D ones in f32
// (what CopyMatrix and CopyVector allocate), so the copies need no allocation of their own.
void ReserveStorageFor(const model::SafetensorsFile& weights, kernels::DType dtype,
                       model::AdapterWeights* dst);
// Copies a 1-D tensor as f32, with the same checks.
absl::StatusOr<const float*> CopyVector(const model::TensorInfo& t, model::AdapterWeights* dst);

// "[8, 64]"
std::string ShapeString(const std::vector<int64_t>& shape);
// InvalidArgument "<file>: tensor '<name>' has shape [..], expected [..] (<why>)" unless the
// shape matches.
absl::Status ExpectShape(const model::TensorInfo& t, const std::vector<int64_t>& expected,
                         absl::string_view why);

absl::StatusOr<std::unique_ptr<model::AdapterWeights>> LoadLora(
    const ConfigReader& config, const model::SafetensorsFile& weights,
    const model::ModelConfig& base, const LoadOptions& options);

absl::StatusOr<std::unique_ptr<model::AdapterWeights>> LoadDireft(
    const ConfigReader& config, const model::SafetensorsFile& weights,
    const model::ModelConfig& base, const LoadOptions& options);

}  // namespace preft::adapters::internal
