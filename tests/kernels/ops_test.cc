#include "common/kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/kernels/cpu/attention.h"
#include "common/kernels/dtype.h"

namespace preft::kernels::cpu {
namespace {

std::vector<float> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// fp8 e4m3 (the --kv-dtype fp8_e4m3 element): every code round-trips; a value between two codes
// goes to the nearer, a tie to the even one; past 448 saturates; NaN stays NaN.
TEST(OpsTest, Fp8E4M3RoundTripsEveryCodeAndRoundsToNearestEven) {
  EXPECT_EQ(Fp8E4M3ToF32(0x7e), 448.f);
  EXPECT_EQ(Fp8E4M3ToF32(0x08), std::ldexp(1.f, -6));  // smallest normal
  EXPECT_EQ(Fp8E4M3ToF32(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToF32(0x38), 1.f);
  EXPECT_EQ(Fp8E4M3ToF32(0xb9), -1.125f);
  for (int b = 0; b < 256; ++b) {
    const uint8_t code = static_cast<uint8_t>(b);
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(code))) << b;
      continue;
    }
    EXPECT_EQ(F32ToFp8E4M3(Fp8E4M3ToF32(code)), code) << b;
  }
  for (uint8_t c = 0; c < 0x7e; ++c) {  // positive neighbours c, c + 1
    const float lo = Fp8E4M3ToF32(c), hi = Fp8E4M3ToF32(c + 1), mid = (lo + hi) / 2;
    EXPECT_EQ(F32ToFp8E4M3(mid), (c & 1) ? c + 1 : c) << int(c);
    EXPECT_EQ(F32ToFp8E4M3(std::nextafter(mid, hi)), c + 1) << int(c);
    EXPECT_EQ(F32ToFp8E4M3(std::nextafter(mid, lo)), c) << int(c);
    EXPECT_EQ(F32ToFp8E4M3(-mid), 0x80 | ((c & 1) ? c + 1 : c)) << int(c);
  }
  EXPECT_EQ(F32ToFp8E4M3(460.f), 0x7e);
  EXPECT_EQ(F32ToFp8E4M3(1e30f), 0x7e);
  EXPECT_EQ(F32ToFp8E4M3(-INFINITY), 0xfe);
  EXPECT_EQ(F32ToFp8E4M3(std::ldexp(1.f, -11)), 0x00);  // a quarter of the smallest: to zero
  EXPECT_EQ(F32ToFp8E4M3(NAN) & 0x7f, 0x7f);
}

TEST(OpsTest, RmsNormMatchesDefinition) {
  auto x = Random(3 * 10, 1), w = Random(10, 2);
  std::vector<float> out(30);
  RmsNorm(x.data(), w.data(), 3, 10, 1e-5f, out.data());
  for (int t = 0; t < 3; ++t) {
    double ss = 0;
    for (int i = 0; i < 10; ++i) ss += x[t * 10 + i] * x[t * 10 + i];
    const double r = 1.0 / std::sqrt(ss / 10 + 1e-5);
    for (int i = 0; i < 10; ++i) EXPECT_NEAR(out[t * 10 + i], w[i] * x[t * 10 + i] * r, 1e-5);
  }
}

TEST(OpsTest, RopeRotatesHalvesByPositionTimesFrequency) {
  const int hd = 8;
  std::vector<float> inv_freq = {1.f, 0.1f, 0.01f, 0.001f};
  auto q = Random(2 * 1 * hd, 3), k = Random(2 * 1 * hd, 4);
  auto q0 = q, k0 = k;
  std::vector<int32_t> pos = {0, 5};
  ApplyRope(pos.data(), 2, inv_freq.data(), hd, q.data(), 1, k.data(), 1);
  for (int i = 0; i < hd; ++i) EXPECT_FLOAT_EQ(q[i], q0[i]);  // position 0: identity
  for (int i = 0; i < hd / 2; ++i) {
    const double a = 5.0 * inv_freq[i];
    const float x = q0[hd + i], y = q0[hd + i + hd / 2];
    EXPECT_NEAR(q[hd + i], x * std::cos(a) - y * std::sin(a), 1e-5);
    EXPECT_NEAR(q[hd + i + hd / 2], y * std::cos(a) + x * std::sin(a), 1e-5);
  }
}

TEST(OpsTest, FastExpIsWithinTwoUlpOfExp) {
  double worst = 0;
  for (float x = -87.f; x < 88.f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(FastExp(x) - want) / want);
  }
  EXPECT_LT(worst, 2.5e-7);
  EXPECT_EQ(FastExp(-1000.f), FastExp(-87.33f));  // clamped, never inf/nan
  EXPECT_GT(FastExp(-87.33f), 0.f);
  EXPECT_FALSE(std::isinf(FastExp(1000.f)));
}

