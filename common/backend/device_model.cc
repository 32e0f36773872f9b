#include "common/backend/device_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/attention.cuh"
#include "common/kernels/cuda/linear.cuh"
#include "common/kernels/cuda/ops.cuh"
#include "common/kernels/cuda/runtime.cuh"
#include "common/kernels/cuda/sampling.cuh"
#include "common/kernels/dtype.h"
#include "common/model/rope.h"


namespace preft::backend {
namespace {

namespace cuda = kernels::cuda;
using kernels::DType;

}  // namespace

// The masked rows of one adapter kind (LoRA or DiReFT) in a batch, laid out for the kernels:
// items sorted by adapter, first the rows for the per-row kernel (decode rows: BGMV), then
// the rows of adapters with kMinTileRows or more, which go in tiles (prompt chunks: SGMV).
class DeviceModel::LowRankWork {
 public:
  static constexpr size_t kMinTileRows = 4;

  // Returns the adapter's index, adding it on first sight.
  int32_t Adapter(const DeviceAdapter* a) {
    auto [it, added] = index_.try_emplace(a, static_cast<int32_t>(tables_.size()));
    if (added) {
      tables_.push_back(a->table());
      tileable_.push_back(a->max_rank() <= cuda::kMaxTileRank);
      rows_.emplace_back();
    }
    return it->second;
  }
  void AddRow(int32_t adapter, int32_t row) { rows_[adapter].push_back(row); }
  bool empty() const { return items_.empty(); }
  // Appends what fixes the kernels' launch arguments and the metadata layout (after Plan).
  void AppendShape(std::vector<int64_t>* key) const {
    key->insert(key->end(), {num_rows_, static_cast<int64_t>(items_.size()),
                             static_cast<int64_t>(tiles_.size()),
                             static_cast<int64_t>(tables_.size())});
  }

  // Orders the items and cuts the tiles; then plans their place in the metadata.
  void Plan(Placer* plan) {
    auto tiled = [&](size_t a) { return tileable_[a] && rows_[a].size() >= kMinTileRows; };
    for (size_t a = 0; a < rows_.size(); ++a) {
      if (!tiled(a)) {
        for (int32_t r : rows_[a]) items_.push_back({r, static_cast<int32_t>(a)});
      }
    }
    num_rows_ = static_cast<int64_t>(items_.size());
    for (size_t a = 0; a < rows_.size(); ++a) {
      if (!tiled(a)) continue;
      for (size_t i = 0; i < rows_[a].size(); i += cuda::kTileRows) {
        const size_t count = std::min<size_t>(cuda::kTileRows, rows_[a].size() - i);
        tiles_.push_back({static_cast<int32_t>(items_.size()), static_cast<int32_t>(count)});
        for (size_t j = i; j < i + count; ++j) items_.push_back({rows_[a][j], static_cast<int32_t>(a)});
      }
    }
    items_at_ = plan->Place(items_.size() * sizeof(cuda::LowRankItem));
    tables_at_ = plan->Place(tables_.size() * sizeof(void*));
    tiles_at_ = plan->Place(tiles_.size() * sizeof(cuda::LowRankTile));
  }
  // Copies them into the host image of the metadata whose device copy starts at `device`.
  void Fill(uint8_t* host, const DeviceBuffer& device) {
    auto put = [&](size_t at, const auto& v) {
      if (!v.empty()) std::memcpy(host + at, v.data(), v.size() * sizeof(v[0]));
    };
    put(items_at_, items_);
    put(tables_at_, tables_);
    put(tiles_at_, tiles_);
    items_dev_ = device.as<cuda::LowRankItem>(items_at_);
    tables_dev_ = device.as<const cuda::LowRankPair*>(tables_at_);
    tiles_dev_ = device.as<cuda::LowRankTile>(tiles_at_);
  }
  // Adds every row's update for `targets` (both kernels; in place when a target's y is x).
  absl::Status Launch(const float* x, int64_t x_stride, const cuda::LowRankTargets& targets,
                      void* stream) const {
    if (items_.empty()) return absl::OkStatus();
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::LowRankAdd(x, x_stride, tables_dev_, items_dev_, num_rows_,
                                                targets, stream),
                               "low-rank rows"));
    return CudaStatus(cuda::LowRankAddTiles(x, x_stride, tables_dev_, items_dev_, tiles_dev_,
                                      static_cast<int64_t>(tiles_.size()), targets, stream),
                "low-rank tiles");
  }

 private:
  absl::flat_hash_map<const DeviceAdapter*, int32_t> index_;
  std::vector<const cuda::LowRankPair*> tables_;
  std::vector<bool> tileable_;
  std::vector<std::vector<int32_t>> rows_;
  std::vector<cuda::LowRankItem> items_;
  std::vector<cuda::LowRankTile> tiles_;
  int64_t num_rows_ = 0;
  size_t items_at_ = 0, tables_at_ = 0, tiles_at_ = 0;
  const cuda::LowRankItem* items_dev_ = nullptr;
  const cuda::LowRankPair* const* tables_dev_ = nullptr;
  const cuda::LowRankTile* tiles_dev_ = nullptr;
};


