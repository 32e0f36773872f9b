#include "common/kernels/cpu/low_rank.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/dtype.h"
#include "tests/kernels/test_weights.h"

namespace preft::kernels::cpu {
namespace {

// A [rows, cols] matrix in one dtype with its f32 values.
struct Mat : Weight {
  int64_t rows, cols;
  MatrixView View() const { return Weight::View(rows, cols); }
};

Mat MakeMat(DType dtype, int64_t rows, int64_t cols, std::mt19937& rng) {
  return {MakeWeight(dtype, rows, cols, rng), rows, cols};
}

struct Case {
  int64_t rank;
  std::vector<int32_t> rows;
  Mat shrink, expand;
  std::vector<float> bias;
  float scale;
};

// Whether LowRankAdd runs this case's rows through vdpbf16ps, rounding x and z to bf16 as the
// bf16 linears round x: every row of a bf16 adapter (prompt and decode) on CPUs with
// AVX-512-BF16.
bool RoundsToBf16(DType dtype, const Case&) {
  return dtype == DType::kBF16 && ActiveLinearIsa() >= LinearIsa::kAvx512Bf16;
}

double Bf16(double v) { return Bf16ToF32(F32ToBf16(static_cast<float>(v))); }

// y[row] += scale * ((x[row] S^T + b) E), in double; with `round`, x and z are first rounded
// to bf16.
void Reference(const std::vector<float>& x, int64_t in, std::vector<double>* y, int64_t out,
               const Case& c, bool round = false) {
  for (int32_t row : c.rows) {
    std::vector<double> z(c.rank);
    for (int64_t k = 0; k < c.rank; ++k) {
      double s = 0.0;
      for (int64_t i = 0; i < in; ++i) {
        const double xi = round ? Bf16(x[row * in + i]) : x[row * in + i];
        s += xi * c.shrink.values[k * in + i];
      }
      s += c.bias.empty() ? 0.0 : c.bias[k];
      z[k] = round ? Bf16(s) : s;
    }
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t k = 0; k < c.rank; ++k) s += z[k] * c.expand.values[k * out + o];
      (*y)[row * out + o] += c.scale * s;
    }
  }
}

class LowRankTest : public ::testing::TestWithParam<DType> {
 protected:
  void TearDown() override { SetLinearIsaCapForTesting(LinearIsa::kAmx); }
};

