// What each tensor-parallel rank holds: the column-parallel projections' outputs concatenated
// over the ranks, and the row-parallel ones' partial outputs summed, give the whole
// projection, LoRA included (the GPU forward's all-reduce is that sum). Plain loops over
// random f32 and bf16 matrices; the slicing is the code under test.

#include "common/backend/tensor_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "common/kernels/dtype.h"

namespace preft::backend {
namespace {

using kernels::DType;
using kernels::MatrixView;

model::ModelConfig Config() {
  model::ModelConfig c;
  c.hidden_size = 48;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 8;
  c.intermediate_size = 96;
  c.num_layers = 1;
  c.vocab_size = 10;
  return c;
}

// A random [rows, cols] matrix in `dtype`, its values also as f32 (exact: bf16 widens exactly).
struct Matrix {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
  MatrixView view;
};
Matrix Random(int64_t rows, int64_t cols, DType dtype, std::mt19937* rng) {
  Matrix m;
  m.bytes.resize(rows * cols * kernels::DTypeSize(dtype));
  m.values.resize(rows * cols);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int64_t i = 0; i < rows * cols; ++i) {
    kernels::StoreFromF32(m.bytes.data(), dtype, i, u(*rng));
    m.values[i] = kernels::LoadAsF32(m.bytes.data(), dtype, i);
  }
  m.view = {m.bytes.data(), dtype, rows, cols};
  return m;
}

// y[n][out] = x W^T + scale (x S^T + b) E, for a [out, in] W and an optional pair (S, E).
std::vector<double> Project(const std::vector<float>& x, int64_t n, const MatrixView& w,
                            const model::LowRank* lr) {
  std::vector<double> y(n * w.rows, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < w.rows; ++o) {
      double s = 0;
      for (int64_t i = 0; i < w.cols; ++i) {
        s += double{x[t * w.cols + i]} * kernels::LoadAsF32(w.data, w.dtype, o * w.cols + i);
      }
      y[t * w.rows + o] = s;
    }
    if (lr == nullptr) continue;
    for (int64_t k = 0; k < lr->rank(); ++k) {
      double z = lr->shrink_bias != nullptr ? lr->shrink_bias[k] : 0.0;
      for (int64_t i = 0; i < w.cols; ++i) {
        z += double{x[t * w.cols + i]} *
             kernels::LoadAsF32(lr->shrink.data, lr->shrink.dtype, k * lr->shrink.cols + i);
      }
      for (int64_t o = 0; o < w.rows; ++o) {
        const float e =
            kernels::LoadAsF32(lr->expand.data, lr->expand.dtype, k * lr->expand.cols + o);
        y[t * w.rows + o] += lr->scale * z * e;
      }
    }
  }
  return y;
}

// The columns `cols` of the rows of x ([n, width]).
std::vector<float> Columns(const std::vector<float>& x, int64_t n, int64_t width, ShardRange cols) {
  std::vector<float> out;
  for (int64_t t = 0; t < n; ++t) {
    out.insert(out.end(), x.begin() + t * width + cols.begin, x.begin() + t * width + cols.end);
  }
  return out;
}