struct DeviceModel::Meta {
  size_t tokens = 0, positions = 0, slots = 0, logit_rows = 0, block_tables = 0, seqs = 0;
};

DeviceModel::~DeviceModel() {
  ClearGraphs();
  delete blas_;
  if (stream_ != nullptr) {
    cuda::StreamSynchronize(stream_);
    cuda::StreamDestroy(stream_);
  }
}

kv::KvCacheShape DeviceModel::CacheShape(int64_t num_blocks, int64_t block_tokens,
                                         kv::KvDtype dtype) const {
  return {config_.num_layers, num_blocks,       block_tokens, config_.num_kv_heads,
          config_.head_dim,   dtype};
}

// Plans and allocates the weights (the layout Upload copies into and Random fills), the
// stream and the cuBLAS handle. lm_head shares the embedding when tied. Under tensor
// parallelism the matrices are the rank's slices, and o's bias (added to a partial sum) is
// rank 0's alone.
absl::Status DeviceModel::Init(const model::ModelConfig& full, const TensorShard& shard,
                               cuda::Collective* collective) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  PREFT_RETURN_IF_ERROR(CheckTensorParallel(full, shard.ranks));
  if (!shard.whole() && collective == nullptr) {
    return absl::InvalidArgumentError("a tensor-parallel rank needs its group's collective");
  }
  full_config_ = full;
  config_ = ShardConfig(full, shard);
  shard_ = shard;
  collective_ = shard.whole() ? nullptr : collective;
  const model::ModelConfig& c = config_;
  const int64_t d = c.hidden_size, q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  Placer plan;
  const size_t bf = sizeof(uint16_t), f = sizeof(float);
  const size_t embed_at = plan.Place(c.vocab_size * d * bf);
  const size_t head_at = c.tie_word_embeddings ? embed_at : plan.Place(c.vocab_size * d * bf);
  struct LayerAt {
    size_t m[model::kNumProjections];
    size_t qb = 0, kb = 0, vb = 0, ob = 0, n1 = 0, n2 = 0, ks = 0, vs = 0;
  };
  std::vector<LayerAt> at(c.num_layers);
  for (LayerAt& l : at) {
    for (int p = 0; p < model::kNumProjections; ++p) {
      const auto [in, out] = model::DimsOf(c, static_cast<model::Projection>(p));
      l.m[p] = plan.Place(in * out * bf);
    }
  }
  const bool o_bias = c.attention_bias && c.architecture == model::Architecture::kLlama && shard.rank == 0;
  for (LayerAt& l : at) {
    if (c.attention_bias) {
      l.qb = plan.Place(q_out * f);
      l.kb = plan.Place(kv_out * f);
      l.vb = plan.Place(kv_out * f);
      if (o_bias) l.ob = plan.Place(d * f);
    }
    l.n1 = plan.Place(d * f);
    l.n2 = plan.Place(d * f);
    l.ks = plan.Place(c.num_kv_heads * f);
    l.vs = plan.Place(c.num_kv_heads * f);
  }
  const size_t norm_at = plan.Place(d * f);
  const size_t freq_at = plan.Place(c.head_dim / 2 * f);
  PREFT_ASSIGN_OR_RETURN(weights_, DeviceBuffer::Allocate(plan.size()));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::Memset(weights_.get(), 0, weights_.size(), nullptr), "memset"));
  embed_ = weights_.as<uint16_t>(embed_at);
  lm_head_ = weights_.as<uint16_t>(head_at);
  final_norm_ = weights_.as<float>(norm_at);
  inv_freq_ = weights_.as<float>(freq_at);
  layers_.resize(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const LayerAt& l = at[i];
    DeviceLayer& dl = layers_[i];
    const uint16_t** m[model::kNumProjections] = {&dl.q, &dl.k, &dl.v, &dl.o, &dl.gate, &dl.up, &dl.down};
    for (int p = 0; p < model::kNumProjections; ++p) *m[p] = weights_.as<uint16_t>(l.m[p]);
    dl.q_bias = c.attention_bias ? weights_.as<float>(l.qb) : nullptr;
    dl.k_bias = c.attention_bias ? weights_.as<float>(l.kb) : nullptr;
    dl.v_bias = c.attention_bias ? weights_.as<float>(l.vb) : nullptr;
    dl.o_bias = o_bias ? weights_.as<float>(l.ob) : nullptr;
    dl.input_norm = weights_.as<float>(l.n1);
    dl.post_attention_norm = weights_.as<float>(l.n2);
    dl.k_scale = weights_.as<float>(l.ks);
    dl.v_scale = weights_.as<float>(l.vs);
    const std::vector<float> ones(c.num_kv_heads, 1.f);  // Upload copies the checkpoint's
    for (const float* scale : {dl.k_scale, dl.v_scale}) {
      PREFT_RETURN_IF_ERROR(CudaStatus(
          cuda::CopyToDevice(const_cast<float*>(scale), ones.data(), ones.size() * f, nullptr),
          "copy"));
    }
  }
  const std::vector<float> inv_freq = model::RopeInverseFrequencies(c);
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(const_cast<float*>(inv_freq_), inv_freq.data(),
                                                inv_freq.size() * f, nullptr),
                             "copy"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamCreate(&stream_), "stream"));
  return CudaStatus(cuda::Blas::Create(stream_, &blas_), "cuBLAS handle");
}

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::Upload(const model::Model& host,
                                                                const TensorShard& shard,
                                                                cuda::Collective* collective) {
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  model::ModelConfig c = host.config();
  c.tie_word_embeddings = host.lm_head().data == host.embed().data;
  PREFT_RETURN_IF_ERROR(m->Init(c, shard, collective));
  // Matrices go as bf16: straight from the mapping, or converted in chunks.
  std::vector<uint16_t> chunk;
  auto matrix = [&](const uint16_t* dst, const kernels::MatrixView& v) -> absl::Status {
    const size_t n = v.rows * v.cols;
    auto* out = const_cast<uint16_t*>(dst);
    if (v.dtype == DType::kBF16) {
      PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(out, v.data, n * 2, nullptr), "copy"));
      return CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize");
    }
    constexpr size_t kChunk = size_t{1} << 22;
    chunk.resize(std::min(n, kChunk));
    for (size_t at = 0; at < n; at += kChunk) {
      const size_t len = std::min(kChunk, n - at);
      for (size_t i = 0; i < len; ++i) chunk[i] = kernels::F32ToBf16(kernels::LoadAsF32(v.data, v.dtype, at + i));
      PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(out + at, chunk.data(), len * 2, nullptr), "copy"));
      PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize"));
    }
    return absl::OkStatus();
  };
  // A projection's weight: the rank's slice of it, cut on the host first.
  std::vector<uint8_t> slice;
  auto projection = [&](const uint16_t* dst, const kernels::MatrixView& v,
                        model::Projection p) -> absl::Status {
    if (shard.whole()) return matrix(dst, v);
    const WeightSlice ws = SliceOfWeight(v, p, shard);
    slice.resize(ws.rows.size() * ws.cols.size() * kernels::DTypeSize(v.dtype));
    CopySubMatrix(v, ws.rows, ws.cols, slice.data());
    return matrix(dst, {slice.data(), v.dtype, ws.rows.size(), ws.cols.size()});
  };
  auto floats = [&](const float* dst, const std::vector<float>& v) -> absl::Status {
    if (dst == nullptr || v.empty()) return absl::OkStatus();
    return CudaStatus(cuda::CopyToDevice(const_cast<float*>(dst), v.data(), v.size() * sizeof(float),
                                   nullptr),
                "copy");
  };
  // A column-parallel projection's bias: the rank's outputs.
  auto bias = [&](const float* dst, const std::vector<float>& v) -> absl::Status {
    if (dst == nullptr || v.empty() || shard.whole()) return floats(dst, v);
    const ShardRange r = RangeOf(static_cast<int64_t>(v.size()), shard);
    return floats(dst, std::vector<float>(v.begin() + r.begin, v.begin() + r.end));
  };
  PREFT_RETURN_IF_ERROR(matrix(m->embed_, host.embed()));
  if (!c.tie_word_embeddings) PREFT_RETURN_IF_ERROR(matrix(m->lm_head_, host.lm_head()));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const model::Model::LayerWeights& hl = host.layer(i);
    const DeviceLayer& dl = m->layers_[i];
    const uint16_t* dst[model::kNumProjections] = {dl.q, dl.k, dl.v, dl.o, dl.gate, dl.up, dl.down};
    const kernels::MatrixView* src[model::kNumProjections] = {&hl.q,    &hl.k,  &hl.v,   &hl.o,
                                                       &hl.gate, &hl.up, &hl.down};
    for (int p = 0; p < model::kNumProjections; ++p) {
      PREFT_RETURN_IF_ERROR(projection(dst[p], *src[p], static_cast<model::Projection>(p)));
    }
    PREFT_RETURN_IF_ERROR(bias(dl.q_bias, hl.q_bias));
    PREFT_RETURN_IF_ERROR(bias(dl.k_bias, hl.k_bias));
    PREFT_RETURN_IF_ERROR(bias(dl.v_bias, hl.v_bias));
    PREFT_RETURN_IF_ERROR(floats(dl.o_bias, hl.o_bias));  // rank 0's alone
    PREFT_RETURN_IF_ERROR(floats(dl.input_norm, hl.input_norm));
    PREFT_RETURN_IF_ERROR(floats(dl.post_attention_norm, hl.post_attention_norm));
    // The rank's KV heads' scales (one per head: RangeOf over heads, as the biases over rows).
    for (const auto& [dst, src] : {std::pair{dl.k_scale, &hl.k_scale}, {dl.v_scale, &hl.v_scale}}) {
      const ShardRange r = RangeOf(static_cast<int64_t>(src->size()), shard);
      PREFT_RETURN_IF_ERROR(floats(dst, std::vector<float>(src->begin() + r.begin, src->begin() + r.end)));
    }
  }
  PREFT_RETURN_IF_ERROR(floats(m->final_norm_, host.final_norm()));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize"));
  return m;
}

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::Random(const model::ModelConfig& full,
                                                                uint64_t seed,
                                                                const TensorShard& shard,
                                                                cuda::Collective* collective) {
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  PREFT_RETURN_IF_ERROR(m->Init(full, shard, collective));
  const model::ModelConfig& c = m->config_;  // the rank's shapes
  uint64_t stream_id = (seed + shard.rank * 0x51ed27ull) * 0x9e3779b97f4a7c15ull;
  auto fill = [&](const uint16_t* dst, int64_t in, int64_t out, double std) {
    return CudaStatus(cuda::FillRandomBf16(const_cast<uint16_t*>(dst), in * out, ++stream_id,
                                     UniformBound(std), nullptr),
                "fill");
  };
  const int64_t d = c.hidden_size;
  PREFT_RETURN_IF_ERROR(fill(m->embed_, c.vocab_size, d, 2.5 / std::sqrt(d)));
  if (!c.tie_word_embeddings) PREFT_RETURN_IF_ERROR(fill(m->lm_head_, c.vocab_size, d, 2.5 / std::sqrt(d)));
  const std::vector<float> ones(std::max(d, int64_t{1}), 1.f);
  for (const DeviceLayer& l : m->layers_) {
    const uint16_t* mats[model::kNumProjections] = {l.q, l.k, l.v, l.o, l.gate, l.up, l.down};
    for (int p = 0; p < model::kNumProjections; ++p) {
      const auto [in, out] = model::DimsOf(c, static_cast<model::Projection>(p));
      // Fan-in scaled by the whole projection's inputs, as the unsharded model is.
      const int64_t fan_in = model::DimsOf(full, static_cast<model::Projection>(p)).in;
      PREFT_RETURN_IF_ERROR(fill(mats[p], in, out, 1.0 / std::sqrt(fan_in)));
    }
    for (const float* norm : {l.input_norm, l.post_attention_norm}) {
      PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(const_cast<float*>(norm), ones.data(),
                                                    d * sizeof(float), nullptr),
                                 "copy"));
    }
  }
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(const_cast<float*>(m->final_norm_), ones.data(),
                                                d * sizeof(float), nullptr),
                             "copy"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize"));
  return m;
}

