// Backend consistency, op by op: every CUDA kernel against the CPU kernel it mirrors, on
// fresh random inputs each run, with device outputs poisoned (all bits set: NaN) before each
// launch so an unwritten element fails. Labelled `gpu`; skipped where no CUDA device is
// visible. Tolerances: f32 ops to 1e-5 relative; the bf16 GEMM to 1e-2 of Σ|x·w| per output
// (both backends round x to bf16 but sum in different orders).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/engine/sampler.h"
#include "common/kernels/cpu/attention.h"
#include "common/kernels/cpu/linear.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/cpu/low_rank.h"
#include "common/kernels/cpu/ops.h"
#include "common/kernels/cuda/attention.cuh"
#include "common/kernels/cuda/linear.cuh"
#include "common/kernels/cuda/low_rank.cuh"
#include "common/kernels/cuda/ops.cuh"
#include "common/kernels/cuda/runtime.cuh"
#include "common/kernels/cuda/sampling.cuh"
#include "common/kernels/dtype.h"

namespace preft::kernels {
namespace {

#define CUDA_OK(expr)                                                   \
  do {                                                                  \
    const int _e = (expr);                                              \
    ASSERT_EQ(_e, 0) << #expr << ": " << cuda::ErrorString(_e);         \
  } while (0)

// A device copy of a host vector, freed with the test.
template <class T>
class DeviceVec {
 public:
  explicit DeviceVec(const std::vector<T>& host) : n_(host.size()) {
    if (cuda::Malloc(&p_, Bytes()) != 0) p_ = nullptr;
    // Nothing to copy from an empty vector (its data() may be null: a copy would fail, and
    // leave that error for the next launch's status).
    if (p_ != nullptr && n_ > 0) cuda::CopyToDevice(p_, host.data(), n_ * sizeof(T), nullptr);
  }
  explicit DeviceVec(size_t n) : n_(n) {
    if (cuda::Malloc(&p_, Bytes()) != 0) p_ = nullptr;
    Poison();
  }
  ~DeviceVec() {
    if (p_ != nullptr) cuda::Free(p_);
  }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;

  T* get() const { return static_cast<T*>(p_); }
  size_t Bytes() const { return std::max<size_t>(1, n_) * sizeof(T); }
  void Poison() {
    if (p_ != nullptr) cuda::Memset(p_, 0xff, Bytes(), nullptr);
  }
  std::vector<T> ToHost() const {
    std::vector<T> h(n_);
    cuda::StreamSynchronize(nullptr);
    cuda::CopyToHost(h.data(), p_, n_ * sizeof(T), nullptr);
    cuda::StreamSynchronize(nullptr);
    return h;
  }

 private:
  size_t n_;
  void* p_ = nullptr;
};

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  }
  std::vector<float> Random(size_t n, float lo = -1.f, float hi = 1.f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  std::vector<uint16_t> RandomBf16(size_t n) {
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    std::vector<uint16_t> v(n);
    for (uint16_t& b : v) b = F32ToBf16(dist(rng_));
    return v;
  }
  std::mt19937 rng_{std::random_device{}()};
};

// The CPU's low-rank kernels in f32 for the scope, as the CUDA ones compute (with AVX-512-BF16
// the CPU rounds a bf16 adapter's x and z to bf16, for every row).
class F32LowRankOnCpu {
 public:
  F32LowRankOnCpu() { cpu::SetLinearIsaCapForTesting(cpu::LinearIsa::kAvx512); }
  ~F32LowRankOnCpu() { cpu::SetLinearIsaCapForTesting(cpu::LinearIsa::kAmx); }
};

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, double rel) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rel * (1 + std::abs(want[i]))) << "element " << i;
  }
}

TEST_F(CudaOpsTest, GatherRowsRmsNormSiluAddMatchCpu) {
  const int64_t rows = 300, dim = 896, tokens = 37;
  const std::vector<uint16_t> table = RandomBf16(rows * dim);
  std::vector<int32_t> ids(tokens);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng_() % rows);
  std::vector<float> want(tokens * dim);
  cpu::GatherRows(MatrixView{table.data(), DType::kBF16, rows, dim}, ids.data(), tokens,
                  want.data());
  DeviceVec<uint16_t> d_table(table);
  DeviceVec<int32_t> d_ids(ids);
  DeviceVec<float> d_x(tokens * dim);
  CUDA_OK(cuda::GatherRows(d_table.get(), DType::kBF16, dim, d_ids.get(), tokens, d_x.get(),
                           nullptr));
  ExpectNear(d_x.ToHost(), want, 0);

  const std::vector<float> w = Random(dim, 0.5f, 1.5f);
  std::vector<float> normed(tokens * dim);
  cpu::RmsNorm(want.data(), w.data(), tokens, dim, 1e-6f, normed.data());
  DeviceVec<float> d_w(w), d_out(tokens * dim);
  CUDA_OK(cuda::RmsNorm(d_x.get(), d_w.get(), tokens, dim, 1e-6f, d_out.get(), nullptr));
  ExpectNear(d_out.ToHost(), normed, 1e-5);

  const std::vector<float> gate = Random(tokens * dim, -8.f, 8.f), up = Random(tokens * dim);
  std::vector<float> act(tokens * dim);
  cpu::SiluMulSeparate(gate.data(), up.data(), tokens * dim, act.data());
  DeviceVec<float> d_gate(gate), d_up(up), d_act(tokens * dim);
  CUDA_OK(cuda::SiluMulSeparate(d_gate.get(), d_up.get(), tokens * dim, d_act.get(), nullptr));
  ExpectNear(d_act.ToHost(), act, 1e-5);

  std::vector<float> sum = gate;
  cpu::AddInPlace(sum.data(), up.data(), tokens * dim);
  CUDA_OK(cuda::AddInPlace(d_gate.get(), d_up.get(), tokens * dim, nullptr));
  ExpectNear(d_gate.ToHost(), sum, 1e-6);
}