// Many groups with different ranks, row counts (1 row: BGMV; many: SGMV) and interleaved rows,
// over dimensions with and without vector tails; bf16 prompt groups through vdpbf16ps where
// the CPU has it, then through the f32 path (ISA capped below AVX-512-BF16).
TEST_P(LowRankTest, MatchesReferenceForMixedGroups) {
  const DType dtype = GetParam();
  std::mt19937 rng(7);
  for (const LinearIsa cap : {LinearIsa::kAmx, LinearIsa::kAvx512})
  for (auto [in, out] : {std::pair<int64_t, int64_t>{64, 32}, {96, 160}, {37, 45}, {896, 128},
                         {4864, 900}}) {
    SetLinearIsaCapForTesting(cap);
    const int64_t num_rows = 70;
    std::vector<float> x(num_rows * in);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (float& v : x) v = dist(rng);
    std::vector<float> y(num_rows * out);
    for (float& v : y) v = dist(rng);
    std::vector<double> expect(y.begin(), y.end());

    // Rows dealt round-robin to groups of sizes 1, 1, 3, 20, 40 (some rows left untouched).
    std::vector<Case> cases;
    const int64_t ranks[] = {1, 16, 4, 8, 64};
    const int64_t sizes[] = {1, 1, 3, 20, 40};
    std::vector<int32_t> perm(num_rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    size_t next = 0;
    for (int g = 0; g < 5; ++g) {
      Case c{
          ranks[g], {},      MakeMat(dtype, ranks[g], in, rng), MakeMat(dtype, ranks[g], out, rng),
          {},       0.5f + g};
      for (int64_t i = 0; i < sizes[g] && next < perm.size(); ++i) c.rows.push_back(perm[next++]);
      if (g % 2 == 1) {
        c.bias.resize(c.rank);
        for (float& b : c.bias) b = dist(rng);
      }
      cases.push_back(std::move(c));
    }
    std::vector<LowRankGroup> groups;
    for (const Case& c : cases) {
      Reference(x, in, &expect, out, c, RoundsToBf16(dtype, c));
      groups.push_back({c.rows.data(), static_cast<int64_t>(c.rows.size()), c.shrink.View(),
                        c.expand.View(), c.bias.empty() ? nullptr : c.bias.data(), c.scale});
    }
    LowRankAdd(x.data(), in, y.data(), out, groups.data(), static_cast<int64_t>(groups.size()));
    for (int64_t i = 0; i < num_rows * out; ++i) {
      ASSERT_NEAR(y[i], expect[i], 1e-3 * (1 + std::abs(expect[i])))
          << "in=" << in << " out=" << out << " isa cap " << LinearIsaName(cap) << " element " << i;
    }
  }
}

// Decode rows alone (BGMV, the multi-LoRA decode path): ranks that are not a multiple of the
// kernel's four rows per pass, widths with and without 32-wide tails, one row in place.
TEST_P(LowRankTest, DecodeRowsMatchReference) {
  const DType dtype = GetParam();
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto [in, out, rank] : {std::tuple<int64_t, int64_t, int64_t>{100, 70, 6},
                               {896, 4864, 16}, {4864, 896, 16}, {33, 31, 3}, {64, 64, 9}}) {
    const int64_t num_rows = 5;
    std::vector<float> x(num_rows * in), y(num_rows * out);
    for (float& v : x) v = dist(rng);
    for (float& v : y) v = dist(rng);
    std::vector<double> expect(y.begin(), y.end());
    std::vector<Case> cases;
    for (int32_t r = 0; r < num_rows; ++r) {
      Case c{rank, {r}, MakeMat(dtype, rank, in, rng), MakeMat(dtype, rank, out, rng), {}, 0.25f + r};
      if (r % 2 == 0) {
        c.bias.resize(rank);
        for (float& b : c.bias) b = dist(rng);
      }
      cases.push_back(std::move(c));
    }
    std::vector<LowRankGroup> groups;
    for (const Case& c : cases) {
      Reference(x, in, &expect, out, c, RoundsToBf16(dtype, c));
      groups.push_back({c.rows.data(), 1, c.shrink.View(), c.expand.View(),
                        c.bias.empty() ? nullptr : c.bias.data(), c.scale});
    }
    LowRankAdd(x.data(), in, y.data(), out, groups.data(), static_cast<int64_t>(groups.size()));
    for (int64_t i = 0; i < num_rows * out; ++i) {
      ASSERT_NEAR(y[i], expect[i], 1e-3 * (1 + std::abs(expect[i])))
          << "in=" << in << " out=" << out << " rank=" << rank << " element " << i;
    }
    if (in != out) continue;
    // In place, as DiReFT on a decode row: the row is read in full before it is written.
    std::vector<double> expect_x(x.begin(), x.end());
    Reference(x, in, &expect_x, in, cases[1], RoundsToBf16(dtype, cases[1]));
    LowRankAdd(x.data(), in, x.data(), in, &groups[1], 1);
    for (int64_t i = 0; i < num_rows * in; ++i) {
      ASSERT_NEAR(x[i], expect_x[i], 1e-3 * (1 + std::abs(expect_x[i]))) << "in place, element " << i;
    }
  }
}

// DiReFT updates the residual stream in place: x and y are one buffer.
TEST_P(LowRankTest, InPlaceUpdateReadsEachRowBeforeWritingIt) {
  const DType dtype = GetParam();
  std::mt19937 rng(11);
  // 10 rows (two work items) and 38 rows (five).
  for (const int64_t num_rows : {19, 75}) {
    const int64_t d = 72, rank = 4;
    std::vector<float> x(num_rows * d);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (float& v : x) v = dist(rng);
    Case c{
        rank, {}, MakeMat(dtype, rank, d, rng), MakeMat(dtype, rank, d, rng), {1.f, -2.f, 0.5f, 0.f},
        1.0f};
    for (int32_t r = 0; r < num_rows; r += 2) c.rows.push_back(r);
    std::vector<double> expect(x.begin(), x.end());
    Reference(x, d, &expect, d, c, RoundsToBf16(dtype, c));
    LowRankGroup g{c.rows.data(),   static_cast<int64_t>(c.rows.size()),
                   c.shrink.View(), c.expand.View(),
                   c.bias.data(),   c.scale};
    LowRankAdd(x.data(), d, x.data(), d, &g, 1);
    for (int64_t i = 0; i < num_rows * d; ++i)
      ASSERT_NEAR(x[i], expect[i], 1e-3 * (1 + std::abs(expect[i]))) << "element " << i;
  }
}