absl::Status DeviceModel::EnsureScratch(int64_t tokens, int64_t rows) {
  if (tokens <= scratch_tokens_ && rows <= scratch_rows_) return absl::OkStatus();
  const model::ModelConfig& c = config_;
  tokens = std::max(tokens, scratch_tokens_);
  rows = std::max(rows, scratch_rows_);
  const int64_t d = c.hidden_size, q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim, inter = c.intermediate_size;
  Placer plan;
  const size_t f = sizeof(float);
  const size_t x = plan.Place(tokens * d * f), h = plan.Place(tokens * d * f);
  const size_t tmp = plan.Place(tokens * d * f);
  const size_t q = plan.Place(tokens * q_out * f), attn = plan.Place(tokens * q_out * f);
  const size_t k = plan.Place(tokens * kv_out * f), v = plan.Place(tokens * kv_out * f);
  const size_t gate = plan.Place(tokens * inter * f), up = plan.Place(tokens * inter * f);
  const size_t last = plan.Place(rows * d * f), logits = plan.Place(rows * c.vocab_size * f);
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(stream_), "synchronize"));
  scratch_ = DeviceBuffer();
  PREFT_ASSIGN_OR_RETURN(scratch_, DeviceBuffer::Allocate(plan.size()));
  x_ = scratch_.as<float>(x);
  h_ = scratch_.as<float>(h);
  tmp_ = scratch_.as<float>(tmp);
  q_ = scratch_.as<float>(q);
  attn_ = scratch_.as<float>(attn);
  k_ = scratch_.as<float>(k);
  v_ = scratch_.as<float>(v);
  gate_ = scratch_.as<float>(gate);
  up_ = scratch_.as<float>(up);
  last_ = scratch_.as<float>(last);
  logits_ = scratch_.as<float>(logits);
  scratch_tokens_ = tokens;
  scratch_rows_ = rows;
  return absl::OkStatus();
}