TEST_F(CudaOpsTest, RopeMatchesCpuAtLargePositions) {
  const int64_t tokens = 9, heads = 14, kv_heads = 2, head_dim = 64;
  std::vector<float> inv_freq(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(1e6, -2.0 * i / head_dim));
  }
  std::vector<int32_t> pos(tokens);
  for (int64_t t = 0; t < tokens; ++t) pos[t] = static_cast<int32_t>(rng_() % 100000);
  std::vector<float> q = Random(tokens * heads * head_dim), k = Random(tokens * kv_heads * head_dim);
  DeviceVec<float> d_q(q), d_k(k), d_inv(inv_freq);
  DeviceVec<int32_t> d_pos(pos);
  cpu::ApplyRope(pos.data(), tokens, inv_freq.data(), head_dim, q.data(), heads, k.data(), kv_heads);
  CUDA_OK(cuda::ApplyRope(d_pos.get(), tokens, d_inv.get(), head_dim, d_q.get(), heads, d_k.get(),
                          kv_heads, nullptr));
  ExpectNear(d_q.ToHost(), q, 1e-5);
  ExpectNear(d_k.ToHost(), k, 1e-5);
}

TEST_F(CudaOpsTest, Bf16LinearMatchesCpuWithinBf16Rounding) {
  cuda::Blas* raw = nullptr;
  CUDA_OK(cuda::Blas::Create(nullptr, &raw));
  std::unique_ptr<cuda::Blas> blas(raw);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 896, 896},
                         {7, 128, 896}, {64, 4864, 896}, {33, 896, 4864}, {5, 100, 37}}) {
    const std::vector<float> x = Random(m * k);
    const std::vector<uint16_t> w = RandomBf16(n * k);
    const std::vector<float> bias = Random(n);
    std::vector<float> want(m * n);
    cpu::Linear(x.data(), m, MatrixView{w.data(), DType::kBF16, n, k}, bias.data(), want.data());
    DeviceVec<float> d_x(x), d_bias(bias), d_y(m * n);
    DeviceVec<uint16_t> d_w(w);
    CUDA_OK(blas->Linear(d_x.get(), m, d_w.get(), n, k, d_bias.get(), d_y.get()));
    const std::vector<float> got = d_y.ToHost();
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double mag = std::abs(bias[j]);
        for (int64_t c = 0; c < k; ++c) mag += std::abs(x[i * k + c] * Bf16ToF32(w[j * k + c]));
        ASSERT_NEAR(got[i * n + j], want[i * n + j], 1e-2 * mag)
            << "m=" << m << " n=" << n << " k=" << k << " at " << i << "," << j;
      }
    }
  }
}

