#include "common/adapters/loader_util.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace preft::adapters::internal {

absl::Status ConfigReader::Invalid(absl::string_view what) const {
  return absl::InvalidArgumentError(absl::StrCat(path_, ": ", what));
}

absl::Status ConfigReader::Unimplemented(absl::string_view what) const {
  return absl::UnimplementedError(absl::StrCat(path_, ": ", what));
}

bool ConfigReader::Has(const char* key) const {
  auto it = j_.find(key);
  return it != j_.end() && !it->is_null();
}

absl::StatusOr<int64_t> ConfigReader::Int(const char* key) const {
  if (!Has(key)) return Invalid(absl::StrCat("missing required field \"", key, "\""));
  int64_t v = 0;
  if (!SmallInt(j_.at(key), &v)) {
    return Invalid(absl::StrCat("\"", key, "\" must be an integer, got ", Show(j_.at(key))));
  }
  return v;
}

absl::StatusOr<double> ConfigReader::Number(const char* key, double fallback) const {
  if (!Has(key)) return fallback;
  const Json& v = j_.at(key);
  if (!v.is_number() || !std::isfinite(v.get<double>())) {
    return Invalid(absl::StrCat("\"", key, "\" must be a finite number, got ", Show(v)));
  }
  return v.get<double>();
}

absl::StatusOr<bool> ConfigReader::Bool(const char* key, bool fallback) const {
  if (!Has(key)) return fallback;
  const Json& v = j_.at(key);
  if (!v.is_boolean()) {
    return Invalid(absl::StrCat("\"", key, "\" must be true or false, got ", Show(v)));
  }
  return v.get<bool>();
}

absl::StatusOr<std::string> ConfigReader::String(const char* key,
                                                 const std::string& fallback) const {
  if (!Has(key)) return fallback;
  const Json& v = j_.at(key);
  if (!v.is_string()) return Invalid(absl::StrCat("\"", key, "\" must be a string, got ", Show(v)));
  return v.get<std::string>();
}

std::string ConfigReader::Show(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

const char* BlockName(model::Projection p) {
  return static_cast<int>(p) <= static_cast<int>(model::Projection::kO) ? "self_attn" : "mlp";
}

std::string ModuleName(int64_t layer, model::Projection p) {
  return absl::StrCat("model.layers.", layer, ".", BlockName(p), ".", model::ProjectionName(p));
}

ProjectionDims DimsOf(const model::ModelConfig& c, model::Projection p) {
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  switch (p) {
    case model::Projection::kQ:
      return {c.hidden_size, q};
    case model::Projection::kK:
    case model::Projection::kV:
      return {c.hidden_size, kv};
    case model::Projection::kO:
      return {q, c.hidden_size};
    case model::Projection::kGate:
    case model::Projection::kUp:
      return {c.hidden_size, c.intermediate_size};
    case model::Projection::kDown:
      return {c.intermediate_size, c.hidden_size};
  }
  return {};
}

bool SmallInt(const Json& v, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  const int64_t s = v.get<int64_t>();
  if (s < std::numeric_limits<int32_t>::min() || s > std::numeric_limits<int32_t>::max()) {
    return false;
  }
  *out = s;
  return true;
}

absl::StatusOr<model::AdapterPositions> ReadPositions(const ConfigReader& r) {
  if (!r.Has("preft_positions")) return model::AdapterPositions::kAll;
  const Json& v = r.json().at("preft_positions");
  model::AdapterPositions p;
  if (!v.is_string() || !model::ParseAdapterPositions(v.get<std::string>(), &p)) {
    return r.Invalid(absl::StrCat("\"preft_positions\" must be \"prompt\" or \"all\", got ",
                                  ConfigReader::Show(v)));
  }
  return p;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status ExpectShape(const model::TensorInfo& t, const std::vector<int64_t>& expected,
                         absl::string_view why) {
  if (t.shape == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor '", t.name, "' has shape ",
                                                 ShapeString(t.shape), ", expected ",
                                                 ShapeString(expected), " (", why, ")"));
}

namespace {

absl::Status NonFinite(const model::TensorInfo& t, int64_t i, float v) {
  std::string where = absl::StrCat(i);
  if (t.shape.size() == 2 && t.shape[1] > 0) {
    where = absl::StrCat(i / t.shape[1], ", ", i % t.shape[1]);
  }
  return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor '", t.name, "' holds ",
                                                 std::isnan(v) ? "NaN" : "Inf", " at element [",
                                                 where, "]"));
}

}  // namespace

absl::StatusOr<kernels::MatrixView> CopyMatrix(const model::TensorInfo& t, bool transpose,
                                               kernels::DType dtype, model::AdapterWeights* dst) {
  if (t.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        t.file, ": tensor '", t.name, "' must be 2-D, has shape ", ShapeString(t.shape)));
  }
  const int64_t rows = t.shape[0], cols = t.shape[1];
  kernels::MatrixView out =
      dst->AllocateMatrix(dtype, transpose ? cols : rows, transpose ? rows : cols);
  void* data = const_cast<void*>(out.data);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t src = i * cols + j;
      const float v = kernels::LoadAsF32(t.data, t.dtype, src);
      if (!std::isfinite(v)) return NonFinite(t, src, v);
      const int64_t o = transpose ? j * rows + i : src;
      kernels::StoreFromF32(data, dtype, o, v);
      if (dtype == kernels::DType::kF16 && !std::isfinite(kernels::LoadAsF32(data, dtype, o))) {
        return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor '", t.name, "' value ", v,
                                                       " at element [", i, ", ", j,
                                                       "] overflows f16"));
      }
    }
  }
  return out;
}

absl::StatusOr<const float*> CopyVector(const model::TensorInfo& t, model::AdapterWeights* dst) {
  const int64_t n = t.num_elements();
  float* out = dst->AllocateFloats(n);
  for (int64_t i = 0; i < n; ++i) {
    const float v = kernels::LoadAsF32(t.data, t.dtype, i);
    if (!std::isfinite(v)) return NonFinite(t, i, v);
    out[i] = v;
  }
  return out;
}

}  // namespace preft::adapters::internal
