#include "common/adapters/loader_util.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/kernels/cpu/low_rank_layout.h"

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

// Whether none of n raw values (possibly unaligned) has an all-ones exponent (Inf or NaN),
// eight bytes at a time: masking and xor-ing the exponent turns such a lane into zero, which
// the has-zero-lane test ((x - 1) & ~x & high bit, per lane) finds.
template <class Bits>
bool AllFiniteBits(const void* data, int64_t n, Bits exponent) {
  constexpr int kBits = 8 * sizeof(Bits), kLanes = 64 / kBits;
  uint64_t e = 0, ones = 0, highs = 0;
  for (int l = 0; l < kLanes; ++l) {
    e |= uint64_t{exponent} << (l * kBits);
    ones |= uint64_t{1} << (l * kBits);
    highs |= uint64_t{1} << (l * kBits + kBits - 1);
  }
  const auto* bytes = static_cast<const uint8_t*>(data);
  const int64_t words = n / kLanes;
  uint64_t found = 0;
  for (int64_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes + i * 8, 8);
    const uint64_t x = (w & e) ^ e;
    found |= (x - ones) & ~x & highs;
  }
  for (int64_t i = words * kLanes; i < n; ++i) {
    Bits v;
    std::memcpy(&v, bytes + i * sizeof(Bits), sizeof(Bits));
    found |= (v & exponent) == exponent;
  }
  return found == 0;
}

bool AllFinite(const void* data, kernels::DType dtype, int64_t n) {
  switch (dtype) {
    case kernels::DType::kF32: return AllFiniteBits<uint32_t>(data, n, 0x7f800000u);
    case kernels::DType::kBF16: return AllFiniteBits<uint16_t>(data, n, 0x7f80);
    case kernels::DType::kF16: return AllFiniteBits<uint16_t>(data, n, 0x7c00);
  }
  return false;
}

// Where element (r, c) of a [rows, cols] matrix lives in `layout`.
int64_t At(int64_t r, int64_t c, int64_t rows, int64_t cols, CopyLayout layout) {
  return layout == CopyLayout::kRowMajor
             ? r * cols + c
             : kernels::ChunkedAt(r, c, rows, layout == CopyLayout::kChunkedPaired);
}

// dst [cols, rows] = src [rows, cols] transposed (in `layout`), elements of one dtype copied
// as bits. For 2-byte elements each store writes 8 or 16 bytes (a LoRA B [out, r] is most of
// an adapter's bytes: one element per store took ~15% of a load): four consecutive outputs
// (src rows), which sit together in a 32-wide chunk, and in the paired layout two rank rows.
template <class Bits>
void TransposeBits(const void* src, int64_t rows, int64_t cols, CopyLayout layout, void* dst) {
  const auto* in = static_cast<const uint8_t*>(src);
  auto* out = static_cast<Bits*>(dst);
  auto element = [&](int64_t i, int64_t j) {
    Bits v;
    std::memcpy(&v, in + (i * cols + j) * sizeof(Bits), sizeof(Bits));
    return v;
  };
  int64_t i = 0;
  if constexpr (sizeof(Bits) == 2) {
    if (layout == CopyLayout::kChunkedPaired) {  // rows % 32 == 0, cols % 4 == 0 (chunkable)
      for (; i + 4 <= rows; i += 4) {
        for (int64_t j = 0; j < cols; j += 2) {
          Bits v[8];
          for (int q = 0; q < 4; ++q) {
            v[2 * q] = element(i + q, j);
            v[2 * q + 1] = element(i + q, j + 1);
          }
          std::memcpy(&out[At(j, i, cols, rows, layout)], v, sizeof(v));
        }
      }
    } else {
      for (; i + 4 <= rows; i += 4) {
        for (int64_t j = 0; j < cols; ++j) {
          const uint64_t packed = uint64_t{element(i, j)} | uint64_t{element(i + 1, j)} << 16 |
                                  uint64_t{element(i + 2, j)} << 32 |
                                  uint64_t{element(i + 3, j)} << 48;
          std::memcpy(&out[At(j, i, cols, rows, layout)], &packed, 8);
        }
      }
    }
  }
  for (; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) out[At(j, i, cols, rows, layout)] = element(i, j);
  }
}

}  // namespace

absl::StatusOr<kernels::MatrixView> CopyMatrix(const model::TensorInfo& t, bool transpose,
                                               kernels::DType dtype, model::AdapterWeights* dst,
                                               CopyLayout layout) {
  if (t.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        t.file, ": tensor '", t.name, "' must be 2-D, has shape ", ShapeString(t.shape)));
  }
  const int64_t rows = t.shape[0], cols = t.shape[1];
  const int64_t out_rows = transpose ? cols : rows, out_cols = transpose ? rows : cols;
  kernels::MatrixView out = dst->AllocateMatrix(dtype, out_rows, out_cols);
  out.chunked = layout != CopyLayout::kRowMajor;
  out.paired = layout == CopyLayout::kChunkedPaired;
  void* data = const_cast<void*>(out.data);
  // The file already holds the dtype wanted (a bf16 adapter for a bf16 model): copy the bits.
  // Otherwise, or when a value is not finite, the element loop converts and names the element.
  if (t.dtype == dtype && AllFinite(t.data, dtype, rows * cols)) {
    if (!transpose && !out.chunked) {
      std::memcpy(data, t.data, rows * cols * kernels::DTypeSize(dtype));
    } else if (!transpose) {  // chunked is bf16 only (kernels::cpu::LowRankChunkable)
      kernels::cpu::ChunkColumns(static_cast<const uint16_t*>(t.data), rows, cols, out.paired,
                                 static_cast<uint16_t*>(data));
    } else if (kernels::DTypeSize(dtype) == 2) {
      TransposeBits<uint16_t>(t.data, rows, cols, layout, data);
    } else {
      TransposeBits<uint32_t>(t.data, rows, cols, layout, data);
    }
    return out;
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t src = i * cols + j;
      const float v = kernels::LoadAsF32(t.data, t.dtype, src);
      if (!std::isfinite(v)) return NonFinite(t, src, v);
      const int64_t o = transpose ? At(j, i, out_rows, out_cols, layout)
                                  : At(i, j, out_rows, out_cols, layout);
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

bool ChunkPair(const LoadOptions& options, int64_t rank, int64_t in, int64_t out) {
  return options.cpu_layout &&
         kernels::cpu::LowRankChunkable(kernels::MatrixView{nullptr, options.dtype, rank, in}) &&
         kernels::cpu::LowRankChunkable(kernels::MatrixView{nullptr, options.dtype, rank, out});
}

void ReserveStorageFor(const model::SafetensorsFile& weights, kernels::DType dtype,
                       model::AdapterWeights* dst) {
  size_t bytes = 0;
  for (const auto& [name, t] : weights.tensors()) {
    const size_t esize = t.shape.size() == 1 ? sizeof(float) : kernels::DTypeSize(dtype);
    bytes += model::AdapterWeights::StoragePiece(static_cast<size_t>(t.num_elements()) * esize);
  }
  dst->ReserveStorage(bytes);
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