// Weights sharing one x (q, k, v): the GEMV kernel (m <= kGemvMaxRows, k a multiple of 8)
// and the cuBLAS path (more rows, or k = 37) agree with the CPU on every output, biased or not.
TEST_F(CudaOpsTest, SharedLinearMatchesCpuOnEveryOutput) {
  cuda::Blas* raw = nullptr;
  CUDA_OK(cuda::Blas::Create(nullptr, &raw));
  std::unique_ptr<cuda::Blas> blas(raw);
  for (auto [m, k] : {std::pair<int64_t, int64_t>{1, 896}, {2, 896}, {3, 4864}, {4, 896},
                      {5, 896}, {33, 4864}, {1, 37}}) {
    const int64_t widths[] = {896, 13, 136};  // 13: a GEMV block spans two outputs
    const std::vector<float> x = Random(m * k);
    DeviceVec<float> d_x(x);
    std::vector<std::vector<uint16_t>> w;
    std::vector<std::vector<float>> bias, want;
    std::vector<std::unique_ptr<DeviceVec<uint16_t>>> d_w;
    std::vector<std::unique_ptr<DeviceVec<float>>> d_bias, d_y;
    std::vector<cuda::LinearOutput> outs;
    for (int o = 0; o < 3; ++o) {
      const int64_t n = widths[o];
      w.push_back(RandomBf16(n * k));
      bias.push_back(o == 1 ? std::vector<float>() : Random(n));
      want.emplace_back(m * n);
      cpu::Linear(x.data(), m, MatrixView{w[o].data(), DType::kBF16, n, k},
                  bias[o].empty() ? nullptr : bias[o].data(), want[o].data());
      d_w.push_back(std::make_unique<DeviceVec<uint16_t>>(w[o]));
      d_bias.push_back(std::make_unique<DeviceVec<float>>(bias[o]));
      d_y.push_back(std::make_unique<DeviceVec<float>>(m * n));
      outs.push_back({d_w[o]->get(), n, bias[o].empty() ? nullptr : d_bias[o]->get(), d_y[o]->get()});
    }
    CUDA_OK(blas->LinearShared(d_x.get(), m, k, outs.data(), 3));
    for (int o = 0; o < 3; ++o) {
      const int64_t n = widths[o];
      const std::vector<float> got = d_y[o]->ToHost();
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double mag = bias[o].empty() ? 0 : std::abs(bias[o][j]);
          for (int64_t c = 0; c < k; ++c) mag += std::abs(x[i * k + c] * Bf16ToF32(w[o][j * k + c]));
          ASSERT_NEAR(got[i * n + j], want[o][i * n + j], 1e-2 * mag)
              << "m=" << m << " k=" << k << " output " << o << " at " << i << "," << j;
        }
      }
    }
  }
}

// Decode rows (one row per adapter), prompt groups, mixed ranks, a bias, an adapter without a
// k pair, and one call that updates q and k (different widths) from the same x.
TEST_F(CudaOpsTest, LowRankAddMatchesCpuForMixedAdapters) {
  const F32LowRankOnCpu f32_reference;
  const int64_t rows = 40, in = 896, q_out = 896, k_out = 128;
  const std::vector<float> x = Random(rows * in);
  std::vector<float> yq = Random(rows * q_out), yk = Random(rows * k_out);
  struct Pair {
    int64_t rank = 0, out = 0;
    std::vector<uint16_t> s, e;
    std::vector<float> bias;
  };
  struct Adapter {
    Pair pair[2];  // table entries 0 (q) and 1 (k)
    std::vector<int32_t> rows;
  };
  std::vector<Adapter> host(6);
  const int64_t ranks[] = {16, 1, 64, 6, 16, 8};
  int32_t next = 0;
  for (int a = 0; a < 6; ++a) {
    for (int e = 0; e < 2; ++e) {
      if (a == 4 && e == 1) continue;  // no k pair
      Pair& p = host[a].pair[e];
      p.rank = ranks[(a + e) % 6];
      p.out = e == 0 ? q_out : k_out;
      p.s = RandomBf16(p.rank * in);
      p.e = RandomBf16(p.rank * p.out);
      if (a == 3 && e == 0) p.bias = Random(p.rank);
    }
    const int count = a < 2 ? 1 : 9;  // two decode rows, then prompt groups
    for (int i = 0; i < count && next < rows; ++i) host[a].rows.push_back(next++);
  }
  std::vector<cpu::LowRankGroup> cpu_groups;
  for (Adapter& a : host) {
    for (Pair& p : a.pair) {
      if (p.rank == 0) continue;
      cpu_groups.push_back({a.rows.data(), static_cast<int64_t>(a.rows.size()),
                            MatrixView{p.s.data(), DType::kBF16, p.rank, in},
                            MatrixView{p.e.data(), DType::kBF16, p.rank, p.out},
                            p.bias.empty() ? nullptr : p.bias.data(), 0.5f,
                            p.out == q_out ? yq.data() : yk.data(), p.out});
    }
  }
  DeviceVec<float> d_x(x), d_yq(yq), d_yk(yk);
  std::vector<std::unique_ptr<DeviceVec<uint16_t>>> weights;
  std::vector<std::unique_ptr<DeviceVec<float>>> biases;
  std::vector<std::unique_ptr<DeviceVec<uint8_t>>> tables;
  std::vector<const cuda::LowRankPair*> table_ptrs;
  std::vector<cuda::LowRankItem> items;
  for (size_t a = 0; a < host.size(); ++a) {
    cuda::LowRankPair table[2];
    for (int e = 0; e < 2; ++e) {
      const Pair& p = host[a].pair[e];
      if (p.rank == 0) continue;
      weights.push_back(std::make_unique<DeviceVec<uint16_t>>(p.s));
      weights.push_back(std::make_unique<DeviceVec<uint16_t>>(p.e));
      const float* bias = nullptr;
      if (!p.bias.empty()) {
        biases.push_back(std::make_unique<DeviceVec<float>>(p.bias));
        bias = biases.back()->get();
      }
      table[e] = {weights[weights.size() - 2]->get(), weights.back()->get(), DType::kBF16,
                  p.rank, in, p.out, bias, 0.5f};
    }
    // Pair tables are PODs: copy their bytes.
    std::vector<uint8_t> bytes(sizeof(table));
    std::memcpy(bytes.data(), table, sizeof(table));
    tables.push_back(std::make_unique<DeviceVec<uint8_t>>(bytes));
    table_ptrs.push_back(reinterpret_cast<const cuda::LowRankPair*>(tables.back()->get()));
    for (int32_t r : host[a].rows) items.push_back({r, static_cast<int32_t>(a)});
  }
  cpu::LowRankAdd(x.data(), in, nullptr, 0, cpu_groups.data(),
                  static_cast<int64_t>(cpu_groups.size()));
  std::vector<uint8_t> tbytes(table_ptrs.size() * sizeof(void*));
  std::memcpy(tbytes.data(), table_ptrs.data(), tbytes.size());
  std::vector<uint8_t> ibytes(items.size() * sizeof(cuda::LowRankItem));
  std::memcpy(ibytes.data(), items.data(), ibytes.size());
  DeviceVec<uint8_t> d_tables(tbytes), d_items(ibytes);
  cuda::LowRankTargets targets;
  targets.target[0] = {0, d_yq.get(), q_out};
  targets.target[1] = {1, d_yk.get(), k_out};
  targets.num_targets = 2;
  CUDA_OK(cuda::LowRankAdd(d_x.get(), in,
                           reinterpret_cast<const cuda::LowRankPair* const*>(d_tables.get()),
                           reinterpret_cast<const cuda::LowRankItem*>(d_items.get()),
                           static_cast<int64_t>(items.size()), targets, nullptr));
  ExpectNear(d_yq.ToHost(), yq, 1e-4);
  ExpectNear(d_yk.ToHost(), yk, 1e-4);
}

