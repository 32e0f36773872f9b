#include "common/model/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kernels/cpu/attention.h"
#include "common/kernels/cpu/linear.h"
#include "common/kernels/cpu/ops.h"
#include "common/kernels/dtype.h"
#include "common/model/rope.h"

namespace preft::model {
namespace {

namespace cpu = kernels::cpu;

kernels::MatrixView View(const TensorInfo* t) {
  return {t->data, t->dtype, t->shape[0], t->shape.size() > 1 ? t->shape[1] : 1};
}

std::vector<float> ToF32(const TensorInfo* t) {
  std::vector<float> out(t->num_elements());
  for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::LoadAsF32(t->data, t->dtype, i);
  return out;
}

// The fp8 KV scale of one layer per KV head: the checkpoint's `name` (vLLM's fp8 checkpoints
// hold one per layer, shape [] or [1], which every head shares; or one per head), else
// `fallback` (kv_scale, older checkpoints' one scale for K and V), else 1.
absl::StatusOr<std::vector<float>> KvScale(const Checkpoint& ckpt, const std::string& name,
                                           const std::string& fallback, int64_t kv_heads) {
  const std::string& found = ckpt.Has(name) ? name : fallback;
  if (!ckpt.Has(found)) return std::vector<float>(kv_heads, 1.f);
  const TensorInfo* t = ckpt.tensors().find(found)->second;
  const int64_t n = t->num_elements();
  if (t->shape.size() > 1 || (n != 1 && n != kv_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        ckpt.dir(), ": KV scale '", found, "' has ", n, " elements; expected 1 or one per KV head (",
        kv_heads, ")"));
  }
  std::vector<float> scale = ToF32(t);
  for (float s : scale) {
    if (!std::isfinite(s) || s <= 0.f) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": KV scale '", found, "' is ", s,
                                                     "; a scale must be finite and positive"));
    }
  }
  if (n == 1) scale.assign(kv_heads, scale[0]);
  return scale;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir) {
  std::unique_ptr<Model> m(new Model());
  PREFT_ASSIGN_OR_RETURN(m->config_, ModelConfig::FromFile(dir + "/config.json"));
  PREFT_ASSIGN_OR_RETURN(m->checkpoint_, Checkpoint::Open(dir));
  PREFT_RETURN_IF_ERROR(m->LoadWeights());
  m->inv_freq_ = RopeInverseFrequencies(m->config_);
  return m;
}

absl::Status Model::LoadWeights() {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size, hd = c.head_dim;
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;
  auto get = [&](const std::string& name,
                 std::vector<int64_t> shape) -> absl::StatusOr<const TensorInfo*> {
    return checkpoint_->Get(name, shape);
  };
  PREFT_ASSIGN_OR_RETURN(const TensorInfo* embed,
                         get("model.embed_tokens.weight", {c.vocab_size, d}));
  embed_ = View(embed);
  if (c.tie_word_embeddings && !checkpoint_->Has("lm_head.weight")) {
    lm_head_ = embed_;
  } else {
    PREFT_ASSIGN_OR_RETURN(const TensorInfo* head, get("lm_head.weight", {c.vocab_size, d}));
    lm_head_ = View(head);
  }
  PREFT_ASSIGN_OR_RETURN(const TensorInfo* norm, get("model.norm.weight", {d}));
  final_norm_ = ToF32(norm);
  layers_.resize(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LayerWeights& l = layers_[i];
    struct {
      kernels::MatrixView* view;
      const char* name;
      int64_t rows, cols;
    } mats[] = {{&l.q, "self_attn.q_proj", q_out, d},
                {&l.k, "self_attn.k_proj", kv_out, d},
                {&l.v, "self_attn.v_proj", kv_out, d},
                {&l.o, "self_attn.o_proj", d, q_out},
                {&l.gate, "mlp.gate_proj", c.intermediate_size, d},
                {&l.up, "mlp.up_proj", c.intermediate_size, d},
                {&l.down, "mlp.down_proj", d, c.intermediate_size}};
    for (auto& m : mats) {
      PREFT_ASSIGN_OR_RETURN(const TensorInfo* t,
                             get(absl::StrCat(p, m.name, ".weight"), {m.rows, m.cols}));
      *m.view = View(t);
    }
    if (c.attention_bias) {
      PREFT_ASSIGN_OR_RETURN(const TensorInfo* qb, get(p + "self_attn.q_proj.bias", {q_out}));
      PREFT_ASSIGN_OR_RETURN(const TensorInfo* kb, get(p + "self_attn.k_proj.bias", {kv_out}));
      PREFT_ASSIGN_OR_RETURN(const TensorInfo* vb, get(p + "self_attn.v_proj.bias", {kv_out}));
      l.q_bias = ToF32(qb);
      l.k_bias = ToF32(kb);
      l.v_bias = ToF32(vb);
      if (c.architecture == Architecture::kLlama) {  // HF Llama biases o_proj too; Qwen2 not
        PREFT_ASSIGN_OR_RETURN(const TensorInfo* ob, get(p + "self_attn.o_proj.bias", {d}));
        l.o_bias = ToF32(ob);
      }
    }
    PREFT_ASSIGN_OR_RETURN(const TensorInfo* n1, get(p + "input_layernorm.weight", {d}));
    PREFT_ASSIGN_OR_RETURN(const TensorInfo* n2, get(p + "post_attention_layernorm.weight", {d}));
    l.input_norm = ToF32(n1);
    l.post_attention_norm = ToF32(n2);
    PREFT_ASSIGN_OR_RETURN(
        l.k_scale, KvScale(*checkpoint_, p + "self_attn.k_scale", p + "self_attn.kv_scale",
                           c.num_kv_heads));
    PREFT_ASSIGN_OR_RETURN(
        l.v_scale, KvScale(*checkpoint_, p + "self_attn.v_scale", p + "self_attn.kv_scale",
                           c.num_kv_heads));
  }
  return absl::OkStatus();
}