// The chunked layout changes where the kernels read, not what they sum: decode rows (BGMV),
// prompt groups (SGMV) and in-place updates give the row-major layout's results bit for bit.
// Except shrinks of rank 16, 32, ... (stored by column pairs): those sum each z in another
// order (kernels::ColumnPaired), so their results agree to rounding.
TEST(LowRankTest, ChunkedMatricesGiveRowMajorResults) {
  if (ActiveLinearIsa() < LinearIsa::kAvx512Bf16) GTEST_SKIP() << "no AVX-512-BF16 here";
  std::mt19937 rng(23);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto [in, out, rank] : {std::tuple<int64_t, int64_t, int64_t>{896, 128, 16},
                               {128, 4864, 16}, {64, 96, 4}, {96, 96, 8}, {64, 160, 12},
                               {96, 64, 20}, {64, 64, 32}}) {
    SCOPED_TRACE("in=" + std::to_string(in) + " out=" + std::to_string(out) +
                 " rank=" + std::to_string(rank));
    const int64_t num_rows = 24;
    std::vector<float> x(num_rows * in), y(num_rows * out);
    for (float& v : x) v = dist(rng);
    for (float& v : y) v = dist(rng);
    // Rows 0-3 decode rows of their own adapters, 4-23 two prompt groups (SGMV) of 9 and 11
    // rows (a last work item of one row among them).
    std::vector<std::vector<int32_t>> rows = {{0}, {1}, {2}, {3}, {}, {}};
    for (int32_t r = 4; r < num_rows; ++r) rows[r < 13 ? 4 : 5].push_back(r);
    std::vector<Case> cases;
    std::vector<std::vector<uint16_t>> chunked;  // shrink, expand per case
    std::vector<LowRankGroup> row_major, chunk;
    for (size_t i = 0; i < rows.size(); ++i) {
      Case c{rank, rows[i], MakeMat(DType::kBF16, rank, in, rng),
             MakeMat(DType::kBF16, rank, out, rng), {}, 0.5f + i};
      if (i % 2 == 0) {
        c.bias.resize(rank);
        for (float& b : c.bias) b = dist(rng);
      }
      cases.push_back(std::move(c));
    }
    for (const Case& c : cases) {
      LowRankGroup g{c.rows.data(), static_cast<int64_t>(c.rows.size()), c.shrink.View(),
                     c.expand.View(), c.bias.empty() ? nullptr : c.bias.data(), c.scale};
      row_major.push_back(g);
      for (const MatrixView* m : {&g.shrink, &g.expand}) {
        ASSERT_TRUE(LowRankChunkable(*m));
        chunked.emplace_back(m->rows * m->cols);
        ChunkColumns(static_cast<const uint16_t*>(m->data), m->rows, m->cols,
                     /*paired=*/m == &g.expand, chunked.back().data());
      }
      g.shrink.data = chunked[chunked.size() - 2].data();
      g.expand.data = chunked.back().data();
      g.shrink.chunked = g.expand.chunked = g.expand.paired = true;
      chunk.push_back(g);
    }
    const bool same_sums = !ColumnPaired(rank, /*paired=*/false);
    auto expect_same = [&](const std::vector<float>& want, const std::vector<float>& got) {
      if (same_sums) {
        ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
        return;
      }
      // The f32 sums differ in their last bits, and z is rounded to bf16 before the expand:
      // a z one bf16 step (2^-8 relative) apart moves y by at most that share of one term.
      // A lost bias or a misread column pair moves it by whole terms.
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-2 * (1 + std::abs(want[i]))) << "element " << i;
    };
    std::vector<float> y_row = y, y_chunk = y;
    LowRankAdd(x.data(), in, y_row.data(), out, row_major.data(), row_major.size());
    LowRankAdd(x.data(), in, y_chunk.data(), out, chunk.data(), chunk.size());
    expect_same(y_row, y_chunk);
    EXPECT_NE(y_row, y);  // something was added
    if (in != out) continue;
    // In place (DiReFT on the residual stream).
    std::vector<float> x_row = x, x_chunk = x;
    LowRankAdd(x_row.data(), in, x_row.data(), in, row_major.data(), row_major.size());
    LowRankAdd(x_chunk.data(), in, x_chunk.data(), in, chunk.data(), chunk.size());
    expect_same(x_row, x_chunk);
  }
  // Shapes the chunked kernels do not take stay row-major.
  std::vector<uint16_t> w(16 * 100);
  EXPECT_FALSE(LowRankChunkable(MatrixView{w.data(), DType::kBF16, 16, 100}));  // cols
  EXPECT_FALSE(LowRankChunkable(MatrixView{w.data(), DType::kBF16, 6, 96}));    // rank
  EXPECT_FALSE(LowRankChunkable(MatrixView{w.data(), DType::kF32, 16, 64}));    // dtype
}