// SGMV tiles, in place as DiReFT runs: adapters with 1 to 70 rows (tiles of 32 and a
// remainder), ranks up to kMaxTileRank, a bias, a width that is not a multiple of the chunk.
TEST_F(CudaOpsTest, LowRankAddTilesMatchesCpuInPlace) {
  const F32LowRankOnCpu f32_reference;
  const int64_t d = 900;
  const int row_counts[] = {1, 5, 32, 33, 70};
  const int64_t ranks[] = {16, 64, 4, 64, 16};
  int64_t rows = 0;
  for (int n : row_counts) rows += n;
  std::vector<float> x = Random(rows * d);
  DeviceVec<float> d_x(x);
  struct Adapter {
    std::vector<uint16_t> s, e;
    std::vector<float> bias;
    std::vector<int32_t> rows;
  };
  std::vector<Adapter> host(5);
  std::vector<int32_t> order(rows);
  for (int64_t i = 0; i < rows; ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), rng_);  // an adapter's rows need not be adjacent
  int64_t next = 0;
  for (int a = 0; a < 5; ++a) {
    host[a].s = RandomBf16(ranks[a] * d);
    host[a].e = RandomBf16(ranks[a] * d);
    if (a == 1) host[a].bias = Random(ranks[a]);
    for (int i = 0; i < row_counts[a]; ++i) host[a].rows.push_back(order[next++]);
  }
  std::vector<cpu::LowRankGroup> cpu_groups;
  for (Adapter& a : host) {
    const int64_t r = static_cast<int64_t>(a.s.size()) / d;
    cpu_groups.push_back({a.rows.data(), static_cast<int64_t>(a.rows.size()),
                          MatrixView{a.s.data(), DType::kBF16, r, d},
                          MatrixView{a.e.data(), DType::kBF16, r, d},
                          a.bias.empty() ? nullptr : a.bias.data(), 0.25f});
  }
  std::vector<std::unique_ptr<DeviceVec<uint16_t>>> weights;
  std::vector<std::unique_ptr<DeviceVec<float>>> biases;
  std::vector<std::unique_ptr<DeviceVec<uint8_t>>> tables;
  std::vector<const cuda::LowRankPair*> table_ptrs;
  std::vector<cuda::LowRankItem> items;
  std::vector<cuda::LowRankTile> tiles;
  for (size_t a = 0; a < host.size(); ++a) {
    const Adapter& h = host[a];
    weights.push_back(std::make_unique<DeviceVec<uint16_t>>(h.s));
    weights.push_back(std::make_unique<DeviceVec<uint16_t>>(h.e));
    const float* bias = nullptr;
    if (!h.bias.empty()) {
      biases.push_back(std::make_unique<DeviceVec<float>>(h.bias));
      bias = biases.back()->get();
    }
    const cuda::LowRankPair pair{weights[2 * a]->get(), weights[2 * a + 1]->get(), DType::kBF16,
                                 ranks[a], d, d, bias, 0.25f};
    std::vector<uint8_t> bytes(sizeof(pair));
    std::memcpy(bytes.data(), &pair, sizeof(pair));
    tables.push_back(std::make_unique<DeviceVec<uint8_t>>(bytes));
    table_ptrs.push_back(reinterpret_cast<const cuda::LowRankPair*>(tables.back()->get()));
    for (size_t i = 0; i < h.rows.size(); i += cuda::kTileRows) {
      const size_t count = std::min<size_t>(cuda::kTileRows, h.rows.size() - i);
      tiles.push_back({static_cast<int32_t>(items.size()), static_cast<int32_t>(count)});
      for (size_t j = i; j < i + count; ++j) items.push_back({h.rows[j], static_cast<int32_t>(a)});
    }
  }
  cpu::LowRankAdd(x.data(), d, x.data(), d, cpu_groups.data(),
                  static_cast<int64_t>(cpu_groups.size()));
  auto bytes_of = [](const auto& v) {
    std::vector<uint8_t> b(v.size() * sizeof(v[0]));
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  DeviceVec<uint8_t> d_tables(bytes_of(table_ptrs)), d_items(bytes_of(items)),
      d_tiles(bytes_of(tiles));
  cuda::LowRankTargets targets;
  targets.target[0] = {0, d_x.get(), d};
  targets.num_targets = 1;
  CUDA_OK(cuda::LowRankAddTiles(d_x.get(), d,
                                reinterpret_cast<const cuda::LowRankPair* const*>(d_tables.get()),
                                reinterpret_cast<const cuda::LowRankItem*>(d_items.get()),
                                reinterpret_cast<const cuda::LowRankTile*>(d_tiles.get()),
                                static_cast<int64_t>(tiles.size()), targets, nullptr));
  ExpectNear(d_x.ToHost(), x, 1e-4);
}