TEST(OpsTest, SiluMulMatchesDefinition) {
  // Sizes with and without a vector tail; gates from deep saturation to large positive.
  for (int64_t n : {1, 7, 50, 100003}) {
    auto g = Random(n, 5), u = Random(n, 6);
    for (int64_t i = 0; i < n; ++i) g[i] *= (i % 3 == 0) ? 120.f : 8.f;
    std::vector<float> out(n), gate_up(2 * n), interleaved(n);
    SiluMulSeparate(g.data(), u.data(), n, out.data());
    std::copy(g.begin(), g.end(), gate_up.begin());
    std::copy(u.begin(), u.end(), gate_up.begin() + n);
    SiluMul(gate_up.data(), 1, n, interleaved.data());
    for (int64_t i = 0; i < n; ++i) {
      const double want = g[i] / (1 + std::exp(-static_cast<double>(g[i]))) * u[i];
      ASSERT_NEAR(out[i], want, 1e-6 + 1e-6 * std::abs(want)) << "n " << n << " i " << i;
      ASSERT_EQ(out[i], interleaved[i]);
    }
  }
}

// Paged attention over shuffled blocks equals dense causal attention, for decode-sized and
// prefill-sized query chunks (the two code paths; 150 queries span several row blocks of the
// GEMM path), with GQA, with and without a sliding window.
TEST(OpsTest, PagedAttentionMatchesDenseCausalAttention) {
  const int64_t num_blocks = 64;
  std::vector<int32_t> table(num_blocks);
  for (int32_t b = 0; b < num_blocks; ++b) table[b] = (b * 37 + 11) % num_blocks;  // scrambled
  // Groups of 2 and 7 query heads per KV head; head sizes below, at and past the direct
  // paths' 32- and 64-wide output slices; blocks past their 16- and 64-token score slices.
  for (auto [heads, kv_heads] : {std::pair<int64_t, int64_t>{4, 2}, {7, 1}})
  for (auto [hd, bt] : {std::pair<int64_t, int64_t>{16, 4}, {64, 16}, {96, 80}})
  for (int64_t window : {0, 5})
  for (int64_t num_new : {1, 3, 8, 21, 150}) {
    const int64_t ctx = num_new + 24;
    const int64_t group = heads / kv_heads;
    auto keys = Random(ctx * kv_heads * hd, 10 + num_new);
    auto values = Random(ctx * kv_heads * hd, 20 + num_new);
    auto q = Random(num_new * heads * hd, 30 + num_new);
    // Scatter into blocks in a scrambled order.
    const int64_t block_floats = 2 * kv_heads * bt * hd;
    std::vector<float> pool(num_blocks * block_floats, NAN);
    for (int64_t p = 0; p < ctx; ++p)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t i = 0; i < hd; ++i) {
          float* blk = pool.data() + table[p / bt] * block_floats;
          blk[(h * hd + i) * bt + p % bt] = keys[(p * kv_heads + h) * hd + i];  // Kᵀ tile
          blk[kv_heads * bt * hd + (h * bt + p % bt) * hd + i] = values[(p * kv_heads + h) * hd + i];
        }
    std::vector<float> out(num_new * heads * hd);
    AttentionSeq seq{q.data(), out.data(), table.data(), num_new, ctx};
    PagedKvLayout layout{pool.data(), block_floats, kv_heads * bt * hd, bt, kv_heads, hd};
    const float scale = 1.f / std::sqrt(float(hd));
    PagedAttention(&seq, 1, layout, heads, scale, window);
    for (int64_t t = 0; t < num_new; ++t) {
      const int64_t visible = ctx - num_new + t + 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, visible - window) : 0;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t kh = h / group;
        std::vector<double> s(visible, 0.0);
        double mx = -1e30, z = 0;
        for (int64_t p = first; p < visible; ++p) {
          double acc = 0;
          for (int64_t i = 0; i < hd; ++i)
            acc += q[(t * heads + h) * hd + i] * keys[(p * kv_heads + kh) * hd + i];
          s[p] = acc * scale;
          mx = std::max(mx, s[p]);
        }
        for (int64_t p = first; p < visible; ++p) z += s[p] = std::exp(s[p] - mx);
        for (int64_t i = 0; i < hd; ++i) {
          double o = 0;
          for (int64_t p = first; p < visible; ++p)
            o += s[p] / z * values[(p * kv_heads + kh) * hd + i];
          ASSERT_NEAR(out[(t * heads + h) * hd + i], o, 1e-5) << "hd " << hd << " bt " << bt
              << " window " << window << " num_new " << num_new << " t " << t << " head " << h
              << " of " << heads
              << " dim " << i;
        }
      }
    }
  }
}

