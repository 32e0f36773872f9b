#!/usr/bin/python3
"""Independent Python reference ("oracle") for preft.

Follows Hugging Face transformers' modelling code (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM as of transformers 4.44) and PEFT LoRA / pyreft DiReFT semantics, written
from scratch on plain torch + numpy (no transformers / safetensors packages needed).

Run with Debian's interpreter: /usr/bin/python3 (it has torch and numpy).

CLI:
  reference.py --model DIR --prompt-ids 1,2,3 --max-tokens N --top-logprobs K
               [--dtype float64|float32] [--ignore-eos]
               [--adapter DIR --adapter-positions prompt|all]
     prints one JSON object {"prompt_ids", "token_ids", "logprobs": [{"token_id", "logprob",
     "top": [[id, lp], ...], "gap"}], "finish_reason"} for greedy decoding.
  reference.py --check-fixture DIR [--modes base,lora,...] [--tol 1e-5]
     reproduces DIR/reference.json and exits 0 (PASS) / 1 (FAIL).

Exit code 77 (ctest "skip") when torch cannot be imported.
"""

import argparse
import json
import math
import os
import re
import struct
import sys

try:
    import numpy as np
    import torch
except ImportError:  # pragma: no cover - depends on the interpreter
    np = torch = None

SKIP = 77

# --------------------------------------------------------------------------------------------
# safetensors (read with numpy)
# --------------------------------------------------------------------------------------------

_NP_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}


def read_safetensors(path):
    """Returns {name: float32/float64/... numpy array}. BF16 is widened to float32 exactly."""
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        shape = tuple(info["shape"])
        start, end = info["data_offsets"]
        raw = data[base + start: base + end]
        if dtype == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2")
            arr = (u16.astype(np.uint32) << 16).view(np.float32)
        elif dtype in _NP_DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(_NP_DTYPES[dtype]))
        else:
            raise ValueError(f"{path}: unsupported dtype {dtype} for {name}")
        expected = int(np.prod(shape)) if shape else 1
        if arr.size != expected:
            raise ValueError(f"{path}: {name} has {arr.size} elements, shape says {shape}")
        out[name] = arr.reshape(shape).copy()
    return out


def read_model_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return read_safetensors(single)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        out = {}
        for shard in sorted(set(weight_map.values())):
            out.update(read_safetensors(os.path.join(model_dir, shard)))
        missing = [k for k in weight_map if k not in out]
        if missing:
            raise ValueError(f"index names tensors missing from shards: {missing[:5]}")
        return out
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


def _eos_ids(config, model_dir):
    ids = []

    def add(v):
        if v is None:
            return
        if isinstance(v, list):
            ids.extend(int(x) for x in v)
        else:
            ids.append(int(v))

    # HF generate() uses generation_config.json when present, else the model config.
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    if not ids:
        add(config.get("eos_token_id"))
    return sorted(set(ids))


def compute_inv_freq(config, head_dim, dtype):
    """HF _compute_default_rope_parameters + the llama3 / linear variants.

    Returns (inv_freq, position_scale): angles = (position / position_scale) * inv_freq.
    """
    theta = float(config.get("rope_theta", 10000.0))
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    scaling = config.get("rope_scaling") or None
    position_scale = 1.0
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            pass
        elif rope_type == "linear":
            position_scale = float(scaling["factor"])
        elif rope_type == "llama3":
            factor = float(scaling["factor"])
            low_freq_factor = float(scaling["low_freq_factor"])
            high_freq_factor = float(scaling["high_freq_factor"])
            old_context_len = float(scaling["original_max_position_embeddings"])
            low_freq_wavelen = old_context_len / low_freq_factor
            high_freq_wavelen = old_context_len / high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
            is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
        else:
            raise NotImplementedError(f"rope_scaling type {rope_type!r}")
    return inv_freq, position_scale


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def round_to_e4m3(x):
    """x rounded to the nearest fp8 e4m3 value, ties to even, saturating at +-448 (CUDA's
    SATFINITE conversion; this torch has no float8 dtype). Below 2**-6 the spacing stays 2**-9
    (subnormals)."""
    _, exp = torch.frexp(x.abs().clamp(min=2.0 ** -6))   # |x| = m * 2**exp, m in [0.5, 1)
    quantum = torch.pow(torch.tensor(2.0, dtype=x.dtype), (exp - 4).to(x.dtype))  # 3 mantissa bits
    return (torch.round(x / quantum) * quantum).clamp(-448.0, 448.0)  # round: half to even