// Decode rows and prompt chunks over a shared paged cache, GQA, with and without a window;
// then decode rows alone, which take the flash-decoding kernel (contexts split across blocks
// and merged), for a group of 7 heads of dim 64 and a group of 4 of dim 128; a group of 9
// is past the flash-decoding kernel and takes the per-head kernel.
// The fused kernels give, bit for bit, what the kernels they replace give in sequence: the
// residual add with the norm after it, and RoPE with the KV write (cache and q; each cache
// starts from the same random bytes, so a stray or missing write shows too).
TEST_F(CudaOpsTest, FusedKernelsEqualTheKernelsTheyReplace) {
  const int64_t tokens = 9, dim = 896;
  const std::vector<float> x = Random(tokens * dim, -4.f, 4.f), delta = Random(tokens * dim);
  const std::vector<float> w = Random(dim, 0.5f, 1.5f);
  DeviceVec<float> d_w(w), d_delta(delta), d_x1(x), d_x2(x), d_out1(tokens * dim),
      d_out2(tokens * dim);
  CUDA_OK(cuda::AddInPlace(d_x1.get(), d_delta.get(), tokens * dim, nullptr));
  CUDA_OK(cuda::RmsNorm(d_x1.get(), d_w.get(), tokens, dim, 1e-6f, d_out1.get(), nullptr));
  CUDA_OK(cuda::AddRmsNorm(d_x2.get(), d_delta.get(), d_w.get(), tokens, dim, 1e-6f,
                           d_out2.get(), nullptr));
  EXPECT_EQ(d_x2.ToHost(), d_x1.ToHost());
  EXPECT_EQ(d_out2.ToHost(), d_out1.ToHost());
  std::vector<float> sum = x, normed(tokens * dim);
  cpu::AddInPlace(sum.data(), delta.data(), tokens * dim);
  cpu::RmsNorm(sum.data(), w.data(), tokens, dim, 1e-6f, normed.data());
  ExpectNear(d_out2.ToHost(), normed, 1e-5);

  struct Geometry {
    int64_t heads, kv_heads, hd;
  };
  for (const Geometry g : {Geometry{14, 2, 64}, Geometry{32, 8, 128}}) {
    SCOPED_TRACE("heads " + std::to_string(g.heads) + " head_dim " + std::to_string(g.hd));
    const int64_t bt = 16, blocks = 6, block_stride = 2 * g.kv_heads * bt * g.hd;
    std::vector<float> inv_freq(g.hd / 2);
    for (int64_t i = 0; i < g.hd / 2; ++i) {
      inv_freq[i] = static_cast<float>(std::pow(5e5, -2.0 * i / g.hd));
    }
    std::vector<int32_t> pos(tokens);
    std::vector<int64_t> slots(tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      pos[t] = static_cast<int32_t>(rng_() % 100000);
      slots[t] = t * 7 % (blocks * bt);  // distinct slots across several blocks
    }
    const std::vector<float> q = Random(tokens * g.heads * g.hd);
    const std::vector<float> k = Random(tokens * g.kv_heads * g.hd);
    const std::vector<float> v = Random(tokens * g.kv_heads * g.hd);
    const std::vector<float> cache = Random(blocks * block_stride);
    DeviceVec<float> d_q1(q), d_q2(q), d_k1(k), d_k2(k), d_v(v), d_inv(inv_freq);
    DeviceVec<float> d_cache1(cache), d_cache2(cache);
    DeviceVec<int32_t> d_pos(pos);
    DeviceVec<int64_t> d_slots(slots);
    const cuda::PagedKvLayout layout{nullptr, block_stride, g.kv_heads * g.hd * bt, bt,
                                     g.kv_heads, g.hd};
    CUDA_OK(cuda::ApplyRope(d_pos.get(), tokens, d_inv.get(), g.hd, d_q1.get(), g.heads,
                            d_k1.get(), g.kv_heads, nullptr));
    CUDA_OK(cuda::WriteKv(d_k1.get(), d_v.get(), d_slots.get(), tokens, d_cache1.get(), layout,
                          nullptr));
    CUDA_OK(cuda::RopeWriteKv(d_pos.get(), d_inv.get(), d_q2.get(), g.heads, d_k2.get(),
                              d_v.get(), d_slots.get(), tokens, d_cache2.get(), layout, nullptr));
    EXPECT_EQ(d_q2.ToHost(), d_q1.ToHost());
    EXPECT_EQ(d_cache2.ToHost(), d_cache1.ToHost());
    EXPECT_EQ(d_k2.ToHost(), k);  // left as it was
  }
}