// Attention over a bf16 or fp8 cache equals, bit for bit, attention over an f32 cache holding
// the values the narrow cache reads back (fp8: the e4m3 value times its KV head's scale, scales
// unlike powers of two): the kernels widen with at most that one rounding and keep f32's order
// of operations. Every path: groups of 1, 2, 7 and 8 query heads (the AVX-512 kernel per group,
// or the portable one under PREFT_CPU_ISA=avx2, whose prompts take the gathered-GEMM path),
// masked tails of K rows and V slices, sliding windows, decode- and prompt-sized chunks.
template <class T>
void ExpectNarrowAttentionEqualsF32(KvDtype dtype, T (*encode)(float), float (*decode)(T)) {
  const int64_t num_blocks = 48;
  std::vector<int32_t> table(num_blocks);
  for (int32_t b = 0; b < num_blocks; ++b) table[b] = (b * 29 + 5) % num_blocks;
  for (auto [heads, kv_heads] :
       {std::pair<int64_t, int64_t>{3, 3}, {4, 2}, {7, 1}, {16, 2}})
  for (auto [hd, bt] : {std::pair<int64_t, int64_t>{16, 4}, {64, 16}, {40, 24}})
  for (int64_t window : {0, 7})
  for (int64_t num_new : {1, 5, 70}) {
    const int64_t ctx = num_new + 37;
    const int64_t block_elements = 2 * kv_heads * bt * hd;
    const bool scaled = dtype == KvDtype::kFp8E4M3;
    std::vector<float> k_scales(kv_heads, 1.f), v_scales(kv_heads, 1.f);
    if (scaled) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        k_scales[h] = 0.013f * float(h + 1);
        v_scales[h] = 0.0071f * float(h + 3);
      }
    }
    // Unwritten slots hold NaN in both pools: a kernel reading past the context shows.
    std::vector<float> f32_pool(num_blocks * block_elements, NAN);
    std::vector<T> narrow_pool(num_blocks * block_elements, encode(NAN));
    const auto kv = Random(ctx * block_elements, 40 + num_new);
    for (int64_t b = 0; b * bt < ctx; ++b) {
      for (int64_t e = 0; e < block_elements; ++e) {
        const bool is_key = e < block_elements / 2;
        const int64_t slot = is_key ? e % bt : (e - block_elements / 2) / hd % bt;
        if (b * bt + slot >= ctx) continue;
        const int64_t h = (is_key ? e : e - block_elements / 2) / (bt * hd);
        const float s = is_key ? k_scales[h] : v_scales[h];
        const int64_t at = table[b] * block_elements + e;
        narrow_pool[at] = encode(3.f * kv[b * block_elements + e]);
        f32_pool[at] = scaled ? decode(narrow_pool[at]) * s : decode(narrow_pool[at]);
      }
    }
    const auto q = Random(num_new * heads * hd, 50 + num_new);
    std::vector<float> want(num_new * heads * hd), got(want.size());
    AttentionSeq f32_seq{q.data(), want.data(), table.data(), num_new, ctx};
    AttentionSeq narrow_seq{q.data(), got.data(), table.data(), num_new, ctx};
    const PagedKvLayout f32_layout{f32_pool.data(), block_elements, kv_heads * bt * hd, bt,
                                   kv_heads,        hd,             KvDtype::kF32};
    const PagedKvLayout narrow_layout{narrow_pool.data(), block_elements, kv_heads * bt * hd,
                                      bt,                 kv_heads,       hd,
                                      dtype,              k_scales.data(), v_scales.data()};
    const float scale = 1.f / std::sqrt(float(hd));
    PagedAttention(&f32_seq, 1, f32_layout, heads, scale, window);
    PagedAttention(&narrow_seq, 1, narrow_layout, heads, scale, window);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_FALSE(std::isnan(want[i])) << i;
      uint32_t a, b;
      std::memcpy(&a, &want[i], 4);
      std::memcpy(&b, &got[i], 4);
      ASSERT_EQ(a, b) << KvDtypeName(dtype) << " heads " << heads << "/" << kv_heads << " hd "
                      << hd << " bt " << bt << " window " << window << " num_new " << num_new
                      << " element " << i << ": " << want[i] << " vs " << got[i];
    }
  }
}

TEST(OpsTest, PagedAttentionOverBf16EqualsF32OverTheRoundedValues) {
  ExpectNarrowAttentionEqualsF32<uint16_t>(KvDtype::kBF16, F32ToBf16, Bf16ToF32);
}

TEST(OpsTest, PagedAttentionOverFp8EqualsF32OverTheScaledValues) {
  ExpectNarrowAttentionEqualsF32<uint8_t>(KvDtype::kFp8E4M3, F32ToFp8E4M3, Fp8E4M3ToF32);
}

}  // namespace
}  // namespace preft::kernels::cpu