// A decode row's result is the same bits whoever its neighbours are: alone in the call, beside
// other adapters' rows (which the BGMV runs up to four at a time, in lockstep, across q, k
// and v's different widths), or inside a group of many rows (as when several requests share
// an adapter, which takes the prompt kernels), in either layout. The engine's batch
// invariance rests on this.
TEST(LowRankTest, ADecodeRowIgnoresItsNeighbours) {
  if (ActiveLinearIsa() < LinearIsa::kAvx512Bf16) GTEST_SKIP() << "no AVX-512-BF16 here";
  std::mt19937 rng(31);
  std::normal_distribution<float> dist(0.f, 1.f);
  const int64_t in = 896, num_rows = 13;
  const int64_t outs[] = {896, 128, 128};  // q, k, v: one input, three outputs
  // Lockstep runs break where ranks change: rank 16 four wide, 32 two, 4-12 two.
  const int64_t ranks[] = {16, 16, 16, 8, 16, 4, 4, 12, 32, 32, 16, 16, 48};
  // x's even elements are 1 and every shrink's even columns +-4096 by turns (pairs 0 and 2
  // mod 4): the big terms cancel in z, so z's last bits depend on the order of its sums and
  // show past its rounding to bf16. A kernel that summed a row differently beside other rows
  // would fail here.
  std::vector<float> x(num_rows * in);
  for (int64_t i = 0; i < num_rows * in; ++i) x[i] = i % 2 == 0 ? 1.0f : dist(rng);
  auto cancelling = [&](Mat* s) {
    for (int64_t k = 0; k < s->rows; ++k) {
      for (int64_t p = 0; p < in / 2; ++p) {
        const float big = p % 4 == 0 ? 4096.f : p % 4 == 2 ? -4096.f : 0.f;
        s->half[k * in + 2 * p] = F32ToBf16(big);
        s->values[k * in + 2 * p] = big;
      }
    }
  };
  std::vector<std::vector<float>> y0(3);
  for (int t = 0; t < 3; ++t) {
    y0[t].resize(num_rows * outs[t]);
    for (float& v : y0[t]) v = dist(rng);
  }
  struct Adapter {
    int32_t row;
    std::vector<Case> cases;  // one per target
    std::vector<std::vector<uint16_t>> chunked;
  };
  std::vector<Adapter> adapters(std::size(ranks));
  for (size_t a = 0; a < adapters.size(); ++a) {
    adapters[a].row = static_cast<int32_t>(a);
    for (int t = 0; t < 3; ++t) {
      Case c{ranks[a], {adapters[a].row}, MakeMat(DType::kBF16, ranks[a], in, rng),
             MakeMat(DType::kBF16, ranks[a], outs[t], rng), {}, 0.5f + a};
      cancelling(&c.shrink);
      if ((a + t) % 2 == 0) {
        c.bias.resize(c.rank);
        for (float& b : c.bias) b = dist(rng);
      }
      for (const Mat* m : {&c.shrink, &c.expand}) {
        adapters[a].chunked.emplace_back(m->rows * m->cols);
        ChunkColumns(static_cast<const uint16_t*>(m->View().data), m->rows, m->cols,
                     /*paired=*/m == &c.expand, adapters[a].chunked.back().data());
      }
      adapters[a].cases.push_back(std::move(c));
    }
  }
  // Groups adapter by adapter, targets inside, as Model::ApplyLora orders them.
  auto groups_of = [&](const Adapter& ad, bool chunked, std::vector<std::vector<float>>* y) {
    std::vector<LowRankGroup> gs;
    for (int t = 0; t < 3; ++t) {
      const Case& c = ad.cases[t];
      LowRankGroup g{c.rows.data(), 1, c.shrink.View(), c.expand.View(),
                     c.bias.empty() ? nullptr : c.bias.data(), c.scale, (*y)[t].data(), outs[t]};
      if (chunked) {
        g.shrink.data = ad.chunked[2 * t].data();
        g.expand.data = ad.chunked[2 * t + 1].data();
        g.shrink.chunked = g.expand.chunked = g.expand.paired = true;
      }
      gs.push_back(g);
    }
    return gs;
  };
  for (bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "row-major");
    // Every adapter alone: the reference bits (of this layout: see
    // ChunkedMatricesGiveRowMajorResults).
    std::vector<std::vector<float>> alone = y0;
    for (const Adapter& ad : adapters) {
      for (const LowRankGroup& g : groups_of(ad, chunked, &alone)) LowRankAdd(x.data(), in, nullptr, 0, &g, 1);
    }
    EXPECT_NE(alone, y0);
    std::vector<std::vector<float>> together = y0;
    std::vector<LowRankGroup> all;
    for (const Adapter& ad : adapters) {
      for (const LowRankGroup& g : groups_of(ad, chunked, &together)) all.push_back(g);
    }
    LowRankAdd(x.data(), in, nullptr, 0, all.data(), static_cast<int64_t>(all.size()));
    for (int t = 0; t < 3; ++t) {
      ASSERT_EQ(0, std::memcmp(together[t].data(), alone[t].data(), alone[t].size() * sizeof(float)))
          << "target " << t;
    }
    // Adapter 0's row inside a group of five rows on the same adapter (prompt kernels, in
    // passes of four rows and one).
    const std::vector<int32_t> five = {0, 7, 8, 9, 10};
    std::vector<std::vector<float>> grouped = y0;
    std::vector<LowRankGroup> gs = groups_of(adapters[0], chunked, &grouped);
    for (LowRankGroup& g : gs) {
      g.rows = five.data();
      g.num_rows = 5;
    }
    LowRankAdd(x.data(), in, nullptr, 0, gs.data(), static_cast<int64_t>(gs.size()));
    for (int t = 0; t < 3; ++t) {
      ASSERT_EQ(0, std::memcmp(grouped[t].data(), alone[t].data(), outs[t] * sizeof(float)))
          << "row 0 among five rows, target " << t;
    }
  }
}

