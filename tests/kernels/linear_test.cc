#include "common/kernels/cpu/linear.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/base/aligned_vector.h"
#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/cpu/ops.h"
#include "common/kernels/dtype.h"
#include "common/kernels/matrix.h"
#include "tests/kernels/test_weights.h"

namespace preft::kernels::cpu {
namespace {

struct Shape {
  int64_t m, n, k;
};

// The full cross product of awkward sizes up to a reference cost, plus a few big ones.
std::vector<Shape> TestShapes(int64_t max_macs) {
  std::vector<Shape> shapes;
  for (int64_t m : {1, 2, 3, 5, 16, 17, 33, 64, 100, 512})
    for (int64_t n : {1, 15, 16, 17, 100, 896, 1000})
      for (int64_t k : {1, 31, 32, 33, 64, 100, 896, 4864})
        if (m * n * k <= max_macs) shapes.push_back({m, n, k});
  return shapes;
}

std::vector<float> RandomVector(int64_t size, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(size);
  for (float& f : v) f = dist(rng);
  return v;
}

// Checks y against a double-precision reference, per element within rel_tol of Σ|x||w|.
// With round_x the reference sees x rounded to bf16, as the vdpbf16ps and AMX paths do.
void ExpectMatchesReference(const std::vector<float>& x, const Weight& w, const float* bias,
                            const Shape& s, const std::vector<float>& y, bool round_x,
                            double rel_tol, const std::string& what) {
  std::vector<double> xr(x.begin(), x.end());
  if (round_x) {
    for (size_t c = 0; c < x.size(); ++c) xr[c] = Bf16ToF32(F32ToBf16(x[c]));
  }
  int failures = 0;
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = 0; j < s.n; ++j) {
      double ref = bias != nullptr ? bias[j] : 0.0, mag = bias != nullptr ? std::abs(bias[j]) : 0.0;
      for (int64_t c = 0; c < s.k; ++c) {
        const double xv = xr[i * s.k + c];
        const double wv = w.values[j * s.k + c];
        ref += xv * wv;
        mag += std::abs(xv * wv);
      }
      const double got = y[i * s.n + j];
      if (!(std::abs(got - ref) <= rel_tol * mag + 1e-6) && ++failures <= 5) {
        ADD_FAILURE() << what << " m=" << s.m << " n=" << s.n << " k=" << s.k << " at (" << i
                      << ", " << j << "): got " << got << " want " << ref << " (|x||w| " << mag
                      << ")";
      }
    }
  }
}

// Runs Linear on every test shape with weights of dtype and checks it against the reference.
// bf16_x: the kernel rounds x to bf16 (vdpbf16ps, AMX).
void RunAllShapes(DType dtype, bool bf16_x, const std::string& what) {
  std::mt19937 rng(1234);
  const double tol = bf16_x ? 1e-4 : 2e-5;
  std::vector<Shape> shapes = TestShapes(1'000'000);
  shapes.push_back({512, 160, 896});
  shapes.push_back({64, 260, 4864});
  shapes.push_back({100, 100, 4864});
  int index = 0;
  for (const Shape& s : shapes) {
    const Weight w = MakeWeight(dtype, s.n, s.k, rng);
    const std::vector<float> x = RandomVector(s.m * s.k, rng);
    const std::vector<float> bias = RandomVector(s.n, rng);
    const bool with_bias = (index++ % 2) == 1;
    // One guard element past y catches writes beyond the output.
    std::vector<float> y(s.m * s.n + 1, NAN);
    y.back() = 12345.f;
    Linear(x.data(), s.m, w.View(s.n, s.k), with_bias ? bias.data() : nullptr, y.data());
    EXPECT_EQ(y.back(), 12345.f) << "wrote past y, m=" << s.m << " n=" << s.n;
    y.pop_back();
    ExpectMatchesReference(x, w, with_bias ? bias.data() : nullptr, s, y, bf16_x, tol,
                           std::string(DTypeName(dtype)) + "/" + what);
    if (::testing::Test::HasFailure()) return;
  }
}