TEST(TensorParallelTest, RefusesSplitsThatDoNotDivideTheModel) {
  const model::ModelConfig c = Config();
  EXPECT_TRUE(CheckTensorParallel(c, 1).ok());
  EXPECT_TRUE(CheckTensorParallel(c, 4).ok());
  const absl::Status kv = CheckTensorParallel(c, 8);
  EXPECT_EQ(kv.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.message(),
            "tensor parallelism over 8 ranks: the model's num_key_value_heads (4) is not a "
            "multiple of 8");
  const absl::Status heads = CheckTensorParallel(c, 3);
  EXPECT_NE(heads.message().find("num_attention_heads (8)"), std::string::npos) << heads;
  model::ModelConfig odd_mlp = c;
  odd_mlp.intermediate_size = 90;
  EXPECT_NE(CheckTensorParallel(odd_mlp, 4).message().find("intermediate_size (90)"),
            std::string::npos);
  EXPECT_EQ(CheckTensorParallel(c, 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorParallelTest, ARanksConfigKeepsGroupedQueryHeadsWithTheirKvHead) {
  const model::ModelConfig c = Config();
  for (int ranks : {1, 2, 4}) {
    for (int rank = 0; rank < ranks; ++rank) {
      const TensorShard s{rank, ranks};
      const model::ModelConfig local = ShardConfig(c, s);
      EXPECT_EQ(local.hidden_size, c.hidden_size);
      EXPECT_EQ(local.num_heads * ranks, c.num_heads);
      EXPECT_EQ(local.intermediate_size * ranks, c.intermediate_size);
      // Local query head j reads local KV head j / group; globally that must be the KV head
      // of global query head rank * heads + j.
      const int64_t group = local.num_heads / local.num_kv_heads;
      ASSERT_EQ(group, c.num_heads / c.num_kv_heads);
      for (int64_t j = 0; j < local.num_heads; ++j) {
        const int64_t global_q = RangeOf(c.num_heads, s).begin + j;
        EXPECT_EQ(RangeOf(c.num_kv_heads, s).begin + j / group, global_q / group);
      }
      // The slices DimsOf gives for the local config are the ones SliceOfWeight cuts.
      for (int p = 0; p < model::kNumProjections; ++p) {
        const auto proj = static_cast<model::Projection>(p);
        const model::ProjectionDims full = model::DimsOf(c, proj), part = model::DimsOf(local, proj);
        const MatrixView w{nullptr, DType::kF32, full.out, full.in};
        const WeightSlice slice = SliceOfWeight(w, proj, s);
        EXPECT_EQ(slice.rows.size(), part.out) << model::ProjectionName(proj);
        EXPECT_EQ(slice.cols.size(), part.in) << model::ProjectionName(proj);
      }
    }
  }
}

// Every projection, with a LoRA pair (and a shrink bias, to check it is added once), split
// over 1, 2 and 4 ranks: column-parallel outputs concatenate, row-parallel ones sum.
TEST(TensorParallelTest, RankSlicesAssembleTheWholeProjection) {
  const model::ModelConfig c = Config();
  std::mt19937 rng(7);
  constexpr int64_t kRows = 3, kRank = 4;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int p = 0; p < model::kNumProjections; ++p) {
      const auto proj = static_cast<model::Projection>(p);
      SCOPED_TRACE(std::string(model::ProjectionName(proj)) + " " + kernels::DTypeName(dtype));
      const model::ProjectionDims dims = model::DimsOf(c, proj);
      Matrix w = Random(dims.out, dims.in, dtype, &rng);
      Matrix s = Random(kRank, dims.in, dtype, &rng);
      Matrix e = Random(kRank, dims.out, dtype, &rng);
      std::vector<float> bias = {0.5f, -0.25f, 1.f, 0.125f};
      const model::LowRank lr{s.view, e.view, bias.data(), 0.75f};
      Matrix x = Random(kRows, dims.in, DType::kF32, &rng);
      const std::vector<double> want = Project(x.values, kRows, w.view, &lr);

      for (int ranks : {1, 2, 4}) {
        std::vector<double> got(want.size(), 0.0);
        for (int rank = 0; rank < ranks; ++rank) {
          const TensorShard shard{rank, ranks};
          const WeightSlice ws = SliceOfWeight(w.view, proj, shard);
          const LowRankSlice ls = SliceOfLowRank(lr, proj, shard);
          std::vector<uint8_t> wb(ws.rows.size() * ws.cols.size() * kernels::DTypeSize(dtype));
          std::vector<uint8_t> sb(kRank * ls.shrink_cols.size() * kernels::DTypeSize(dtype));
          std::vector<uint8_t> eb(kRank * ls.expand_cols.size() * kernels::DTypeSize(dtype));
          CopySubMatrix(w.view, ws.rows, ws.cols, wb.data());
          CopySubMatrix(s.view, {0, kRank}, ls.shrink_cols, sb.data());
          CopySubMatrix(e.view, {0, kRank}, ls.expand_cols, eb.data());
          const MatrixView wl{wb.data(), dtype, ws.rows.size(), ws.cols.size()};
          const model::LowRank lrl{{sb.data(), dtype, kRank, ls.shrink_cols.size()},
                            {eb.data(), dtype, kRank, ls.expand_cols.size()},
                            ls.bias ? bias.data() : nullptr,
                            lr.scale};
          // A rank sees the inputs its slice reads: all of x, or its own columns.
          const std::vector<float> xl = Columns(x.values, kRows, dims.in, ws.cols);
          const std::vector<double> part = Project(xl, kRows, wl, &lrl);
          for (int64_t t = 0; t < kRows; ++t) {
            for (int64_t o = 0; o < ws.rows.size(); ++o) {
              got[t * dims.out + ws.rows.begin + o] += part[t * ws.rows.size() + o];
            }
          }
        }
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_NEAR(got[i], want[i], 1e-9 * (1 + std::abs(want[i])))
              << "ranks " << ranks << " at " << i;
        }
      }
    }
  }
}