// A bf16 or fp8 cache written on the GPU holds the bytes the CPU writes (Model::WriteKv: bf16
// rounded to nearest even; fp8 divided by its KV head's scale, rounded to nearest even and
// saturated at 448, which values up to 40 / 0.05 reach), in the same layout; RopeWriteKv into
// it equals ApplyRope then WriteKv.
TEST_F(CudaOpsTest, NarrowKvWritesAreTheCpusBytes) {
  const int64_t tokens = 11, kv_heads = 2, hd = 64, heads = 14, bt = 16, blocks = 5;
  const int64_t block_stride = 2 * kv_heads * bt * hd;
  std::vector<int64_t> slots(tokens);
  std::vector<int32_t> pos(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    slots[t] = t * 5 % (blocks * bt);
    pos[t] = static_cast<int32_t>(rng_() % 5000);
  }
  std::vector<float> inv_freq(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(1e4, -2.0 * i / hd));
  const std::vector<float> k = Random(tokens * kv_heads * hd, -40.f, 40.f);
  const std::vector<float> v = Random(tokens * kv_heads * hd, -40.f, 40.f);
  const std::vector<float> q = Random(tokens * heads * hd);
  const std::vector<float> k_scales = {0.05f, 0.13f}, v_scales = {0.11f, 0.07f};
  DeviceVec<float> d_ks(k_scales), d_vs(v_scales);
  auto check = [&](auto element, KvDtype dtype, auto encode) {
    using T = decltype(element);
    SCOPED_TRACE(std::string(KvDtypeName(dtype)));
    std::vector<T> want(blocks * block_stride, static_cast<T>(~T{0}));  // DeviceVec's poison
    for (int64_t t = 0; t < tokens; ++t) {
      T* block = want.data() + slots[t] / bt * block_stride;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t d = 0; d < hd; ++d) {
          block[(h * hd + d) * bt + slots[t] % bt] =
              encode(k[(t * kv_heads + h) * hd + d], k_scales[h]);
          block[kv_heads * bt * hd + (h * bt + slots[t] % bt) * hd + d] =
              encode(v[(t * kv_heads + h) * hd + d], v_scales[h]);
        }
      }
    }
    DeviceVec<float> d_k(k), d_k2(k), d_v(v), d_q1(q), d_q2(q), d_inv(inv_freq);
    DeviceVec<int64_t> d_slots(slots);
    DeviceVec<int32_t> d_pos(pos);
    DeviceVec<T> d_cache(want.size()), d_cache1(want.size()), d_cache2(want.size());
    const cuda::PagedKvLayout layout{nullptr, block_stride, kv_heads * hd * bt, bt, kv_heads,
                                     hd,      dtype,        d_ks.get(),         d_vs.get()};
    CUDA_OK(cuda::WriteKv(d_k.get(), d_v.get(), d_slots.get(), tokens, d_cache.get(), layout,
                          nullptr));
    EXPECT_EQ(d_cache.ToHost(), want);  // the poison where no token was written
    CUDA_OK(cuda::ApplyRope(d_pos.get(), tokens, d_inv.get(), hd, d_q1.get(), heads, d_k.get(),
                            kv_heads, nullptr));
    CUDA_OK(cuda::WriteKv(d_k.get(), d_v.get(), d_slots.get(), tokens, d_cache1.get(), layout,
                          nullptr));
    CUDA_OK(cuda::RopeWriteKv(d_pos.get(), d_inv.get(), d_q2.get(), heads, d_k2.get(), d_v.get(),
                              d_slots.get(), tokens, d_cache2.get(), layout, nullptr));
    EXPECT_EQ(d_cache2.ToHost(), d_cache1.ToHost());
    EXPECT_EQ(d_q2.ToHost(), d_q1.ToHost());
  };
  check(uint16_t{}, KvDtype::kBF16, [](float x, float) { return F32ToBf16(x); });
  check(uint8_t{}, KvDtype::kFp8E4M3, [](float x, float s) { return F32ToFp8E4M3(x / s); });
}