// Half-precision weights at each kernel level the CPU has, capped as PREFT_CPU_ISA would.
class LinearIsaTest : public ::testing::TestWithParam<LinearIsa> {
 protected:
  void SetUp() override {
    SetLinearIsaCapForTesting(LinearIsa::kAmx);
    if (static_cast<int>(ActiveLinearIsa()) < static_cast<int>(GetParam())) {
      GTEST_SKIP() << "CPU lacks " << LinearIsaName(GetParam()) << "; best is "
                   << LinearIsaName(ActiveLinearIsa());
    }
    SetLinearIsaCapForTesting(GetParam());
  }
  void TearDown() override { SetLinearIsaCapForTesting(LinearIsa::kAmx); }
};

TEST_P(LinearIsaTest, F32) { RunAllShapes(DType::kF32, false, LinearIsaName(GetParam())); }
TEST_P(LinearIsaTest, F16) { RunAllShapes(DType::kF16, false, LinearIsaName(GetParam())); }
TEST_P(LinearIsaTest, Bf16) {
  RunAllShapes(DType::kBF16, GetParam() >= LinearIsa::kAvx512Bf16, LinearIsaName(GetParam()));
}

// LinearShared gives exactly what one Linear per output gives: q/k/v-like outputs of
// different widths (one with a partial block, one with a bias, one streamed on AMX), and
// an output that cannot share (f16 beside bf16) making the call fall back.
TEST_P(LinearIsaTest, SharedEqualsSeparateCalls) {
  std::mt19937 rng(7);
  // m = 1 and 5 take the GEMV; from 8 the batched kernels. k = 1105 is odd and spans two k
  // blocks of the w-broadcast kernel, m = 600 two of its row blocks.
  for (auto [m, k] : {std::pair<int64_t, int64_t>{1, 96}, {5, 96}, {5, 1105}, {17, 96},
                      {64, 96}, {300, 96}, {600, 1105}}) {
    const Weight a = MakeWeight(DType::kBF16, 4096, k, rng);
    const Weight b = MakeWeight(DType::kBF16, 40, k, rng);
    const Weight c = MakeWeight(m == 17 ? DType::kF16 : DType::kBF16, 128, k, rng);
    const std::vector<float> x = RandomVector(m * k, rng), bias = RandomVector(40, rng);
    base::AlignedVector<float> ya(m * 4096, NAN), yb(m * 40, NAN), yc(m * 128, NAN);
    LinearShared(x.data(), m,
                 {{a.View(4096, k), nullptr, ya.data()},
                  {b.View(40, k), bias.data(), yb.data()},
                  {c.View(128, k), nullptr, yc.data()}});
    base::AlignedVector<float> ra(m * 4096), rb(m * 40), rc(m * 128);
    Linear(x.data(), m, a.View(4096, k), nullptr, ra.data());
    Linear(x.data(), m, b.View(40, k), bias.data(), rb.data());
    Linear(x.data(), m, c.View(128, k), nullptr, rc.data());
    EXPECT_EQ(ya, ra) << "m=" << m << " k=" << k;
    EXPECT_EQ(yb, rb) << "m=" << m << " k=" << k;
    EXPECT_EQ(yc, rc) << "m=" << m << " k=" << k;
  }
}