absl::Status DeviceModel::Run(const model::ForwardBatch& batch, DeviceKvCache* cache,
                              DeviceAdapterSlots* adapters) {
  bool agreed = false;
  auto agree = [&](absl::Status mine) {
    agreed = true;
    return agree_ ? agree_(mine) : mine;
  };
  absl::Status ran = RunStep(batch, cache, adapters, agree);
  if (!agreed) agree(ran).IgnoreError();  // the other ranks learn of this rank's failure
  return ran;
}

absl::Status DeviceModel::RunStep(const model::ForwardBatch& batch, DeviceKvCache* cache,
                                  DeviceAdapterSlots* adapters,
                                  const std::function<absl::Status(absl::Status)>& agree) {
  const model::ModelConfig& c = config_;
  const kv::KvCacheShape& cs = cache->shape();
  PREFT_RETURN_IF_ERROR(model::CheckBatchFits(c, cs, batch));
  const int64_t T = batch.num_tokens(), R = static_cast<int64_t>(batch.logit_rows.size());
  const int64_t S = static_cast<int64_t>(batch.sequences.size());
  const int64_t d = c.hidden_size, hd = c.head_dim, inter = c.intermediate_size;
  const int64_t q_out = c.num_heads * hd, bt = cs.block_tokens;
  PREFT_RETURN_IF_ERROR(EnsureScratch(T, R));

  // Adapters: one table per distinct adapter, one item per masked row. The slots keep this
  // step's copies until the next step begins.
  std::vector<const model::AdapterWeights*> used;
  {
    absl::flat_hash_set<const model::AdapterWeights*> seen;
    for (const model::ForwardBatch::Sequence& s : batch.sequences) {
      if (s.adapter != nullptr && seen.insert(s.adapter).second) {
        PREFT_RETURN_IF_ERROR(model::CheckAdapterFits(full_config_, *s.adapter));
        used.push_back(s.adapter);
      }
    }
  }
  adapters->BeginStep(used);
  // Uploads run on their own stream: this step's kernels wait (on the device) for the copies
  // of its adapters. Outside any graph capture, so a replayed graph is ordered after them.
  absl::flat_hash_map<const model::AdapterWeights*, const DeviceAdapter*> on_device;
  for (const model::AdapterWeights* a : used) {
    PREFT_ASSIGN_OR_RETURN(const DeviceAdapter* da, adapters->Get(a));
    if (da->ready_event() != nullptr) {
      PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamWaitEvent(stream_, da->ready_event()), "upload wait"));
    }
    on_device[a] = da;
  }
  LowRankWork lora, direft;
  int64_t total_blocks = 0;
  {
    int64_t t = 0;
    for (const model::ForwardBatch::Sequence& s : batch.sequences) {
      total_blocks += s.num_blocks;
      if (s.adapter != nullptr) {
        const DeviceAdapter* da = on_device.at(s.adapter);
        LowRankWork& work = s.adapter->kind() == model::AdapterKind::kLora ? lora : direft;
        const int32_t a = work.Adapter(da);
        for (int64_t i = t; i < t + s.num_new; ++i) {
          if (batch.adapter_mask[i]) work.AddRow(a, static_cast<int32_t>(i));
        }
      }
      t += s.num_new;
    }
  }

  // Metadata: plan, size the device copy, then fill the host image with device addresses.
  // The block tables go last: every address a kernel takes as an argument then depends on
  // the step's shape alone, not on how many blocks its sequences hold, so a decode graph
  // serves every step of its shape (with the table size in the key, a batch whose sequences
  // cross block boundaries at different steps recorded a new graph almost every step).
  Meta at;
  Placer plan;
  at.tokens = plan.Place(T * sizeof(int32_t));
  at.positions = plan.Place(T * sizeof(int32_t));
  at.slots = plan.Place(T * sizeof(int64_t));
  at.logit_rows = plan.Place(R * sizeof(int32_t));
  at.seqs = plan.Place(S * sizeof(kernels::AttentionSeq));
  lora.Plan(&plan);
  direft.Plan(&plan);
  at.block_tables = plan.Place(total_blocks * sizeof(int32_t));
  PREFT_RETURN_IF_ERROR(Reserve(&meta_, plan.size()));
  meta_host_.assign(plan.size(), 0);
  auto host = [&](size_t off) { return meta_host_.data() + off; };
  auto copy_in = [&](size_t off, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(host(off), src, bytes);
  };
  copy_in(at.tokens, batch.token_ids.data(), T * sizeof(int32_t));
  copy_in(at.positions, batch.positions.data(), T * sizeof(int32_t));
  copy_in(at.logit_rows, batch.logit_rows.data(), R * sizeof(int32_t));
  lora.Fill(meta_host_.data(), meta_);
  direft.Fill(meta_host_.data(), meta_);
  int64_t max_new = 0;
  {
    auto* slots = reinterpret_cast<int64_t*>(host(at.slots));
    auto* tables = reinterpret_cast<int32_t*>(host(at.block_tables));
    auto* seqs = reinterpret_cast<kernels::AttentionSeq*>(host(at.seqs));
    int64_t t = 0, table_pos = 0;
    for (int64_t si = 0; si < S; ++si) {
      const model::ForwardBatch::Sequence& s = batch.sequences[si];
      if (s.num_blocks > 0) {
        std::memcpy(tables + table_pos, s.block_table, s.num_blocks * sizeof(int32_t));
      }
      for (int64_t i = 0; i < s.num_new; ++i) {
        const int64_t pos = batch.positions[t + i];
        slots[t + i] = static_cast<int64_t>(s.block_table[pos / bt]) * bt + pos % bt;
      }
      seqs[si] = {q_ + t * q_out, attn_ + t * q_out,
                  meta_.as<int32_t>(at.block_tables) + table_pos, s.num_new, s.context_len};
      max_new = std::max(max_new, s.num_new);
      t += s.num_new;
      table_pos += s.num_blocks;
    }
  }
  PREFT_RETURN_IF_ERROR(
      CudaStatus(cuda::CopyToDevice(meta_.get(), meta_host_.data(), plan.size(), stream_), "copy"));
  const Step step{T,
                  R,
                  S,
                  max_new,
                  meta_.as<int32_t>(at.tokens),
                  meta_.as<int32_t>(at.positions),
                  meta_.as<int64_t>(at.slots),
                  meta_.as<int32_t>(at.logit_rows),
                  meta_.as<kernels::AttentionSeq>(at.seqs)};
  // The decode attention's split workspace (its size is fixed by the step's shape).
  const kernels::PagedKvLayout geometry{nullptr, 0, 0, bt, c.num_kv_heads, hd};
  PREFT_RETURN_IF_ERROR(Reserve(
      &attention_parts_,
      cuda::AttentionWorkspaceFloats(S, max_new, geometry, c.num_heads) * sizeof(float)));
  const bool capturable = collective_ == nullptr || collective_->capturable();
  const bool graph = use_graphs_ && capturable && max_new == 1;
  // Nothing inside a capture may allocate: size the GEMM input copy for this shape first.
  if (graph) {
    PREFT_RETURN_IF_ERROR(CudaStatus(blas_->Reserve(std::max(T, R) * std::max({d, q_out, inter})),
                               "reserve"));
  }
  PREFT_RETURN_IF_ERROR(agree(absl::OkStatus()));
  if (!graph) return Launch(step, cache, lora, direft);

  // Decode steps replay a graph recorded for their shape (the kernels' arguments are fixed
  // by the shape, the cache and the buffers, all in the key; the data is in meta_).
  std::vector<int64_t> key = {T, R, S, reinterpret_cast<int64_t>(cache->layer_data(0)),
                              reinterpret_cast<int64_t>(meta_.get()),
                              reinterpret_cast<int64_t>(scratch_.get()),
                              reinterpret_cast<int64_t>(attention_parts_.get())};
  lora.AppendShape(&key);
  direft.AppendShape(&key);
  if (blas_->generation() != graphs_blas_generation_) {  // that copy moved: every graph is stale
    ClearGraphs();
    graphs_blas_generation_ = blas_->generation();
  }
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (graphs_.size() >= kMaxGraphs) ClearGraphs();
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::GraphCaptureBegin(stream_), "graph capture"));
    const absl::Status launched = Launch(step, cache, lora, direft);
    void* exec = nullptr;
    const int ended = cuda::GraphCaptureEnd(stream_, &exec);
    PREFT_RETURN_IF_ERROR(launched);
    PREFT_RETURN_IF_ERROR(CudaStatus(ended, "graph capture"));
    it = graphs_.emplace(key, exec).first;
    ++graph_captures_;
  }
  return CudaStatus(cuda::GraphLaunch(it->second, stream_), "graph launch");
}