TEST_F(CudaOpsTest, PagedAttentionMatchesCpu) {
  struct Geometry {
    int64_t heads, kv_heads, hd;
  };
  struct Seq {
    int64_t num_new, context_len;
    std::vector<int32_t> table;
  };
  const int64_t bt = 16, blocks = 40;
  const std::vector<std::vector<Seq>> sets = {
      {{1, 1, {}}, {1, 200, {}}, {7, 7, {}}, {16, 300, {}}, {1, 17, {}}},
      {{1, 1, {}}, {1, 200, {}}, {1, 16, {}}, {1, 300, {}}, {1, 17, {}}, {1, 49, {}}}};
  for (const KvDtype dtype : {KvDtype::kF32, KvDtype::kBF16, KvDtype::kFp8E4M3})
  for (const Geometry g : {Geometry{14, 2, 64}, Geometry{32, 8, 128}, Geometry{18, 2, 64}}) {
    SCOPED_TRACE(std::string("KV ") + std::string(KvDtypeName(dtype)));
    const int64_t heads = g.heads, kv_heads = g.kv_heads, hd = g.hd;
    const int64_t block_stride = 2 * kv_heads * bt * hd;
    // Both devices read the same cache: f32, bf16 or fp8 (what each widens exactly, fp8 then
    // times its KV head's scale).
    const std::vector<float> cache_f32 = Random(blocks * block_stride);
    std::vector<uint16_t> cache_bf16(cache_f32.size());
    std::vector<uint8_t> cache_fp8(cache_f32.size());
    for (size_t i = 0; i < cache_f32.size(); ++i) {
      cache_bf16[i] = F32ToBf16(cache_f32[i]);
      cache_fp8[i] = F32ToFp8E4M3(cache_f32[i] * 100.f);
    }
    std::vector<float> k_scales(kv_heads), v_scales(kv_heads);
    for (int64_t h = 0; h < kv_heads; ++h) {
      k_scales[h] = 0.01f + 0.001f * static_cast<float>(h);
      v_scales[h] = 0.013f - 0.001f * static_cast<float>(h);
    }
    DeviceVec<float> d_f32(cache_f32), d_ks(k_scales), d_vs(v_scales);
    DeviceVec<uint16_t> d_bf16(cache_bf16);
    DeviceVec<uint8_t> d_fp8(cache_fp8);
    const void* cache = dtype == KvDtype::kF32    ? static_cast<const void*>(cache_f32.data())
                        : dtype == KvDtype::kBF16 ? static_cast<const void*>(cache_bf16.data())
                                                  : cache_fp8.data();
    const void* d_cache = dtype == KvDtype::kF32    ? static_cast<const void*>(d_f32.get())
                          : dtype == KvDtype::kBF16 ? static_cast<const void*>(d_bf16.get())
                                                    : d_fp8.get();
    for (std::vector<Seq> seqs : sets) {
      for (Seq& s : seqs) {
        for (int64_t b = 0; b * bt < s.context_len; ++b) {
          s.table.push_back(static_cast<int32_t>(rng_() % blocks));
        }
      }
      for (const int64_t window : {int64_t{0}, int64_t{50}}) {
        cpu::PagedKvLayout layout{cache, block_stride,    kv_heads * hd * bt, bt,
                                  kv_heads, hd, dtype, k_scales.data(), v_scales.data()};
        cuda::PagedKvLayout dlayout{d_cache, block_stride, kv_heads * hd * bt, bt,
                                    kv_heads, hd,          dtype,              d_ks.get(),
                                    d_vs.get()};
        std::vector<std::vector<float>> q, out;
        std::vector<std::unique_ptr<DeviceVec<float>>> dq, dout;
        std::vector<std::unique_ptr<DeviceVec<int32_t>>> dtab;
        std::vector<cpu::AttentionSeq> cseqs;
        std::vector<cuda::AttentionSeq> gseqs;
        int64_t max_new = 0;
        for (const Seq& s : seqs) {
          q.push_back(Random(s.num_new * heads * hd));
          out.emplace_back(s.num_new * heads * hd);
          dq.push_back(std::make_unique<DeviceVec<float>>(q.back()));
          dout.push_back(std::make_unique<DeviceVec<float>>(s.num_new * heads * hd));
          dtab.push_back(std::make_unique<DeviceVec<int32_t>>(s.table));
          cseqs.push_back({q.back().data(), out.back().data(), s.table.data(), s.num_new, s.context_len});
          gseqs.push_back({dq.back()->get(), dout.back()->get(), dtab.back()->get(), s.num_new,
                           s.context_len});
          max_new = std::max(max_new, s.num_new);
        }
        const float scale = 1.f / std::sqrt(static_cast<float>(hd));
        const int64_t n = static_cast<int64_t>(gseqs.size());
        cpu::PagedAttention(cseqs.data(), n, layout, heads, scale, window);
        std::vector<uint8_t> sbytes(gseqs.size() * sizeof(cuda::AttentionSeq));
        std::memcpy(sbytes.data(), gseqs.data(), sbytes.size());
        DeviceVec<uint8_t> d_seqs(sbytes);
        const int64_t ws = cuda::AttentionWorkspaceFloats(n, max_new, dlayout, heads);
        if (max_new == 1 && heads / kv_heads <= 8) {
          EXPECT_GT(ws, 0) << "decode rows this short should be split";
        }
        DeviceVec<float> d_ws(static_cast<size_t>(ws));
        CUDA_OK(cuda::PagedAttention(reinterpret_cast<const cuda::AttentionSeq*>(d_seqs.get()), n,
                                     max_new, dlayout, heads, scale, window,
                                     ws > 0 ? d_ws.get() : nullptr, nullptr));
        for (size_t i = 0; i < seqs.size(); ++i) {
          SCOPED_TRACE("heads " + std::to_string(heads) + " sequence " + std::to_string(i) +
                       " of " + std::to_string(n) + " window " + std::to_string(window));
          ExpectNear(dout[i]->ToHost(), out[i], 1e-4);
        }
      }
    }
  }
}