// LinearSwiGlu gives exactly LinearShared followed by SiluMulSeparate: n = 40 ends on a
// partial block of both projections; m = 300 x 4096 is streamed on AMX; f16 weights take the
// unfused path; one row the fused GEMV; k = 1105 two k blocks of the w-broadcast kernel.
TEST_P(LinearIsaTest, SwiGluEqualsSharedThenSilu) {
  std::mt19937 rng(8);
  for (auto [m, n, k, dtype] : {std::tuple<int64_t, int64_t, int64_t, DType>{1, 40, 96, DType::kBF16},
                                {3, 1000, 1105, DType::kBF16},
                                {17, 40, 96, DType::kBF16},
                                {64, 200, 96, DType::kF16},
                                {300, 4096, 96, DType::kBF16},
                                {600, 300, 1105, DType::kBF16}}) {
    const Weight gate = MakeWeight(dtype, n, k, rng), up = MakeWeight(dtype, n, k, rng);
    const std::vector<float> x = RandomVector(m * k, rng);
    base::AlignedVector<float> out(m * n, NAN), scratch(m * n, NAN);
    LinearSwiGlu(x.data(), m, gate.View(n, k), up.View(n, k), out.data(), scratch.data());
    base::AlignedVector<float> g(m * n), u(m * n);
    LinearShared(x.data(), m,
                 {{gate.View(n, k), nullptr, g.data()}, {up.View(n, k), nullptr, u.data()}});
    SiluMulSeparate(g.data(), u.data(), m * n, g.data());
    EXPECT_EQ(out, g) << "m=" << m << " n=" << n << " k=" << k;
  }
}