class Model:
    def __init__(self, model_dir, dtype=None, kv_dtype=None):
        """kv_dtype=torch.bfloat16 rounds every K (after RoPE) and V to bf16 before attention
        reads them, as a bf16 KV cache stores them (HF keeps bf16 KV for bf16 models);
        kv_dtype="fp8_e4m3" divides them by the layer's k_scale / v_scale (1 where the
        checkpoint has none), rounds to e4m3 and multiplies back, as an fp8 cache reads."""
        if torch is None:
            raise RuntimeError("torch not available")
        self.dtype = dtype or torch.float64
        self.kv_dtype = kv_dtype
        with open(os.path.join(model_dir, "config.json")) as f:
            self.config = cfg = json.load(f)
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            arch = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}.get(cfg.get("model_type"))
        if arch is None:
            raise NotImplementedError(f"unsupported architecture {archs} / {cfg.get('model_type')}")
        self.arch = arch
        self.hidden = cfg["hidden_size"]
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.n_heads
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act}")
        self.eos_ids = _eos_ids(cfg, model_dir)
        # Attention window: Mistral applies config.sliding_window in its causal mask (4.44
        # _update_causal_mask); Qwen2 only under flash-attention with use_sliding_window.
        self.sliding_window = None
        if arch == "mistral" and cfg.get("sliding_window"):
            self.sliding_window = int(cfg["sliding_window"])
        if arch == "qwen2" and cfg.get("use_sliding_window"):
            print("reference.py: warning: qwen2 use_sliding_window ignored (HF eager/sdpa "
                  "attention ignores it too)", file=sys.stderr)

        raw = read_model_weights(model_dir)
        dt = self.dtype
        W = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)).to(dt) for k, v in raw.items()}
        self.W = W

        if arch == "qwen2":
            self.qkv_bias, self.o_bias, self.mlp_bias = True, False, False
        elif arch == "llama":
            ab = bool(cfg.get("attention_bias", False))
            self.qkv_bias, self.o_bias, self.mlp_bias = ab, ab, bool(cfg.get("mlp_bias", False))
        else:
            self.qkv_bias, self.o_bias, self.mlp_bias = False, False, False

        self.embed = W["model.embed_tokens.weight"]
        if cfg.get("tie_word_embeddings", False):
            self.lm_head = self.embed
        elif "lm_head.weight" in W:
            self.lm_head = W["lm_head.weight"]
        else:
            raise ValueError("lm_head.weight missing and tie_word_embeddings is false")
        self.final_norm = W["model.norm.weight"]

        self.inv_freq, self.position_scale = compute_inv_freq(cfg, self.head_dim, dt)
        self.unused_weights = self._check_weights()
        if self.unused_weights:
            print(f"reference.py: warning: {len(self.unused_weights)} checkpoint tensors unused "
                  f"(as HF would ignore them): {self.unused_weights[:6]}", file=sys.stderr)
        self.lora = {}      # module name ("model.layers.0.self_attn.q_proj") -> (A, B, scale)
        self.direft = {}    # layer -> (W1, b1, W2)
        self.direft_prompt_positions = "all"

    def _check_weights(self):
        """Verifies every tensor the forward pass needs exists with the right shape; returns
        the names of checkpoint tensors it never reads."""
        H, KV, hd, d = self.n_heads, self.n_kv, self.head_dim, self.hidden
        inter = self.config["intermediate_size"]
        need = {"model.embed_tokens.weight": (self.config["vocab_size"], d),
                "model.norm.weight": (d,)}
        if self.lm_head is not self.embed:
            need["lm_head.weight"] = (self.config["vocab_size"], d)
        for l in range(self.n_layers):
            p = f"model.layers.{l}."
            need[p + "input_layernorm.weight"] = (d,)
            need[p + "post_attention_layernorm.weight"] = (d,)
            for n, out, inp, b in (("self_attn.q_proj", H * hd, d, self.qkv_bias),
                                   ("self_attn.k_proj", KV * hd, d, self.qkv_bias),
                                   ("self_attn.v_proj", KV * hd, d, self.qkv_bias),
                                   ("self_attn.o_proj", d, H * hd, self.o_bias),
                                   ("mlp.gate_proj", inter, d, self.mlp_bias),
                                   ("mlp.up_proj", inter, d, self.mlp_bias),
                                   ("mlp.down_proj", d, inter, self.mlp_bias)):
                need[p + n + ".weight"] = (out, inp)
                if b:
                    need[p + n + ".bias"] = (out,)
        for k, shape in need.items():
            if k not in self.W:
                raise ValueError(f"checkpoint lacks {k}")
            if tuple(self.W[k].shape) != shape:
                raise ValueError(f"{k}: shape {tuple(self.W[k].shape)}, expected {shape}")
        used = ("rotary_emb.inv_freq",)
        if self.kv_dtype == "fp8_e4m3":
            used += ("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")
        return sorted(k for k in self.W if k not in need and not k.endswith(used))

    # ---------------------------------------------------------------- adapters
    def load_adapter(self, adapter_dir):
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            acfg = json.load(f)
        tensors = read_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
        T = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)).to(self.dtype)
             for k, v in tensors.items()}
        ptype = str(acfg.get("peft_type", "")).upper()
        if ptype == "LORA":
            self._load_lora(acfg, T)
        elif ptype == "DIREFT":
            self._load_direft(acfg, T)
        else:
            raise NotImplementedError(f"peft_type {ptype}")
        return ptype

    def _load_lora(self, acfg, T):
        if acfg.get("fan_in_fan_out"):
            raise NotImplementedError("fan_in_fan_out")
        if acfg.get("bias", "none") != "none":
            raise NotImplementedError("LoRA bias training")
        if acfg.get("use_dora"):
            raise NotImplementedError("DoRA")
        r0 = acfg["r"]
        alpha0 = acfg["lora_alpha"]
        rank_pattern = acfg.get("rank_pattern") or {}
        alpha_pattern = acfg.get("alpha_pattern") or {}
        pattern_keys = list(rank_pattern.keys()) + list(alpha_pattern.keys())
        modules = {}
        for key, t in T.items():
            m = re.match(r"^(?:base_model\.model\.)?(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
            if not m:
                raise NotImplementedError(f"unsupported LoRA tensor {key}")
            modules.setdefault(m.group(1), {})[m.group(2)] = t
        for name, ab in modules.items():
            if "A" not in ab or "B" not in ab:
                raise ValueError(f"LoRA module {name} lacks A or B")
            # PEFT 0.12 LoraModel._create_and_replace: first pattern key matching ".*\.{key}$".
            target_key = next((k for k in pattern_keys if re.match(rf".*\.{k}$", name)), name)
            r = rank_pattern.get(target_key, r0)
            alpha = alpha_pattern.get(target_key, alpha0)
            if ab["A"].shape[0] != r:
                raise ValueError(f"{name}: lora_A rank {ab['A'].shape[0]} != configured r {r}")
            scale = alpha / math.sqrt(r) if acfg.get("use_rslora") else alpha / r
            self.lora[name] = (ab["A"], ab["B"], float(scale))

    def _load_direft(self, acfg, T):
        comp = acfg.get("component", "block_output")
        if comp != "block_output":
            raise NotImplementedError(f"DiReFT component {comp}")
        act = acfg.get("act_fn", "linear")
        if act not in ("linear", None, "identity"):
            raise NotImplementedError(f"DiReFT act_fn {act}")
        for layer in acfg["layers"]:
            p = f"layers.{layer}.direft."
            self.direft[int(layer)] = (T[p + "learned_source.weight"],
                                       T[p + "learned_source.bias"],
                                       T[p + "proj_layer.weight"])
        self.direft_prompt_positions = acfg.get("prompt_positions", "all") or "all"

    # ---------------------------------------------------------------- forward
    def _linear(self, name, x, lora_mask, bias=False):
        y = x @ self.W[name + ".weight"].T
        if bias:
            y = y + self.W[name + ".bias"]
        ad = self.lora.get(name)
        if ad is not None and lora_mask is not None and bool(lora_mask.any()):
            A, B, s = ad
            delta = ((x @ A.T) @ B.T) * s
            y = y + delta * lora_mask[:, None].to(y.dtype)
        return y

    def _kv_scale(self, prefix, which):
        """The fp8 scale of layer `prefix`'s K or V per KV head, shaped [KV, 1, 1]: the
        checkpoint's self_attn.{k,v}_scale (one, or one per head), else kv_scale, else 1."""
        w = self.W.get(prefix + f"self_attn.{which}_scale", self.W.get(prefix + "self_attn.kv_scale"))
        if w is None:
            return torch.ones((self.n_kv, 1, 1), dtype=self.dtype)
        return w.reshape(-1).expand(self.n_kv).reshape(self.n_kv, 1, 1)

    def _rmsnorm(self, x, w):
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + self.eps))

    def forward(self, ids, lora_mask=None, direft_mask=None):
        """Full causal forward over `ids` (positions 0..T-1). Masks are bool [T] tensors saying at
        which positions the adapter is applied. Returns logits [T, vocab] in self.dtype."""
        T = len(ids)
        x = self.embed[torch.tensor(ids, dtype=torch.long)]
        pos = torch.arange(T, dtype=self.dtype) / self.position_scale
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # [T, hd]
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        allowed = j <= i
        if self.sliding_window is not None:
            allowed = allowed & ((i - j) < self.sliding_window)
        neg = torch.full((T, T), float("-inf"), dtype=self.dtype)
        mask = torch.where(allowed, torch.zeros((), dtype=self.dtype), neg)
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        for l in range(self.n_layers):
            p = f"model.layers.{l}."
            h = self._rmsnorm(x, self.W[p + "input_layernorm.weight"])
            q = self._linear(p + "self_attn.q_proj", h, lora_mask, self.qkv_bias)
            k = self._linear(p + "self_attn.k_proj", h, lora_mask, self.qkv_bias)
            v = self._linear(p + "self_attn.v_proj", h, lora_mask, self.qkv_bias)
            q = q.view(T, H, hd).transpose(0, 1)   # [H, T, hd]
            k = k.view(T, KV, hd).transpose(0, 1)
            v = v.view(T, KV, hd).transpose(0, 1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if self.kv_dtype == "fp8_e4m3":          # what an fp8 cache reads back
                ks, vs = self._kv_scale(p, "k"), self._kv_scale(p, "v")
                k = round_to_e4m3(k / ks) * ks
                v = round_to_e4m3(v / vs) * vs
            elif self.kv_dtype is not None:          # what a cache of kv_dtype holds
                k = k.to(self.kv_dtype).to(self.dtype)
                v = v.to(self.kv_dtype).to(self.dtype)
            rep = H // KV                            # repeat_kv
            k = k[:, None].expand(KV, rep, T, hd).reshape(H, T, hd)
            v = v[:, None].expand(KV, rep, T, hd).reshape(H, T, hd)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(hd) + mask
            probs = torch.softmax(scores, dim=-1)
            attn = (probs @ v).transpose(0, 1).reshape(T, H * hd)
            attn = self._linear(p + "self_attn.o_proj", attn, lora_mask, self.o_bias)
            x = x + attn
            h = self._rmsnorm(x, self.W[p + "post_attention_layernorm.weight"])
            g = self._linear(p + "mlp.gate_proj", h, lora_mask, self.mlp_bias)
            u = self._linear(p + "mlp.up_proj", h, lora_mask, self.mlp_bias)
            m = self._linear(p + "mlp.down_proj", torch.nn.functional.silu(g) * u, lora_mask,
                             self.mlp_bias)
            x = x + m
            d = self.direft.get(l)
            if d is not None and direft_mask is not None and bool(direft_mask.any()):
                W1, b1, W2 = d
                delta = (x @ W1.T + b1) @ W2
                x = x + delta * direft_mask[:, None].to(x.dtype)
        x = self._rmsnorm(x, self.final_norm)
        return x @ self.lm_head.T

    # ---------------------------------------------------------------- masks
    def adapter_masks(self, prompt_len, total_len, adapter_positions):
        """Per-position adapter masks. adapter_positions: None (no adapter), "prompt", "all"."""
        if adapter_positions is None:
            return None, None
        idx = torch.arange(total_len)
        if adapter_positions == "prompt":
            base = idx < prompt_len
        elif adapter_positions == "all":
            base = torch.ones(total_len, dtype=torch.bool)
        else:
            raise ValueError(f"adapter positions {adapter_positions!r}")
        lora_mask = base if self.lora else None
        direft_mask = None
        if self.direft:
            sel = direft_prompt_selection(self.direft_prompt_positions, prompt_len)
            prompt_sel = torch.zeros(total_len, dtype=torch.bool)
            prompt_sel[:prompt_len] = torch.tensor(sel, dtype=torch.bool)
            gen = idx >= prompt_len
            direft_mask = prompt_sel | (gen & base)
        return lora_mask, direft_mask


def direft_prompt_selection(spec, prompt_len):
    """Which prompt positions pyreft intervenes on. "all" or "fN+lM" (also "fN", "lM").

    pyreft's get_intervention_locations clamps: first_n = min(L // 2, N), last_n = min(L // 2, M);
    positions = range(first_n) + range(L - last_n, L) (its padding entries point at pad tokens and
    are ignored here)."""
    L = prompt_len
    if spec in (None, "all"):
        return [True] * L
    m = re.fullmatch(r"(?:f(\d+))?\+?(?:l(\d+))?", spec)
    if not m or (m.group(1) is None and m.group(2) is None):
        raise ValueError(f"prompt_positions {spec!r}")
    n = int(m.group(1) or 0)
    last = int(m.group(2) or 0)
    first_n = min(L // 2, n)
    last_n = min(L // 2, last)
    sel = [False] * L
    for p in range(first_n):
        sel[p] = True
    for p in range(L - last_n, L):
        sel[p] = True
    return sel


# --------------------------------------------------------------------------------------------
# Greedy generation
# --------------------------------------------------------------------------------------------

def generate(model, prompt_ids, max_tokens, top_k=5, ignore_eos=False, adapter_positions=None,
             return_full=False):
    """Greedy decoding, recomputing the whole sequence each step (so per-position adapter masks
    reproduce what a KV-cached engine computes). Log-probs are log_softmax in float64."""
    ids = list(prompt_ids)
    L = len(prompt_ids)
    out_tokens, steps, full = [], [], []
    finish = "length"
    for _ in range(max_tokens):
        lora_mask, direft_mask = model.adapter_masks(L, len(ids), adapter_positions)
        with torch.no_grad():
            logits = model.forward(ids, lora_mask, direft_mask)[-1]
        lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
        lp_np = lp.numpy()
        tok = int(np.argmax(lp_np))
        order = np.argsort(-lp_np, kind="stable")
        top = [[int(t), float(lp_np[t])] for t in order[:top_k]]
        gap = float(lp_np[order[0]] - lp_np[order[1]]) if len(order) > 1 else float("inf")
        steps.append({"token_id": tok, "logprob": float(lp_np[tok]), "top": top, "gap": gap})
        if return_full:
            full.append(lp_np.copy())
        out_tokens.append(tok)
        ids.append(tok)
        if not ignore_eos and tok in model.eos_ids:
            finish = "stop"
            break
    result = {"prompt_ids": list(prompt_ids), "token_ids": out_tokens, "logprobs": steps,
              "finish_reason": finish}
    if return_full:
        return result, full
    return result


# --------------------------------------------------------------------------------------------
# Fixture self-check
# --------------------------------------------------------------------------------------------

def check_fixture(fixture_dir, modes=None, tol=1e-5, dtype=None, verbose=True):
    with open(os.path.join(fixture_dir, "reference.json")) as f:
        ref = json.load(f)
    cases = ref["cases"]
    if modes:
        cases = [c for c in cases if c["mode"] in modes]
    models = {}
    ok = True
    per_mode = {}
    for c in cases:
        key = c.get("adapter")
        if key not in models:
            m = Model(fixture_dir, dtype)
            if key:
                m.load_adapter(os.path.join(fixture_dir, key))
            models[key] = m
        m = models[key]
        res, full = generate(m, c["prompt_ids"], len(c["token_ids"]), top_k=5, ignore_eos=True,
                             adapter_positions=c.get("adapter_positions"), return_full=True)
        same = res["token_ids"] == c["token_ids"]
        diff = 0.0
        for i, st in enumerate(c["logprobs"]):
            if i >= len(full):
                break
            diff = max(diff, abs(full[i][st["token_id"]] - st["logprob"]))
            for tid, lpv in st["top"]:
                diff = max(diff, abs(full[i][tid] - lpv))
            diff = max(diff, abs(res["logprobs"][i]["gap"] - st["gap"]))
        case_ok = same and diff < tol
        ok = ok and case_ok
        pm = per_mode.setdefault(c["mode"], [0.0, True, 0])
        pm[0] = max(pm[0], diff)
        pm[1] = pm[1] and case_ok
        pm[2] += 1
        if verbose and not case_ok:
            print(f"  mismatch mode={c['mode']} prompt_len={len(c['prompt_ids'])}: "
                  f"tokens {'same' if same else 'DIFFER'} max|dlp|={diff:.3g}\n"
                  f"    ref    {c['token_ids']}\n    oracle {res['token_ids']}")
    if verbose:
        for mode, (d, mok, n) in per_mode.items():
            print(f"  mode {mode:8s} cases={n} tokens+lp {'ok ' if mok else 'BAD'} "
                  f"max|dlp|={d:.3e}")
        worst = max((v[0] for v in per_mode.values()), default=0.0)
        print(f"{'PASS' if ok else 'FAIL'}: oracle vs {fixture_dir}/reference.json "
              f"({len(cases)} cases, modes {','.join(per_mode)}), max |logprob diff| = {worst:.3e}"
              f" (tol {tol:g})")
    return ok, per_mode


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _parse_ids(s):
    return [int(t) for t in s.replace(" ", "").split(",") if t != ""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--prompt-ids")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--top-logprobs", type=int, default=5)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--adapter")
    ap.add_argument("--adapter-positions", choices=["prompt", "all"], default="all")
    ap.add_argument("--check-fixture", metavar="DIR")
    ap.add_argument("--modes", help="comma-separated fixture modes (default: all)")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args(argv)

    if torch is None:
        print("SKIP: torch not available (use /usr/bin/python3)")
        return SKIP
    torch.set_num_threads(2)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32

    if args.check_fixture:
        modes = args.modes.split(",") if args.modes else None
        ok, _ = check_fixture(args.check_fixture, modes, args.tol, dtype)
        return 0 if ok else 1

    if not args.model or args.prompt_ids is None:
        ap.error("--model and --prompt-ids are required")
    model = Model(args.model, dtype)
    positions = None
    if args.adapter:
        model.load_adapter(args.adapter)
        positions = args.adapter_positions
    res = generate(model, _parse_ids(args.prompt_ids), args.max_tokens, args.top_logprobs,
                   args.ignore_eos, positions)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