// Seeded sampling on the device picks the CPU sampler's token for every mix of temperature,
// top-k, top-p and min-p (and greedy), over logits with ties.
TEST_F(CudaOpsTest, SampleRowsMatchesCpuSampler) {
  const int64_t vocab = 5003;
  struct Params {
    float temperature, top_p, min_p;
    int32_t top_k;
  };
  const Params params[] = {{0.f, 1.f, 0.f, 0},      {0.7f, 1.f, 0.f, 0},   {1.f, 1.f, 0.f, 5},
                           {1.3f, 0.9f, 0.f, 0},    {0.8f, 0.8f, 0.05f, 50}, {1.f, 1.f, 0.1f, 0},
                           {1.f, 1.f, 0.f, 100000}, {1.f, 1e-6f, 0.f, 0},  {2.f, 0.5f, 0.f, 1}};
  const int64_t rows = 9 * 8;
  std::vector<float> logits = Random(rows * vocab, -6.f, 6.f);
  for (int64_t r = 0; r < rows; ++r) {  // ties: a few copies of the row's best value
    float* row = &logits[r * vocab];
    const float best = *std::max_element(row, row + vocab);
    for (int i = 0; i < 3; ++i) row[rng_() % vocab] = best;
  }
  std::vector<cuda::SampleSpec> specs(rows);
  std::vector<int32_t> want(rows);
  std::vector<std::pair<float, int32_t>> scratch;
  for (int64_t r = 0; r < rows; ++r) {
    const Params& p = params[r % 9];
    specs[r] = {p.temperature, p.top_p, p.min_p, p.top_k, rng_(), rng_() % 1000};
    engine::SamplingParams sp;
    sp.temperature = p.temperature;
    sp.top_p = p.top_p;
    sp.min_p = p.min_p;
    sp.top_k = p.top_k;
    want[r] = engine::SampleToken(&logits[r * vocab], vocab, sp, specs[r].seed, specs[r].step,
                                  &scratch);
  }
  std::vector<uint8_t> spec_bytes(rows * sizeof(cuda::SampleSpec));
  std::memcpy(spec_bytes.data(), specs.data(), spec_bytes.size());
  DeviceVec<float> d_logits(logits);
  DeviceVec<uint8_t> d_specs(spec_bytes);
  DeviceVec<int32_t> d_tokens(rows);
  const size_t ws = cuda::SampleWorkspaceBytes(rows, vocab);
  DeviceVec<uint8_t> d_ws(ws);
  CUDA_OK(cuda::SampleRows(d_logits.get(), rows, vocab,
                           reinterpret_cast<const cuda::SampleSpec*>(d_specs.get()),
                           d_tokens.get(), d_ws.get(), ws, nullptr));
  const std::vector<int32_t> got = d_tokens.ToHost();
  for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(got[r], want[r]) << "row " << r << " params " << r % 9;
}

}  // namespace
}  // namespace preft::kernels