absl::Status DeviceModel::Launch(const Step& step, DeviceKvCache* cache, const LowRankWork& lora,
                                 const LowRankWork& direft) {
  const model::ModelConfig& c = config_;
  const kv::KvCacheShape& cs = cache->shape();
  const int64_t T = step.tokens, R = step.rows, S = step.seqs;
  const int64_t d = c.hidden_size, hd = c.head_dim, inter = c.intermediate_size;
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd, bt = cs.block_tokens;
  if (poison_scratch_) {
    PREFT_RETURN_IF_ERROR(
        CudaStatus(cuda::Memset(scratch_.get(), 0xff, scratch_.size(), stream_), "memset"));
  }
  const int32_t* tokens = step.token_ids;
  const int32_t* positions = step.positions;
  const int64_t* slots = step.slots;
  const int32_t* logit_rows = step.logit_rows;
  const kernels::AttentionSeq* seqs = step.attention;
  const int64_t max_new = step.max_new;

  // One LoRA call: every adapter's update of projections reading x ([T, in]).
  auto apply_lora = [&](int64_t li, const float* x, int64_t in,
                        std::initializer_list<std::tuple<model::Projection, float*, int64_t>> outs) {
    cuda::LowRankTargets targets;
    for (const auto& [p, y, stride] : outs) {
      targets.target[targets.num_targets++] = {
          static_cast<int32_t>(DeviceAdapter::Entry(li, static_cast<int>(p))), y, stride};
    }
    return lora.Launch(x, in, targets, stream_);
  };
  auto linear = [&](const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                    const float* bias, float* y) {
    return CudaStatus(blas_->Linear(x, m, w, n, k, bias, y), "linear");
  };
  // Projections that read one x (q, k, v; gate, up): x rounded once, or one GEMV launch.
  auto linear_shared = [&](const float* x, int64_t m, int64_t k,
                           std::initializer_list<cuda::LinearOutput> outs) {
    return CudaStatus(blas_->LinearShared(x, m, k, outs.begin(), static_cast<int>(outs.size())),
                "linear");
  };

  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::GatherRows(embed_, DType::kBF16, d, tokens, T, x_, stream_),
                             "embedding"));
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int64_t window = c.architecture == model::Architecture::kMistral ? c.sliding_window : 0;
  // A residual add is fused with the norm after it; the MLP's add waits for the next layer's
  // input norm (or the end), unless a DiReFT update must see x first.
  bool mlp_out_pending = false;  // tmp_ is still to be added to x_
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const DeviceLayer& l = layers_[li];
    PREFT_RETURN_IF_ERROR(CudaStatus(mlp_out_pending
                                   ? cuda::AddRmsNorm(x_, tmp_, l.input_norm, T, d, eps, h_, stream_)
                                   : cuda::RmsNorm(x_, l.input_norm, T, d, eps, h_, stream_),
                               "norm"));
    PREFT_RETURN_IF_ERROR(linear_shared(h_, T, d,
                                        {{l.q, q_out, l.q_bias, q_},
                                         {l.k, kv_out, l.k_bias, k_},
                                         {l.v, kv_out, l.v_bias, v_}}));
    PREFT_RETURN_IF_ERROR(apply_lora(li, h_, d,
                                     {{model::Projection::kQ, q_, q_out},
                                      {model::Projection::kK, k_, kv_out},
                                      {model::Projection::kV, v_, kv_out}}));
    const kernels::PagedKvLayout layout{cache->layer_data(li), cs.block_elements(),
                                        cache->v_offset(),     bt,
                                        c.num_kv_heads,        hd,
                                        cs.dtype,              l.k_scale,
                                        l.v_scale};
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::RopeWriteKv(positions, inv_freq_, q_, c.num_heads, k_, v_,
                                                 slots, T, cache->layer_data(li), layout,
                                                 stream_),
                               "RoPE and KV write"));
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::PagedAttention(seqs, S, max_new, layout, c.num_heads, scale,
                                                    window, attention_parts_.as<float>(0),
                                                    stream_),
                               "attention"));
    PREFT_RETURN_IF_ERROR(linear(attn_, T, l.o, d, q_out, l.o_bias, tmp_));
    PREFT_RETURN_IF_ERROR(apply_lora(li, attn_, q_out, {{model::Projection::kO, tmp_, d}}));
    PREFT_RETURN_IF_ERROR(AllReduce(tmp_, T * d));
    PREFT_RETURN_IF_ERROR(CudaStatus(
        cuda::AddRmsNorm(x_, tmp_, l.post_attention_norm, T, d, eps, h_, stream_), "norm"));
    PREFT_RETURN_IF_ERROR(
        linear_shared(h_, T, d, {{l.gate, inter, nullptr, gate_}, {l.up, inter, nullptr, up_}}));
    PREFT_RETURN_IF_ERROR(apply_lora(li, h_, d,
                                     {{model::Projection::kGate, gate_, inter},
                                      {model::Projection::kUp, up_, inter}}));
    PREFT_RETURN_IF_ERROR(
        CudaStatus(cuda::SiluMulSeparate(gate_, up_, T * inter, gate_, stream_), "SwiGLU"));
    PREFT_RETURN_IF_ERROR(linear(gate_, T, l.down, d, inter, nullptr, tmp_));
    PREFT_RETURN_IF_ERROR(apply_lora(li, gate_, inter, {{model::Projection::kDown, tmp_, d}}));
    PREFT_RETURN_IF_ERROR(AllReduce(tmp_, T * d));
    mlp_out_pending = direft.empty();
    if (!direft.empty()) {
      PREFT_RETURN_IF_ERROR(CudaStatus(cuda::AddInPlace(x_, tmp_, T * d, stream_), "add"));
      cuda::LowRankTargets targets;
      targets.target[0] = {static_cast<int32_t>(DeviceAdapter::Entry(li, DeviceAdapter::kDireftSlot)),
                           x_, d};
      targets.num_targets = 1;
      PREFT_RETURN_IF_ERROR(direft.Launch(x_, d, targets, stream_));
    }
  }
  if (mlp_out_pending) {
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::AddInPlace(x_, tmp_, T * d, stream_), "add"));
  }
  // Only the rows that will be sampled go through the final norm and the LM head; only rank 0
  // (every rank holds the same residual stream) runs them.
  if (shard_.rank != 0) return absl::OkStatus();
  PREFT_RETURN_IF_ERROR(
      CudaStatus(cuda::GatherRows(x_, DType::kF32, d, logit_rows, R, last_, stream_), "gather"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::RmsNorm(last_, final_norm_, R, d, eps, last_, stream_), "norm"));
  return linear(last_, R, lm_head_, c.vocab_size, d, nullptr, logits_);
}