kv::KvCacheShape Model::CacheShape(int64_t num_blocks, int64_t block_tokens,
                                   kv::KvDtype dtype) const {
  return {config_.num_layers, num_blocks,       block_tokens, config_.num_kv_heads,
          config_.head_dim,   dtype};
}

namespace {

// Writes the new tokens' K and V (f32, [token][kv_head][head_dim]) into their block slots, as
// T through convert(x, head's scale): f32 as is, bf16 rounded to nearest even, fp8 divided by
// the scale then rounded to nearest even (the GPU's writers round the same way, so either
// leaves the same bytes).
template <class T, class Convert>
void WriteKvAs(const ForwardBatch& batch, const float* k, const float* v,
               const Model::LayerWeights& w, int64_t layer, kv::KvCache* cache, Convert convert) {
  const kv::KvCacheShape& cs = cache->shape();
  const int64_t kvh = cs.num_kv_heads, hd = cs.head_dim, bt = cs.block_tokens;
  int64_t t = 0;
  for (const ForwardBatch::Sequence& s : batch.sequences) {
    for (int64_t n = 0; n < s.num_new; ++n, ++t) {
      const int64_t pos = batch.positions[t];
      T* block = reinterpret_cast<T*>(cache->block_data(layer, s.block_table[pos / bt]));
      const int64_t slot = pos % bt;
      for (int64_t h = 0; h < kvh; ++h) {
        T* kt = block + h * bt * hd + slot;  // K is [head_dim][block_tokens]
        T* vt = block + cache->v_offset() + (h * bt + slot) * hd;
        const float* kh = k + (t * kvh + h) * hd;
        const float* vh = v + (t * kvh + h) * hd;
        const float ks = w.k_scale[h], vs = w.v_scale[h];
        for (int64_t i = 0; i < hd; ++i) kt[i * bt] = convert(kh[i], ks);
        for (int64_t i = 0; i < hd; ++i) vt[i] = convert(vh[i], vs);
      }
    }
  }
}

}  // namespace

void Model::WriteKv(const ForwardBatch& batch, int64_t layer, kv::KvCache* cache) {
  const LayerWeights& w = layers_[layer];
  switch (cache->shape().dtype) {
    case kv::KvDtype::kF32:
      return WriteKvAs<float>(batch, k_.data(), v_.data(), w, layer, cache,
                              [](float x, float) { return x; });
    case kv::KvDtype::kBF16:
      return WriteKvAs<uint16_t>(batch, k_.data(), v_.data(), w, layer, cache,
                                 [](float x, float) { return kernels::F32ToBf16(x); });
    case kv::KvDtype::kFp8E4M3:
      return WriteKvAs<uint8_t>(batch, k_.data(), v_.data(), w, layer, cache,
                                [](float x, float s) { return kernels::F32ToFp8E4M3(x / s); });
  }
  PREFT_CHECK(false && "unknown KV dtype");
}