// Every dtype and kernel level: a row's result has the same bits alone (a decode row) and
// inside a group of many rows (prompt rows, or users sharing an adapter). Widths with tails
// past every vector loop (8, 16, 32 wide); bf16 also with vdpbf16ps capped off, which takes
// the widening AVX-512 kernels.
TEST_P(LowRankTest, ARowHasTheSameBitsAloneAndInAGroup) {
  const DType dtype = GetParam();
  std::mt19937 rng(41);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<LinearIsa> caps = {LinearIsa::kAmx};
  if (dtype == DType::kBF16 && GetCpuFeatures().avx512) caps.push_back(LinearIsa::kAvx512);
  for (const LinearIsa cap : caps) {
    SetLinearIsaCapForTesting(cap);
    for (auto [in, out, rank] : {std::tuple<int64_t, int64_t, int64_t>{896, 896, 16},
                                 {100, 203, 6}, {77, 27, 4}, {4864, 896, 8}}) {
      const int64_t num_rows = 11;
      std::vector<float> x(num_rows * in), y0(num_rows * out);
      for (float& v : x) v = dist(rng);
      for (float& v : y0) v = dist(rng);
      const Mat s = MakeMat(dtype, rank, in, rng), e = MakeMat(dtype, rank, out, rng);
      std::vector<float> bias(rank);
      for (float& b : bias) b = dist(rng);
      std::vector<int32_t> rows(num_rows);
      std::iota(rows.begin(), rows.end(), 0);
      std::vector<float> together = y0;
      const LowRankGroup all{rows.data(), num_rows, s.View(), e.View(), bias.data(), 0.7f};
      LowRankAdd(x.data(), in, together.data(), out, &all, 1);
      for (int32_t r = 0; r < num_rows; ++r) {
        std::vector<float> alone = y0;
        const LowRankGroup one{&rows[r], 1, s.View(), e.View(), bias.data(), 0.7f};
        LowRankAdd(x.data(), in, alone.data(), out, &one, 1);
        ASSERT_EQ(0, std::memcmp(alone.data() + r * out, together.data() + r * out,
                                 out * sizeof(float)))
            << "row " << r << " in=" << in << " out=" << out << " rank=" << rank << " cap "
            << LinearIsaName(cap);
      }
    }
  }
  SetLinearIsaCapForTesting(LinearIsa::kAmx);
}

TEST(LowRankTest, EmptyGroupsAndNoGroupsLeaveOutputAlone) {
  std::vector<float> x(8 * 16, 1.f), y(8 * 16, 3.f);
  std::mt19937 rng(1);
  Mat s = MakeMat(DType::kF32, 2, 16, rng), e = MakeMat(DType::kF32, 2, 16, rng);
  LowRankGroup g{nullptr, 0, s.View(), e.View(), nullptr, 1.f};
  LowRankAdd(x.data(), 16, y.data(), 16, &g, 1);
  LowRankAdd(x.data(), 16, y.data(), 16, nullptr, 0);
  for (float v : y) ASSERT_EQ(v, 3.f);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LowRankTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace preft::kernels::cpu