absl::Status DeviceModel::Forward(const model::ForwardBatch& batch, DeviceKvCache* cache,
                                  DeviceAdapterSlots* adapters,
                                  base::AlignedVector<float>* logits) {
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  const size_t n = batch.logit_rows.size() * config_.vocab_size;
  logits->resize(n);
  PREFT_RETURN_IF_ERROR(
      CudaStatus(cuda::CopyToHost(logits->data(), logits_, n * sizeof(float), stream_), "copy"));
  return CudaStatus(cuda::StreamSynchronize(stream_), "forward");
}

absl::Status DeviceModel::ForwardRank(const model::ForwardBatch& batch, DeviceKvCache* cache,
                                      DeviceAdapterSlots* adapters) {
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  return CudaStatus(cuda::StreamSynchronize(stream_), "forward");
}

absl::Status DeviceModel::AllReduce(float* y, int64_t n) {
  if (collective_ == nullptr) return absl::OkStatus();
  if (const char* error = collective_->SumInPlace(y, n, stream_); error != nullptr) {
    return absl::InternalError(absl::StrCat("tensor-parallel all-reduce (", collective_->kind(),
                                            ", rank ", shard_.rank, "): ", error));
  }
  return absl::OkStatus();
}

void DeviceModel::ClearGraphs() {
  for (auto& [key, exec] : graphs_) cuda::GraphDestroy(exec);
  graphs_.clear();
}