absl::Status CheckAdapterFits(const ModelConfig& c, const AdapterWeights& a) {
  if (a.num_layers() != c.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter has ", a.num_layers(), " layers; the model has ", c.num_layers));
  }
  const int64_t d = c.hidden_size;
  auto fits = [](const LowRank& lr, int64_t in, int64_t out) {
    return lr.empty() || (lr.shrink.cols == in && lr.expand.cols == out &&
                          lr.shrink.rows == lr.expand.rows && lr.shrink.rows > 0);
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (a.kind() == AdapterKind::kDireft) {
      if (!fits(a.direft(l), d, d)) {
        return absl::InvalidArgumentError(
            absl::StrCat("DiReFT layer ", l, " does not fit hidden size ", d));
      }
      continue;
    }
    for (int p = 0; p < kNumProjections; ++p) {
      const auto proj = static_cast<Projection>(p);
      const ProjectionDims dims = DimsOf(c, proj);
      if (!fits(a.lora(l, proj), dims.in, dims.out)) {
        return absl::InvalidArgumentError(absl::StrCat("LoRA on layer ", l, " ",
                                                       ProjectionName(proj),
                                                       " does not fit the model"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBatchFits(const ModelConfig& c, const kv::KvCacheShape& cs,
                            const ForwardBatch& batch) {
  if (cs.num_layers != c.num_layers || cs.num_kv_heads != c.num_kv_heads ||
      cs.head_dim != c.head_dim) {
    return absl::InvalidArgumentError("KV cache shape does not match the model");
  }
  PREFT_RETURN_IF_ERROR(batch.Validate(c.vocab_size, cs.block_tokens));
  for (const ForwardBatch::Sequence& s : batch.sequences) {
    for (int64_t b = 0; b < s.num_blocks; ++b) {
      if (s.block_table[b] < 0 || s.block_table[b] >= cs.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("forward batch: block ", s.block_table[b],
                                                       " is outside the cache's ", cs.num_blocks,
                                                       " blocks"));
      }
    }
  }
  return absl::OkStatus();
}

void Model::ApplyLora(int64_t li, const float* x, int64_t in,
                      std::initializer_list<LoraTarget> targets) {
  // Adapter by adapter: one adapter's pairs for these targets lie next to each other in its
  // compute slot, so a thread streams them as one run.
  groups_.clear();
  for (const AdapterRows& ar : lora_rows_) {
    if (ar.rows.empty()) continue;
    for (const LoraTarget& t : targets) {
      const LowRank& lr = ar.adapter->lora(li, t.projection);
      if (lr.empty()) continue;
      groups_.push_back({ar.rows.data(), static_cast<int64_t>(ar.rows.size()), lr.shrink, lr.expand,
                         lr.shrink_bias, lr.scale, t.y, t.out});
    }
  }
  if (!groups_.empty()) RunLowRank(x, in, nullptr, 0);
}

void Model::RunLowRank(const float* x, int64_t x_stride, float* y, int64_t y_stride) {
  const auto start = std::chrono::steady_clock::now();
  cpu::LowRankAdd(x, x_stride, y, y_stride, groups_.data(), static_cast<int64_t>(groups_.size()));
  adapter_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Model::ApplyDireft(int64_t li, float* x) {
  groups_.clear();
  for (const AdapterRows& ar : direft_rows_) {
    const LowRank& lr = ar.adapter->direft(li);
    if (lr.empty() || ar.rows.empty()) continue;
    groups_.push_back({ar.rows.data(), static_cast<int64_t>(ar.rows.size()), lr.shrink, lr.expand,
                       lr.shrink_bias, lr.scale});
  }
  const int64_t d = config_.hidden_size;
  if (!groups_.empty()) RunLowRank(x, d, x, d);
}

absl::Status Model::Forward(const ForwardBatch& batch, kv::KvCache* cache,
                            base::AlignedVector<float>* logits) {
  const ModelConfig& c = config_;
  const kv::KvCacheShape& cs = cache->shape();
  PREFT_RETURN_IF_ERROR(CheckBatchFits(c, cs, batch));
  const int64_t T = batch.num_tokens();
  const int64_t d = c.hidden_size, hd = c.head_dim, inter = c.intermediate_size;
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;
  x_.resize(T * d);
  h_.resize(T * d);
  q_.resize(T * q_out);
  k_.resize(T * kv_out);
  v_.resize(T * kv_out);
  attn_.resize(T * q_out);
  tmp_.resize(T * d);
  gate_.resize(T * inter);
  up_.resize(T * inter);

  // Group the masked rows by adapter (rows of one adapter may come from many sequences).
  lora_rows_.clear();
  direft_rows_.clear();
  {
    int64_t t = 0;
    for (const ForwardBatch::Sequence& s : batch.sequences) {
      if (s.adapter != nullptr) {
        std::vector<AdapterRows>& rows =
            s.adapter->kind() == AdapterKind::kLora ? lora_rows_ : direft_rows_;
        auto it = std::find_if(rows.begin(), rows.end(),
                               [&](const AdapterRows& r) { return r.adapter == s.adapter; });
        if (it == rows.end()) {
          PREFT_RETURN_IF_ERROR(CheckAdapterFits(c, *s.adapter));
          rows.push_back({s.adapter, {}});
          it = rows.end() - 1;
        }
        for (int64_t i = t; i < t + s.num_new; ++i)
          if (batch.adapter_mask[i]) it->rows.push_back(static_cast<int32_t>(i));
      }
      t += s.num_new;
    }
  }

  cpu::GatherRows(embed_, batch.token_ids.data(), T, x_.data());

  std::vector<cpu::AttentionSeq> attn_seqs;
  attn_seqs.reserve(batch.sequences.size());
  {
    int64_t t = 0;
    for (const ForwardBatch::Sequence& s : batch.sequences) {
      attn_seqs.push_back(
          {&q_[t * q_out], &attn_[t * q_out], s.block_table, s.num_new, s.context_len});
      t += s.num_new;
    }
  }
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  // HF applies the sliding window in Mistral's mask; Qwen2's only under flash-attention.
  const int64_t window = c.architecture == Architecture::kMistral ? c.sliding_window : 0;
  auto bias = [](const std::vector<float>& b) { return b.empty() ? nullptr : b.data(); };

  for (int64_t li = 0; li < c.num_layers; ++li) {
    const LayerWeights& l = layers_[li];
    cpu::RmsNorm(x_.data(), l.input_norm.data(), T, d, eps, h_.data());
    cpu::LinearShared(h_.data(), T,
                      {{l.q, bias(l.q_bias), q_.data()},
                       {l.k, bias(l.k_bias), k_.data()},
                       {l.v, bias(l.v_bias), v_.data()}});
    if (!lora_rows_.empty()) {
      ApplyLora(li, h_.data(), d,
                {{Projection::kQ, q_.data(), q_out},
                 {Projection::kK, k_.data(), kv_out},
                 {Projection::kV, v_.data(), kv_out}});
    }
    cpu::ApplyRope(batch.positions.data(), T, inv_freq_.data(), hd, q_.data(), c.num_heads,
                   k_.data(), c.num_kv_heads);
    WriteKv(batch, li, cache);
    cpu::PagedKvLayout layout{cache->layer_data(li), cs.block_elements(), cache->v_offset(),
                              cs.block_tokens,       c.num_kv_heads,      hd,
                              cs.dtype,              l.k_scale.data(),    l.v_scale.data()};
    cpu::PagedAttention(attn_seqs.data(), static_cast<int64_t>(attn_seqs.size()), layout,
                        c.num_heads, scale, window);
    cpu::Linear(attn_.data(), T, l.o, bias(l.o_bias), tmp_.data());
    if (!lora_rows_.empty()) ApplyLora(li, attn_.data(), q_out, {{Projection::kO, tmp_.data(), d}});
    cpu::AddInPlace(x_.data(), tmp_.data(), T * d);

    cpu::RmsNorm(x_.data(), l.post_attention_norm.data(), T, d, eps, h_.data());
    if (lora_rows_.empty()) {
      cpu::LinearSwiGlu(h_.data(), T, l.gate, l.up, gate_.data(), up_.data());
    } else {  // LoRA updates gate and up before the SiLU
      cpu::LinearShared(h_.data(), T,
                        {{l.gate, nullptr, gate_.data()}, {l.up, nullptr, up_.data()}});
      ApplyLora(li, h_.data(), d,
                {{Projection::kGate, gate_.data(), inter}, {Projection::kUp, up_.data(), inter}});
      cpu::SiluMulSeparate(gate_.data(), up_.data(), T * inter, gate_.data());
    }
    cpu::Linear(gate_.data(), T, l.down, nullptr, tmp_.data());
    if (!lora_rows_.empty())
      ApplyLora(li, gate_.data(), inter, {{Projection::kDown, tmp_.data(), d}});
    cpu::AddInPlace(x_.data(), tmp_.data(), T * d);
    if (!direft_rows_.empty()) ApplyDireft(li, x_.data());
  }

  // Only the rows that will be sampled go through the final norm and the LM head.
  const int64_t rows = static_cast<int64_t>(batch.logit_rows.size());
  last_.resize(rows * d);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&last_[r * d], &x_[batch.logit_rows[r] * d], d * sizeof(float));
  cpu::RmsNorm(last_.data(), final_norm_.data(), rows, d, eps, last_.data());
  logits->resize(rows * c.vocab_size);
  cpu::Linear(last_.data(), rows, lm_head_, nullptr, logits->data());
  return absl::OkStatus();
}

}  // namespace preft::model
