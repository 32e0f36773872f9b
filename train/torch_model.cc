#include "train/torch_model.h"

#include <dlfcn.h>

#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/model/rope.h"

namespace preft::train {
namespace {

using model::Projection;

torch::Dtype TorchDtype(kernels::DType t) {
  switch (t) {
    case kernels::DType::kF32:
      return torch::kFloat32;
    case kernels::DType::kF16:
      return torch::kFloat16;
    case kernels::DType::kBF16:
      return torch::kBFloat16;
  }
  return torch::kFloat32;
}

// As the engine's RmsNorm: x / sqrt(mean(x^2) + eps), times the weight.
torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return weight * (x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

// Hugging Face's rotate_half RoPE on [B, heads, T, head_dim].
torch::Tensor Rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// y + s * mask * ((x A^T) B^T): the LoRA update on the masked rows.
torch::Tensor AddLora(torch::Tensor y, const torch::Tensor& x, const TrainableAdapter* a,
                      int64_t layer, Projection p, const torch::Tensor& mask) {
  if (a == nullptr) return y;
  const TrainableAdapter::Lora* l = a->lora(layer, p);
  if (l == nullptr) return y;
  // The mask and scale go on the rank-r activations, not on the [T, out] update: a broadcast
  // multiply over the full output costs as much as the base projection on CPU.
  return y + torch::linear(torch::linear(x, l->a) * (l->scale * mask), l->b);
}

}  // namespace

void SetComputeThreads(int n) {
  if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
  at::set_num_threads(1);
  using SetThreads = void (*)(int);
  // libtorch links libblas.so.3 and preft's kernels libopenblas.so.0: Debian may give each
  // its own OpenBLAS (and thread pool).
  for (const char* lib : {"libblas.so.3", "libopenblas.so.0"}) {
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD)) {
      if (auto set = reinterpret_cast<SetThreads>(dlsym(h, "openblas_set_num_threads"))) set(n);
      dlclose(h);
    }
  }
}

torch::Tensor TorchModel::Weight(const model::TensorInfo* t) const {
  // The mapping is read-only and outlives every tensor viewing it (checkpoint_); base tensors
  // never require grad, so nothing writes through the view.
  torch::Tensor view = torch::from_blob(const_cast<void*>(t->data), t->shape,
                                        torch::TensorOptions().dtype(TorchDtype(t->dtype)));
  return view.dtype() == dtype_ ? view : view.to(dtype_);
}

absl::StatusOr<std::unique_ptr<TorchModel>> TorchModel::Load(const std::string& dir,
                                                             torch::Dtype dtype) {
  std::unique_ptr<TorchModel> m(new TorchModel());
  m->dtype_ = dtype;
  PREFT_ASSIGN_OR_RETURN(m->config_, model::ModelConfig::FromFile(dir + "/config.json"));
  PREFT_ASSIGN_OR_RETURN(m->checkpoint_, model::Checkpoint::Open(dir));
  const model::ModelConfig& c = m->config_;
  const int64_t d = c.hidden_size, hd = c.head_dim;
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;
  auto get = [&](const std::string& name,
                 std::vector<int64_t> shape) -> absl::StatusOr<torch::Tensor> {
    PREFT_ASSIGN_OR_RETURN(const model::TensorInfo* t, m->checkpoint_->Get(name, shape));
    return m->Weight(t);
  };
  PREFT_ASSIGN_OR_RETURN(m->embed_, get("model.embed_tokens.weight", {c.vocab_size, d}));
  if (c.tie_word_embeddings && !m->checkpoint_->Has("lm_head.weight")) {
    m->lm_head_ = m->embed_;
  } else {
    PREFT_ASSIGN_OR_RETURN(m->lm_head_, get("lm_head.weight", {c.vocab_size, d}));
  }
  PREFT_ASSIGN_OR_RETURN(m->final_norm_, get("model.norm.weight", {d}));
  m->layers_.resize(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer& l = m->layers_[i];
    PREFT_ASSIGN_OR_RETURN(l.q, get(p + "self_attn.q_proj.weight", {q_out, d}));
    PREFT_ASSIGN_OR_RETURN(l.k, get(p + "self_attn.k_proj.weight", {kv_out, d}));
    PREFT_ASSIGN_OR_RETURN(l.v, get(p + "self_attn.v_proj.weight", {kv_out, d}));
    PREFT_ASSIGN_OR_RETURN(l.o, get(p + "self_attn.o_proj.weight", {d, q_out}));
    PREFT_ASSIGN_OR_RETURN(l.gate, get(p + "mlp.gate_proj.weight", {c.intermediate_size, d}));
    PREFT_ASSIGN_OR_RETURN(l.up, get(p + "mlp.up_proj.weight", {c.intermediate_size, d}));
    PREFT_ASSIGN_OR_RETURN(l.down, get(p + "mlp.down_proj.weight", {d, c.intermediate_size}));
    if (c.attention_bias) {
      PREFT_ASSIGN_OR_RETURN(l.q_bias, get(p + "self_attn.q_proj.bias", {q_out}));
      PREFT_ASSIGN_OR_RETURN(l.k_bias, get(p + "self_attn.k_proj.bias", {kv_out}));
      PREFT_ASSIGN_OR_RETURN(l.v_bias, get(p + "self_attn.v_proj.bias", {kv_out}));
      if (c.architecture == model::Architecture::kLlama) {  // HF Llama biases o_proj too
        PREFT_ASSIGN_OR_RETURN(l.o_bias, get(p + "self_attn.o_proj.bias", {d}));
      }
    }
    PREFT_ASSIGN_OR_RETURN(l.input_norm, get(p + "input_layernorm.weight", {d}));
    PREFT_ASSIGN_OR_RETURN(l.post_attention_norm, get(p + "post_attention_layernorm.weight", {d}));
  }
  const std::vector<float> inv_freq = model::RopeInverseFrequencies(c);
  m->inv_freq_ = torch::tensor(std::vector<double>(inv_freq.begin(), inv_freq.end()),
                               torch::kFloat64);
  return m;
}