absl::Status DeviceModel::Reserve(DeviceBuffer* buffer, size_t bytes) {
  if (buffer->size() >= bytes) return absl::OkStatus();
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(stream_), "synchronize"));
  *buffer = DeviceBuffer();
  PREFT_ASSIGN_OR_RETURN(*buffer, DeviceBuffer::Allocate(std::max(bytes * 2, size_t{4096})));
  return absl::OkStatus();
}

absl::Status DeviceModel::ForwardSample(const model::ForwardBatch& batch, DeviceKvCache* cache,
                                        DeviceAdapterSlots* adapters,
                                        const std::vector<cuda::SampleSpec>& specs,
                                        std::vector<int32_t>* tokens) {
  const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
  if (static_cast<int64_t>(specs.size()) != R) {
    const absl::Status refused = absl::InvalidArgumentError(
        absl::StrCat(specs.size(), " sampling specs for ", R, " logit rows"));
    // The other ranks run this step all the same: they learn of the refusal at its agreement.
    if (agree_) agree_(refused).IgnoreError();
    return refused;
  }
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  const size_t specs_bytes = AlignUp(R * sizeof(cuda::SampleSpec));
  PREFT_RETURN_IF_ERROR(Reserve(&picks_, specs_bytes + R * sizeof(int32_t)));
  const size_t ws = cuda::SampleWorkspaceBytes(R, config_.vocab_size);
  PREFT_RETURN_IF_ERROR(Reserve(&sample_workspace_, ws));
  auto* d_specs = picks_.as<cuda::SampleSpec>();
  auto* d_tokens = picks_.as<int32_t>(specs_bytes);
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(d_specs, specs.data(),
                                                R * sizeof(cuda::SampleSpec), stream_),
                             "copy"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::SampleRows(logits_, R, config_.vocab_size, d_specs, d_tokens,
                                               sample_workspace_.get(), sample_workspace_.size(),
                                               stream_),
                             "sampling"));
  tokens->resize(R);
  PREFT_RETURN_IF_ERROR(
      CudaStatus(cuda::CopyToHost(tokens->data(), d_tokens, R * sizeof(int32_t), stream_), "copy"));
  return CudaStatus(cuda::StreamSynchronize(stream_), "forward");
}

absl::Status DeviceModel::ForwardGreedy(const model::ForwardBatch& batch, DeviceKvCache* cache,
                                        DeviceAdapterSlots* adapters,
                                        std::vector<int32_t>* tokens,
                                        std::vector<float>* logprobs) {
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
  PREFT_RETURN_IF_ERROR(Reserve(&picks_, R * (sizeof(int32_t) + sizeof(float))));
  auto* d_tokens = picks_.as<int32_t>();
  auto* d_logprobs = picks_.as<float>(R * sizeof(int32_t));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::GreedyLogprob(logits_, R, config_.vocab_size, d_tokens,
                                                 d_logprobs, stream_),
                             "greedy"));
  tokens->resize(R);
  logprobs->resize(R);
  PREFT_RETURN_IF_ERROR(
      CudaStatus(cuda::CopyToHost(tokens->data(), d_tokens, R * sizeof(int32_t), stream_), "copy"));
  PREFT_RETURN_IF_ERROR(
      CudaStatus(cuda::CopyToHost(logprobs->data(), d_logprobs, R * sizeof(float), stream_), "copy"));
  return CudaStatus(cuda::StreamSynchronize(stream_), "forward");
}

}  // namespace preft::backend