// Batch invariance: a row of y has the same bits whatever the number of rows beside it, for
// Linear, LinearShared and LinearSwiGlu, so a request's tokens do not depend on the batch it
// lands in. m crosses every kernel switch (GEMV below 8 rows, lane chunks of 16 and 64, row
// blocks of 512); k spans one and two k blocks, odd and even; n ends on partial tiles. AMX
// sums in its own order from 5 rows: not claimed there.
TEST_P(LinearIsaTest, RowsKeepTheirBitsAtEveryBatchSize) {
  if (GetParam() == LinearIsa::kAmx && GetCpuFeatures().amx_bf16) {
    GTEST_SKIP() << "AMX rows are not batch-invariant";
  }
  std::mt19937 rng(9);
  constexpr int64_t kRows = 530;
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{100, 896}, {33, 4864}, {70, 6500},
                        {17, 12289}, {48, 99}, {31, 33}, {3, 1}}) {
      const Weight w = MakeWeight(dtype, n, k, rng), up = MakeWeight(dtype, n, k, rng);
      const std::vector<float> x = RandomVector(kRows * k, rng), bias = RandomVector(n, rng);
      base::AlignedVector<float> all(kRows * n), all_up(kRows * n), all_swiglu(kRows * n);
      Linear(x.data(), kRows, w.View(n, k), bias.data(), all.data());
      LinearShared(x.data(), kRows,
                   {{w.View(n, k), bias.data(), all_up.data()}, {up.View(n, k), nullptr,
                                                                 all_swiglu.data()}});
      EXPECT_EQ(all_up, all) << DTypeName(dtype) << " shared, n=" << n << " k=" << k;
      LinearSwiGlu(x.data(), kRows, w.View(n, k), up.View(n, k), all_swiglu.data(),
                   all_up.data());
      for (int64_t m : {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 63, 64, 65, 129}) {
        base::AlignedVector<float> y(m * n), y2(m * n), swiglu(m * n);
        Linear(x.data(), m, w.View(n, k), bias.data(), y.data());
        LinearShared(x.data(), m,
                     {{w.View(n, k), bias.data(), y2.data()}, {up.View(n, k), nullptr,
                                                               swiglu.data()}});
        LinearSwiGlu(x.data(), m, w.View(n, k), up.View(n, k), swiglu.data(), y2.data());
        for (int64_t i = 0; i < m * n; ++i) {
          if (std::bit_cast<uint32_t>(y[i]) != std::bit_cast<uint32_t>(all[i]) ||
              std::bit_cast<uint32_t>(swiglu[i]) != std::bit_cast<uint32_t>(all_swiglu[i])) {
            FAIL() << DTypeName(dtype) << " m=" << m << " n=" << n << " k=" << k << " row "
                   << i / n << " col " << i % n << ": " << y[i] << " vs " << all[i]
                   << " (SwiGLU " << swiglu[i] << " vs " << all_swiglu[i] << ")";
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllLevels, LinearIsaTest,
                         ::testing::Values(LinearIsa::kScalar, LinearIsa::kAvx2,
                                           LinearIsa::kAvx512, LinearIsa::kAvx512Bf16,
                                           LinearIsa::kAmx),
                         [](const auto& info) { return std::string(LinearIsaName(info.param)); });

// The AMX loop nest and packing, with the tile instructions emulated: runs wherever
// AVX-512-BF16 does, so the indexing is checked even on CPUs without AMX.
TEST(LinearAmxEmulatedTest, MatchesReference) {
  if (!GetCpuFeatures().avx512_bf16) GTEST_SKIP() << "needs AVX-512-BF16";
  std::mt19937 rng(99);
  std::vector<Shape> shapes = TestShapes(1'000'000);
  shapes.push_back({17, 33, 4864});  // several k passes plus a k tail
  shapes.push_back({33, 100, 2080});
  // Packed x past L2: work items take spans of w blocks (the last span short, its last
  // block partial, every block with a k tail).
  shapes.push_back({130, 520, 4100});
  int index = 0;
  for (const Shape& s : shapes) {
    const Weight w = MakeWeight(DType::kBF16, s.n, s.k, rng);
    const std::vector<float> x = RandomVector(s.m * s.k, rng);
    const std::vector<float> bias = RandomVector(s.n, rng);
    const bool with_bias = (index++ % 2) == 0;
    std::vector<float> y(s.m * s.n + 1, NAN);
    y.back() = 12345.f;
    LinearBf16AmxEmulatedForTesting(x.data(), s.m, w.half.data(), s.n, s.k,
                                    with_bias ? bias.data() : nullptr, y.data());
    EXPECT_EQ(y.back(), 12345.f) << "wrote past y, m=" << s.m << " n=" << s.n;
    y.pop_back();
    ExpectMatchesReference(x, w, with_bias ? bias.data() : nullptr, s, y, true, 1e-4,
                           "amx-emulated");
    if (HasFailure()) return;
  }
}

// Shared-x work items numbered over several outputs (one ending on a partial block, one with
// a bias, spans for long x) on emulated tiles: the same bits as one emulated call per output.
TEST(LinearAmxEmulatedTest, SharedEqualsSeparateCalls) {
  if (!GetCpuFeatures().avx512_bf16) GTEST_SKIP() << "needs AVX-512-BF16";
  std::mt19937 rng(101);
  for (const Shape& s : {Shape{17, 100, 96}, Shape{130, 520, 4100}}) {
    const int64_t widths[3] = {s.n, 40, 64};
    std::vector<Weight> ws;
    std::vector<std::vector<float>> got, want;
    for (int64_t n : widths) {
      ws.push_back(MakeWeight(DType::kBF16, n, s.k, rng));
      got.emplace_back(s.m * n, NAN);
      want.emplace_back(s.m * n);
    }
    const std::vector<float> x = RandomVector(s.m * s.k, rng), bias = RandomVector(40, rng);
    Bf16Output outs[3];
    for (int o = 0; o < 3; ++o)
      outs[o] = {ws[o].half.data(), widths[o], o == 1 ? bias.data() : nullptr, got[o].data()};
    LinearBf16AmxSharedEmulatedForTesting(x.data(), s.m, s.k, outs, 3);
    for (int o = 0; o < 3; ++o) {
      LinearBf16AmxEmulatedForTesting(x.data(), s.m, ws[o].half.data(), widths[o], s.k,
                                      outs[o].bias, want[o].data());
      EXPECT_EQ(got[o], want[o]) << "output " << o << " m=" << s.m << " k=" << s.k;
    }
  }
}

// The SwiGLU work items (blocks of gate and up together, partial blocks of both, spans for
// long x) on emulated tiles: the same bits as separate emulated products and the SiLU op.
TEST(LinearAmxEmulatedTest, SwiGluEqualsSeparateProductsThenSilu) {
  if (!GetCpuFeatures().avx512_bf16) GTEST_SKIP() << "needs AVX-512-BF16";
  std::mt19937 rng(100);
  for (const Shape& s : {Shape{17, 40, 96}, Shape{33, 100, 70}, Shape{130, 520, 4100}}) {
    const Weight gate = MakeWeight(DType::kBF16, s.n, s.k, rng);
    const Weight up = MakeWeight(DType::kBF16, s.n, s.k, rng);
    const std::vector<float> x = RandomVector(s.m * s.k, rng);
    std::vector<float> out(s.m * s.n, NAN), g(s.m * s.n), u(s.m * s.n);
    LinearBf16AmxSwiGluEmulatedForTesting(x.data(), s.m, gate.half.data(), up.half.data(), s.n,
                                          s.k, out.data());
    LinearBf16AmxEmulatedForTesting(x.data(), s.m, gate.half.data(), s.n, s.k, nullptr, g.data());
    LinearBf16AmxEmulatedForTesting(x.data(), s.m, up.half.data(), s.n, s.k, nullptr, u.data());
    SiluMulSeparate(g.data(), u.data(), s.m * s.n, g.data());
    EXPECT_EQ(out, g) << "m=" << s.m << " n=" << s.n << " k=" << s.k;
  }
}

// Paths of the AMX kernel that Linear reaches only with big operands, on real tiles: spans of
// w blocks (packed x past 1 MiB: long prompts) and streaming stores (y past 1 MiB on a cache
// line; n = 2736 also ends on a half block of 16 rows).
TEST(LinearAmxTest, SpansAndStreamedOutputsMatchReference) {
  if (!GetCpuFeatures().amx_bf16) GTEST_SKIP() << "needs AMX-BF16";
  std::mt19937 rng(5);
  for (const Shape& s : {Shape{130, 520, 4100}, Shape{200, 600, 4864}, Shape{100, 2736, 896},
                         Shape{520, 1024, 300}}) {
    const Weight w = MakeWeight(DType::kBF16, s.n, s.k, rng);
    const std::vector<float> x = RandomVector(s.m * s.k, rng);
    const std::vector<float> bias = RandomVector(s.n, rng);
    base::AlignedVector<float> y(s.m * s.n + 1, NAN);
    y.back() = 12345.f;
    LinearBf16Amx(x.data(), s.m, w.half.data(), s.n, s.k, bias.data(), y.data());
    EXPECT_EQ(y.back(), 12345.f) << "wrote past y, m=" << s.m << " n=" << s.n;
    ExpectMatchesReference(x, w, bias.data(), s, std::vector<float>(y.begin(), y.end() - 1),
                           true, 1e-4, "amx");
    if (HasFailure()) return;
  }
}

// The packed GEMM on every shape, small m included (Linear only sends it batched x), plus
// shapes with several k blocks, odd k and partial panels and row blocks.
TEST(LinearPackedTest, MatchesReference) {
  if (!GetCpuFeatures().avx512_bf16) GTEST_SKIP() << "needs AVX-512-BF16";
  std::mt19937 rng(7);
  std::vector<Shape> shapes = TestShapes(1'000'000);
  shapes.push_back({17, 33, 4864});
  shapes.push_back({33, 100, 2080});
  shapes.push_back({7, 130, 1025});
  shapes.push_back({400, 70, 513});  // two row chunks
  shapes.push_back({800, 65, 257});
  shapes.push_back({17, 70, 6500});  // two k blocks, the last odd
  shapes.push_back({7, 129, 12289});
  int index = 0;
  for (const Shape& s : shapes) {
    // w ends exactly at its last element, so a read past it shows under sanitizers.
    const Weight w = MakeWeight(DType::kBF16, s.n, s.k, rng);
    const std::vector<float> x = RandomVector(s.m * s.k, rng);
    const std::vector<float> bias = RandomVector(s.n, rng);
    const bool with_bias = (index++ % 2) == 0;
    std::vector<float> y(s.m * s.n + 1, NAN);
    y.back() = 12345.f;
    LinearBf16Avx512Packed(x.data(), s.m, w.half.data(), s.n, s.k,
                           with_bias ? bias.data() : nullptr, y.data());
    EXPECT_EQ(y.back(), 12345.f) << "wrote past y, m=" << s.m << " n=" << s.n;
    y.pop_back();
    ExpectMatchesReference(x, w, with_bias ? bias.data() : nullptr, s, y, true, 1e-4,
                           "avx512bf16-packed");
    if (HasFailure()) return;
  }
}

// The w-broadcast GEMM on every shape, plus several k blocks (the last odd, so the last
// element of w is read alone), partial lane chunks (m not a multiple of 16 or 64), n tails
// of every tile height and several work items.
TEST(LinearBroadcastTest, MatchesReference) {
  if (!GetCpuFeatures().avx512_bf16) GTEST_SKIP() << "needs AVX-512-BF16";
  std::mt19937 rng(11);
  std::vector<Shape> shapes = TestShapes(1'000'000);
  shapes.push_back({17, 33, 4864});
  shapes.push_back({33, 100, 2080});
  shapes.push_back({7, 130, 1025});
  shapes.push_back({400, 70, 513});
  shapes.push_back({800, 65, 257});
  shapes.push_back({17, 70, 6500});
  shapes.push_back({7, 129, 12289});
  shapes.push_back({48, 203, 99});
  shapes.push_back({80, 97, 2049});
  shapes.push_back({113, 389, 65});
  int index = 0;
  for (const Shape& s : shapes) {
    // w ends exactly at its last element, so a read past it shows under sanitizers.
    const Weight w = MakeWeight(DType::kBF16, s.n, s.k, rng);
    const std::vector<float> x = RandomVector(s.m * s.k, rng);
    const std::vector<float> bias = RandomVector(s.n, rng);
    const bool with_bias = (index++ % 2) == 0;
    std::vector<float> y(s.m * s.n + 1, NAN);
    y.back() = 12345.f;
    LinearBf16Avx512Broadcast(x.data(), s.m, w.half.data(), s.n, s.k,
                              with_bias ? bias.data() : nullptr, y.data());
    EXPECT_EQ(y.back(), 12345.f) << "wrote past y, m=" << s.m << " n=" << s.n;
    y.pop_back();
    ExpectMatchesReference(x, w, with_bias ? bias.data() : nullptr, s, y, true, 1e-4,
                           "avx512bf16-broadcast");
    if (HasFailure()) return;
  }
}

TEST(LinearTest, EmptyAndZeroK) {
  const float bias[3] = {1.f, 2.f, 3.f};
  float y[6] = {};
  const float dummy = 0.f;
  Linear(&dummy, 2, MatrixView{&dummy, DType::kBF16, 3, 0}, bias, y);
  EXPECT_EQ(y[0], 1.f);
  EXPECT_EQ(y[5], 3.f);
  Linear(&dummy, 0, MatrixView{&dummy, DType::kBF16, 3, 4}, bias, y);  // no rows: no-op
}

TEST(CpuFeaturesTest, LevelsAreConsistent) {
  const CpuFeatures& f = GetCpuFeatures();
  if (f.amx_bf16) {
    EXPECT_TRUE(f.avx512_bf16);
  }
  if (f.avx512_bf16) {
    EXPECT_TRUE(f.avx512);
  }
  if (f.avx512) {
    EXPECT_TRUE(f.avx2);
  }
  std::printf("cpu: avx2=%d avx512=%d avx512_bf16=%d amx_bf16=%d -> linear uses %s\n", f.avx2,
              f.avx512, f.avx512_bf16, f.amx_bf16, LinearIsaName(ActiveLinearIsa()));
}

}  // namespace
}  // namespace preft::kernels::cpu