int64_t TorchModel::num_parameters() const {
  int64_t n = embed_.numel() + final_norm_.numel();
  if (!lm_head_.is_same(embed_)) n += lm_head_.numel();
  for (const Layer& l : layers_) {
    for (const torch::Tensor* t : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down, &l.q_bias,
                                   &l.k_bias, &l.v_bias, &l.o_bias, &l.input_norm,
                                   &l.post_attention_norm}) {
      if (t->defined()) n += t->numel();
    }
  }
  return n;
}

torch::Tensor TorchModel::Forward(const TorchBatch& batch, const TrainableAdapter* adapter) const {
  const model::ModelConfig& c = config_;
  const int64_t B = batch.ids.size(0), T = batch.ids.size(1);
  const int64_t d = c.hidden_size, hd = c.head_dim, H = c.num_heads, KV = c.num_kv_heads;
  const double eps = c.rms_norm_eps;
  const torch::Tensor& lmask = batch.lora_mask;
  const bool lora = adapter != nullptr && adapter->kind() == model::AdapterKind::kLora;
  const bool direft = adapter != nullptr && adapter->kind() == model::AdapterKind::kDireft;
  const TrainableAdapter* la = lora ? adapter : nullptr;

  // Angles in double, as the engine's ApplyRope computes them.
  const torch::Tensor angles =
      torch::arange(T, torch::kFloat64).unsqueeze(1) * inv_freq_.unsqueeze(0);  // [T, hd/2]
  const torch::Tensor cos = torch::cat({angles.cos(), angles.cos()}, 1).to(dtype_).view({1, 1, T, hd});
  const torch::Tensor sin = torch::cat({angles.sin(), angles.sin()}, 1).to(dtype_).view({1, 1, T, hd});
  // Key j is visible from query i when j <= i and, with Mistral's sliding window, i - j < w.
  const torch::Tensor i = torch::arange(T).unsqueeze(1), j = torch::arange(T).unsqueeze(0);
  torch::Tensor visible = j <= i;
  const int64_t window =
      c.architecture == model::Architecture::kMistral ? c.sliding_window : 0;
  if (window > 0) visible = visible & (i - j < window);
  const torch::Tensor hidden_mask = visible.logical_not();
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));

  torch::Tensor x = embed_.index_select(0, batch.ids.reshape({-1})).view({B, T, d});
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const Layer& l = layers_[li];
    torch::Tensor h = RmsNorm(x, l.input_norm, eps);
    torch::Tensor q = AddLora(torch::linear(h, l.q, l.q_bias), h, la, li, Projection::kQ, lmask);
    torch::Tensor k = AddLora(torch::linear(h, l.k, l.k_bias), h, la, li, Projection::kK, lmask);
    torch::Tensor v = AddLora(torch::linear(h, l.v, l.v_bias), h, la, li, Projection::kV, lmask);
    q = Rope(q.view({B, T, H, hd}).transpose(1, 2), cos, sin);
    k = Rope(k.view({B, T, KV, hd}).transpose(1, 2), cos, sin);
    v = v.view({B, T, KV, hd}).transpose(1, 2);
    if (H != KV) {  // GQA: query head h reads KV head h / (H / KV)
      k = k.repeat_interleave(H / KV, 1);
      v = v.repeat_interleave(H / KV, 1);
    }
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
    scores = scores.masked_fill(hidden_mask, -std::numeric_limits<double>::infinity());
    torch::Tensor attn = torch::matmul(torch::softmax(scores, -1), v);
    attn = attn.transpose(1, 2).reshape({B, T, H * hd});
    x = x + AddLora(torch::linear(attn, l.o, l.o_bias), attn, la, li, Projection::kO, lmask);

    h = RmsNorm(x, l.post_attention_norm, eps);
    torch::Tensor gate = AddLora(torch::linear(h, l.gate), h, la, li, Projection::kGate, lmask);
    torch::Tensor up = AddLora(torch::linear(h, l.up), h, la, li, Projection::kUp, lmask);
    torch::Tensor act = torch::silu(gate) * up;
    x = x + AddLora(torch::linear(act, l.down), act, la, li, Projection::kDown, lmask);
    if (direft) {
      if (const TrainableAdapter::Direft* r = adapter->direft(li)) {
        x = x + torch::matmul(torch::linear(x, r->w1, r->b1) * batch.direft_mask, r->w2);
      }
    }
  }
  torch::Tensor rows = x.reshape({B * T, d}).index_select(0, batch.logit_rows);
  return torch::linear(RmsNorm(rows, final_norm_, eps), lm_head_);
}

}  // namespace preft::train
