#pragma once

// Element types of weights as stored in checkpoints, with scalar conversions.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace preft::kernels {

enum class DType : uint8_t { kF32, kF16, kBF16 };

inline size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

// Safetensors spelling: "F32", "F16", "BF16".
inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return "?";
}

inline bool ParseDType(std::string_view s, DType* out) {
  if (s == "F32") { *out = DType::kF32; return true; }
  if (s == "F16") { *out = DType::kF16; return true; }
  if (s == "BF16") { *out = DType::kBF16; return true; }
  return false;
}

inline float Bf16ToF32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN stays NaN.
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // Subnormal: normalise.
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ffu;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((u >> 23) & 0xffu) - 127 + 15;
  uint32_t man = u & 0x7fffffu;
  if (((u >> 23) & 0xffu) == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0));
  if (exp >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(half);
}

// Reads element i of a typed buffer as float. The buffer may be unaligned (safetensors data
// offsets need not be), so elements are copied out, not dereferenced.
inline float LoadAsF32(const void* data, DType t, size_t i) {
  const uint8_t* p = static_cast<const uint8_t*>(data) + i * DTypeSize(t);
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return t == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
}

// fp8 e4m3 "fn" (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, 0x7f/0xff
// NaN; largest finite 448), the KV element type of --kv-dtype fp8_e4m3. Rounds to nearest
// even and saturates to +-448 (CUDA's __nv_cvt_float_to_fp8 with __NV_SATFINITE); NaN stays NaN.
inline uint8_t F32ToFp8E4M3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7f;  // NaN
  if (u >= 0x43e00000u) return sign | 0x7e;  // >= 448 (infinity too): the largest finite
  if (u < 0x3c800000u) {                      // below 2^-6: a subnormal, m x 2^-9
    float a;
    std::memcpy(&a, &u, 4);
    // a * 512 is exact (a power of two); m = 8 is the smallest normal, 0x08, as it should.
    const float scaled = a * 512.f;
    uint32_t m = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1))) ++m;
    return sign | static_cast<uint8_t>(m);
  }
  const uint32_t rounded = u + 0x7ffffu + ((u >> 20) & 1);  // to nearest even at mantissa bit 20
  const uint32_t e = (rounded >> 23) - 127 + 7, m = (rounded >> 20) & 7;
  return sign | static_cast<uint8_t>((e << 3) | m);
}

inline float Fp8E4M3ToF32(uint8_t b) {
  const uint32_t e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7) {
    v = __builtin_nanf("");
  } else if (e == 0) {
    v = static_cast<float>(m) / 512.f;
  } else {
    v = static_cast<float>(8 + m) / 8.f * static_cast<float>(1u << e) / 128.f;
  }
  return (b & 0x80) ? -v : v;
}

// Writes v as element i of a typed buffer (bf16 and f16 rounded to nearest even).
inline void StoreFromF32(void* data, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(data)[i] = v; break;
    case DType::kF16: static_cast<uint16_t*>(data)[i] = F32ToF16(v); break;
    case DType::kBF16: static_cast<uint16_t*>(data)[i] = F32ToBf16(v); break;
  }
}

}  // namespace preft::kernels