// Runs `copies` from src to dst (forward) or back (swapped), as the GPU's 2-D copies do.
void RunCopies(const std::vector<StridedCopy>& copies, bool back, const float* src, float* dst) {
  for (const StridedCopy& c : copies) {
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t from = back ? c.dst_offset + r * c.dst_pitch : c.src_offset + r * c.src_pitch;
      const int64_t to = back ? c.src_offset + r * c.src_pitch : c.dst_offset + r * c.dst_pitch;
      std::copy(src + from, src + from + c.width, dst + to);
    }
  }
}

// A rank's KV heads go into and out of a cache of every head: in its own cache, block b's K
// (and V) of local head j is the whole cache's of head first + j, in every layer; blocks not
// named are untouched; and the ranks' caches together rebuild the whole one.
TEST(TensorParallelTest, RanksMoveTheirKvHeadsThroughACacheOfEveryHead) {
  const kv::KvCacheShape full{2, 5, 4, 4, 3};  // layers, blocks, block tokens, KV heads, head dim
  const int64_t per_head = full.head_dim * full.block_tokens;
  const int64_t total = full.num_layers * full.num_blocks * full.block_elements();
  std::vector<float> whole(total);
  for (int64_t i = 0; i < total; ++i) whole[i] = static_cast<float>(i);
  const std::vector<int32_t> blocks = {3, 0, 1};  // runs [3] and [0, 1]
  auto named = [&](int64_t b) {
    return std::find(blocks.begin(), blocks.end(), b) != blocks.end();
  };
  for (int ranks : {1, 2, 4}) {
    std::vector<float> rebuilt(total, -1.f);
    for (int rank = 0; rank < ranks; ++rank) {
      const TensorShard s{rank, ranks};
      const int64_t heads = full.num_kv_heads / ranks, first = RangeOf(full.num_kv_heads, s).begin;
      const auto copies = KvHeadCopies(full, s, blocks);
      std::vector<float> local(total / ranks, -1.f);
      RunCopies(copies, /*back=*/true, whole.data(), local.data());
      for (int64_t l = 0; l < full.num_layers; ++l) {
        for (int64_t b = 0; b < full.num_blocks; ++b) {
          for (int64_t kv = 0; kv < 2; ++kv) {  // K, then V
            for (int64_t j = 0; j < heads; ++j) {
              for (int64_t e = 0; e < per_head; ++e) {
                const float got =
                    local[((l * full.num_blocks + b) * 2 + kv) * heads * per_head + j * per_head + e];
                const float want = named(b) ? whole[((l * full.num_blocks + b) * 2 + kv) *
                                                        full.num_kv_heads * per_head +
                                                    (first + j) * per_head + e]
                                            : -1.f;
                ASSERT_EQ(got, want) << "ranks " << ranks << " rank " << rank << " layer " << l
                                     << " block " << b << (kv ? " V" : " K") << " head " << j;
              }
            }
          }
        }
      }
      RunCopies(copies, /*back=*/false, local.data(), rebuilt.data());
    }
    for (int64_t l = 0; l < full.num_layers; ++l) {
      for (int64_t b = 0; b < full.num_blocks; ++b) {
        const int64_t at = (l * full.num_blocks + b) * full.block_elements();
        for (int64_t i = 0; i < full.block_elements(); ++i) {
          ASSERT_EQ(rebuilt[at + i], named(b) ? whole[at + i] : -1.f)
              << "ranks " << ranks << " layer " << l << " block " << b << " float " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace preft::backend
