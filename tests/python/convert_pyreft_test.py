#!/usr/bin/python3
"""Tests scripts/convert_pyreft.py (pyreft checkpoint -> preft DiReFT adapter).

Builds pyreft-format checkpoints synthetically: intervention modules written like pyreft's
(pyreft/interventions.py: the same layers, the same torch orthogonal parametrisation, LoReFT's
own state_dict), with random "trained" weights, saved the way pyvene's IntervenableModel.save does
(config.json + intkey_{key}.bin per intervention). Each is converted with the CLI and, for random
h, the converted W1, b1, W2 must reproduce the original module's forward (float64) to 1e-5.
Refusals (unknown type, non-identity act_fn, other component, ...) must exit 1 with a message.

With --fixture DIR (the shared tiny-llama), also checks with tests/python/reference.py that a
converted LoReFT adapter generates what the original LoReFT forward gives (applied through an
exact full-rank affine adapter measured from that forward).

Run with /usr/bin/python3 (torch + numpy); exits 77 (skip) without torch.
"""

import argparse
import copy
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections import OrderedDict

try:
    import numpy as np
    import torch
except ImportError:  # pragma: no cover - depends on the interpreter
    print("SKIP: torch not available (use /usr/bin/python3)")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONVERTER = os.path.join(ROOT, "scripts", "convert_pyreft.py")
sys.path.insert(0, HERE)
import reference  # noqa: E402  (the project's float64 oracle; read_safetensors, Model)

D, R, NLAYERS = 64, 4, 3
TOL = 1e-5

# ---------------------------------------------------------------------------------------------
# pyreft-form interventions (structure and forward as in pyreft/interventions.py)
# ---------------------------------------------------------------------------------------------


class LowRankRotateLayer(torch.nn.Module):
    def __init__(self, n, m):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n, m))
        torch.nn.init.orthogonal_(self.weight)

    def forward(self, x):
        return torch.matmul(x.to(self.weight.dtype), self.weight)


def _rotate(d, r):
    return torch.nn.utils.parametrizations.orthogonal(LowRankRotateLayer(d, r))


class Loreft(torch.nn.Module):
    name = "LoreftIntervention"

    def __init__(self, d, r, dtype=torch.float32):
        super().__init__()
        self.rotate_layer = _rotate(d, r)
        self.learned_source = torch.nn.Linear(d, r).to(dtype)

    def forward(self, base):
        rotated = self.rotate_layer(base)
        return base + torch.matmul(self.learned_source(base) - rotated, self.rotate_layer.weight.T)

    def state_dict(self, *args, **kwargs):  # pyreft's override
        sd = OrderedDict()
        for k, v in self.learned_source.state_dict().items():
            sd[k] = v
        sd["rotate_layer"] = self.rotate_layer.weight.data
        return sd


class Direft(torch.nn.Module):
    name = "DireftIntervention"

    def __init__(self, d, r, dtype=torch.float32):
        super().__init__()
        self.rotate_layer = _rotate(d, r)
        self.learned_source = torch.nn.Linear(d, r).to(dtype)

    def forward(self, base):
        return base + torch.matmul(self.learned_source(base), self.rotate_layer.weight.T)


class Nodireft(torch.nn.Module):
    name = "NodireftIntervention"

    def __init__(self, d, r, dtype=torch.float32, add_bias=True):
        super().__init__()
        self.proj_layer = torch.nn.Linear(d, r, bias=add_bias).to(dtype)
        self.learned_source = torch.nn.Linear(d, r).to(dtype)

    def forward(self, base):
        return base + torch.matmul(self.learned_source(base), self.proj_layer.weight)


class Noreft(torch.nn.Module):
    name = "NoreftIntervention"

    def __init__(self, d, r, dtype=torch.float32, add_bias=True):
        super().__init__()
        self.proj_layer = torch.nn.Linear(d, r, bias=add_bias).to(dtype)
        self.learned_source = torch.nn.Linear(d, r).to(dtype)

    def forward(self, base):
        proj_base = self.proj_layer(base)
        return base + torch.matmul(self.learned_source(base) - proj_base, self.proj_layer.weight)


class Consreft(torch.nn.Module):
    name = "ConsreftIntervention"

    def __init__(self, d, r, dtype=torch.float32):
        super().__init__()
        self.rotate_layer = _rotate(d, r)
        self.learned_source = torch.nn.Parameter(torch.rand(r))

    def forward(self, base):
        return base + torch.matmul(self.learned_source - self.rotate_layer(base),
                                   self.rotate_layer.weight.T)


class Lobireft(torch.nn.Module):
    name = "LobireftIntervention"

    def __init__(self, d, r, dtype=torch.float32):
        super().__init__()
        self.rotate_layer = _rotate(d, r)
        self.learned_source = torch.nn.Parameter(torch.rand(r))

    def forward(self, base):
        return base + torch.matmul(self.learned_source, self.rotate_layer.weight.T)


def make(cls, d=D, r=R, seed=0, **kw):
    """An intervention with random 'trained' weights (the orthogonal parametrisation's
    unconstrained tensor is perturbed too, so .weight is not just its initial value)."""
    torch.manual_seed(seed)
    m = cls(d, r, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "parametrizations" in name else 0.15))
    m.eval()
    return m


def forward64(mod, h):
    m = copy.deepcopy(mod).double()
    with torch.no_grad():
        return m(h)


# ---------------------------------------------------------------------------------------------
# pyvene-style saving
# ---------------------------------------------------------------------------------------------


def rep_key(layer, comp, counter):
    proposal = f"comp.{comp}.unit.pos.nunit.1" if "." in comp else \
        f"layer.{layer}.comp.{comp}.unit.pos.nunit.1"
    counter[proposal] = counter.get(proposal, -1) + 1
    return f"{proposal}#{counter[proposal]}"


def save_pyvene(out, items, args=None, with_config=True, type_names=None, model_bin=None):
    """items: [(layer, component, module)] in representation order (IntervenableModel.save)."""
    os.makedirs(out, exist_ok=True)
    counter, keys, reps, types = {}, [], [], []
    for i, (layer, comp, mod) in enumerate(items):
        key = rep_key(layer, comp, counter)
        keys.append(key)
        torch.save(mod.state_dict(), os.path.join(out, f"intkey_{key}.bin"))
        r = mod.learned_source.weight.shape[0] if isinstance(mod.learned_source, torch.nn.Linear) \
            else mod.learned_source.shape[0]
        # RepresentationConfig serialised by json as a list (namedtuple field order).
        reps.append([layer, comp, "pos", 1, r, None, None, None, None, None, None, None, None])
        name = type_names[i] if type_names else mod.name
        types.append(f"<class 'pyreft.interventions.{name}'>")
    if with_config:
        cfg = {"representations": reps, "intervention_types": types, "mode": "parallel",
               "sorted_keys": keys,
               "model_type": "<class 'transformers.models.llama.modeling_llama.LlamaForCausalLM'>",
               "intervention_dimensions": [D] * len(keys),
               "intervention_constant_sources": [True] * len(keys),
               "transformers_version": "4.44.2"}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    if args is not None:
        with open(os.path.join(out, "args.json"), "w") as f:
            json.dump(args, f, indent=4)
    if model_bin is not None:
        torch.save(model_bin, os.path.join(out, "pytorch_model.bin"))
    return keys


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)
    return cond


def run_conv(*argv):
    p = subprocess.run([sys.executable, CONVERTER] + [str(a) for a in argv],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    return p.returncode, p.stdout, p.stderr


def load_adapter(d):
    with open(os.path.join(d, "adapter_config.json")) as f:
        cfg = json.load(f)
    T = reference.read_safetensors(os.path.join(d, "adapter_model.safetensors"))
    T = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in T.items()}
    return cfg, T


def direft_apply(T, layer, h):
    p = f"layers.{layer}.direft."
    return h + (h @ T[p + "learned_source.weight"].T + T[p + "learned_source.bias"]) \
        @ T[p + "proj_layer.weight"]


def check_equivalent(label, out_dir, items, r=R):
    cfg, T = load_adapter(out_dir)
    layers = sorted({l for l, _, _ in items})
    check(cfg.get("peft_type") == "DIREFT" and cfg.get("r") == r and cfg.get("layers") == layers
          and cfg.get("component") == "block_output" and cfg.get("act_fn") == "linear",
          f"{label}: adapter_config {cfg}")
    torch.manual_seed(123)
    h = torch.randn(16, D, dtype=torch.float64) * 2.0
    worst, moved = 0.0, 0.0
    for layer, _, mod in items:
        p = f"layers.{layer}.direft."
        shapes = (tuple(T[p + "learned_source.weight"].shape), tuple(T[p + "learned_source.bias"].shape),
                  tuple(T[p + "proj_layer.weight"].shape))
        if not check(shapes == ((r, D), (r,), (r, D)), f"{label}: layer {layer} shapes {shapes}"):
            continue
        want = forward64(mod, h)
        got = direft_apply(T, layer, h)
        worst = max(worst, float((want - got).abs().max()))
        moved = max(moved, float((want - h).abs().max()))
    check(worst < TOL and moved > 1e-2,
          f"{label}: converted == original forward (max |diff| {worst:.2e}, |delta| up to {moved:.2f})")
    return cfg


def expect_refusal(label, argv, needle):
    rc, out, err = run_conv(*argv)
    check(rc == 1 and needle in err and "Traceback" not in err,
          f"{label}: exit {rc}, stderr mentions {needle!r}: {err.strip()[:200]!r}")


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def test_types(tmp):
    cases = [
        ("loreft", lambda s: make(Loreft, seed=s)),
        ("direft", lambda s: make(Direft, seed=s)),
        ("nodireft_bias_bf16", lambda s: make(Nodireft, seed=s, dtype=torch.bfloat16)),
        ("nodireft_nobias", lambda s: make(Nodireft, seed=s, add_bias=False)),
        ("noreft_bias", lambda s: make(Noreft, seed=s)),
        ("noreft_nobias", lambda s: make(Noreft, seed=s, add_bias=False)),
        ("consreft", lambda s: make(Consreft, seed=s)),
        ("lobireft", lambda s: make(Lobireft, seed=s)),
    ]
    for label, mk in cases:
        items = [(l, "block_output", mk(10 * l + 1)) for l in range(NLAYERS)]
        src, dst = os.path.join(tmp, label), os.path.join(tmp, label + "_out")
        save_pyvene(src, items)
        rc, out, err = run_conv("--reft", src, "--out", dst)
        if check(rc == 0, f"{label}: convert exit {rc} {err.strip()[-300:]}"):
            cfg = check_equivalent(label, dst, items)
            check(cfg.get("prompt_positions") == "all" and "preft_positions" not in cfg,
                  f"{label}: default positions")


def test_options_and_args_json(tmp):
    items = [(l, "block_output", make(Loreft, seed=40 + l)) for l in range(NLAYERS)]
    src = os.path.join(tmp, "loreft_args")
    save_pyvene(src, items, args={"position": "f1+l1", "act_fn": None, "share_weights": True,
                                  "model": "yahma/llama-7b-hf", "intervention_type":
                                  "LoreftIntervention"})
    dst = os.path.join(tmp, "loreft_args_out")
    rc, _, err = run_conv("--reft", src, "--out", dst)
    if check(rc == 0, f"args.json: convert exit {rc} {err.strip()[-300:]}"):
        cfg = check_equivalent("args.json", dst, items)
        check(cfg.get("prompt_positions") == "f1+l1"
              and cfg.get("base_model_name_or_path") == "yahma/llama-7b-hf",
              f"args.json: position and model taken over: {cfg}")
    dst2 = os.path.join(tmp, "loreft_args_out2")
    rc, _, err = run_conv("--reft", src, "--out", dst2, "--prompt-positions", "f3+l2",
                          "--positions", "prompt", "--base-model", "tiny-llama")
    if check(rc == 0, f"CLI options: convert exit {rc} {err.strip()[-300:]}"):
        cfg, _ = load_adapter(dst2)
        check(cfg.get("prompt_positions") == "f3+l2" and cfg.get("preft_positions") == "prompt"
              and cfg.get("base_model_name_or_path") == "tiny-llama",
              f"CLI options override: {cfg}")


def test_mixed_and_layouts(tmp):
    # Different types and ranks per layer (pyvene allows it): padded to the largest rank.
    items = [(0, "block_output", make(Loreft, r=4, seed=51)),
             (1, "block_output", make(Direft, r=2, seed=52)),
             (2, "block_output", make(Noreft, r=3, seed=53))]
    src, dst = os.path.join(tmp, "mixed"), os.path.join(tmp, "mixed_out")
    save_pyvene(src, items)
    rc, _, err = run_conv("--reft", src, "--out", dst)
    if check(rc == 0, f"mixed types/ranks: convert exit {rc} {err.strip()[-300:]}"):
        check_equivalent("mixed types/ranks", dst, items, r=4)

    # Only some layers.
    items = [(1, "block_output", make(Direft, seed=61))]
    src, dst = os.path.join(tmp, "one_layer"), os.path.join(tmp, "one_layer_out")
    save_pyvene(src, items)
    rc, _, err = run_conv("--reft", src, "--out", dst)
    if check(rc == 0, f"one layer: convert exit {rc} {err.strip()[-300:]}"):
        check_equivalent("one layer", dst, items)

    # ReftTrainer.save_model layout: DIR/intervenable_model/ without config.json, with an empty
    # pytorch_model.bin. LoReFT and DiReFT are recognised from their tensors.
    for cls in (Loreft, Direft):
        items = [(l, "block_output", make(cls, seed=70 + l)) for l in range(NLAYERS)]
        top = os.path.join(tmp, "trainer_" + cls.__name__)
        save_pyvene(os.path.join(top, "intervenable_model"), items, with_config=False,
                    model_bin={})
        dst = top + "_out"
        rc, _, err = run_conv("--reft", top, "--out", dst)
        if check(rc == 0, f"trainer layout {cls.name}: convert exit {rc} {err.strip()[-300:]}"):
            check_equivalent(f"trainer layout {cls.name}", dst, items)
    # ... NoDiReFT/NoReFT are not: --intervention-type is needed.
    items = [(l, "block_output", make(Nodireft, seed=80 + l)) for l in range(NLAYERS)]
    src = os.path.join(tmp, "trainer_nodireft")
    save_pyvene(src, items, with_config=False)
    expect_refusal("no config, ambiguous tensors", ["--reft", src, "--out", src + "_out"],
                   "--intervention-type")
    rc, _, err = run_conv("--reft", src, "--out", src + "_out", "--intervention-type",
                          "NodireftIntervention")
    if check(rc == 0, f"--intervention-type: convert exit {rc} {err.strip()[-300:]}"):
        check_equivalent("--intervention-type", src + "_out", items)

    # fN+lM without share_weights: pyreft doubles the layers (keys #0 first-N, #1 last-M).
    items = [(l, "block_output", make(Loreft, seed=90 + l)) for l in range(NLAYERS)]
    twins = [(l, c, copy.deepcopy(m)) for l, c, m in items]
    src = os.path.join(tmp, "shared_twins")
    save_pyvene(src, items + twins, args={"position": "f2+l2", "share_weights": False})
    rc, _, err = run_conv("--reft", src, "--out", src + "_out")
    if check(rc == 0, f"identical #0/#1 interventions: convert exit {rc} {err.strip()[-300:]}"):
        check_equivalent("identical #0/#1 interventions", src + "_out", items)
    other = [(l, "block_output", make(Loreft, seed=95 + l)) for l in range(NLAYERS)]
    src = os.path.join(tmp, "separate_twins")
    save_pyvene(src, items + other, args={"position": "f2+l2", "share_weights": False})
    expect_refusal("separate first/last interventions", ["--reft", src, "--out", src + "_out"],
                   "share")


def test_refusals(tmp):
    base = [(l, "block_output", make(Loreft, seed=100 + l)) for l in range(NLAYERS)]

    src = os.path.join(tmp, "unknown_type")
    save_pyvene(src, base, type_names=["ConditionedSourceLowRankRotatedSpaceIntervention"] * 3)
    expect_refusal("unknown intervention type", ["--reft", src, "--out", src + "_out"],
                   "ConditionedSourceLowRankRotatedSpaceIntervention")

    src = os.path.join(tmp, "relu")
    save_pyvene(src, base, args={"position": "f1+l1", "act_fn": "relu"})
    expect_refusal("act_fn relu (args.json)", ["--reft", src, "--out", src + "_out"], "relu")
    src_ok = os.path.join(tmp, "plain")
    save_pyvene(src_ok, base)
    expect_refusal("act_fn gelu (--act-fn)",
                   ["--reft", src_ok, "--out", src_ok + "_out", "--act-fn", "gelu"], "gelu")

    src = os.path.join(tmp, "mlp_output")
    save_pyvene(src, [(l, "mlp_output", m) for l, _, m in base])
    expect_refusal("component mlp_output", ["--reft", src, "--out", src + "_out"], "mlp_output")

    src = os.path.join(tmp, "trained_model_params")
    save_pyvene(src, base, model_bin={"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
    expect_refusal("trained base-model tensors", ["--reft", src, "--out", src + "_out"],
                   "pytorch_model.bin")

    expect_refusal("bad --prompt-positions",
                   ["--reft", src_ok, "--out", src_ok + "_o2", "--prompt-positions", "x3"], "x3")
    expect_refusal("missing folder", ["--reft", os.path.join(tmp, "nope"), "--out",
                                      os.path.join(tmp, "nope_out")], "nope")
    check(not os.path.exists(src_ok + "_out") and not os.path.exists(src + "_out"),
          "refused conversions write nothing")


# ---------------------------------------------------------------------------------------------
# End to end through the oracle (reference.py) on the tiny-llama fixture
# ---------------------------------------------------------------------------------------------


def write_safetensors_f64(path, tensors):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name].numpy().astype("<f8")).tobytes()
        header[name] = {"dtype": "F64", "shape": list(tensors[name].shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def affine_adapter(out, items, d, prompt_positions):
    """The original interventions as exact full-rank DiReFT adapters, measured as black boxes:
    f(h) = h + h M + c, so W1 = [I; 0], b1 = [0; 1], W2 = [M; c] (rank d + 1)."""
    os.makedirs(out, exist_ok=True)
    T = {}
    for layer, _, mod in items:
        zero = torch.zeros(1, d, dtype=torch.float64)
        eye = torch.eye(d, dtype=torch.float64)
        c = forward64(mod, zero)[0]
        M = forward64(mod, eye) - eye - c
        p = f"layers.{layer}.direft."
        T[p + "learned_source.weight"] = torch.cat([eye, zero])
        T[p + "learned_source.bias"] = torch.cat([torch.zeros(d, dtype=torch.float64),
                                                  torch.ones(1, dtype=torch.float64)])
        T[p + "proj_layer.weight"] = torch.cat([M, c[None]])
    write_safetensors_f64(os.path.join(out, "adapter_model.safetensors"), T)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "DIREFT", "r": d + 1, "layers": sorted(l for l, _, _ in items),
                   "component": "block_output", "act_fn": "linear",
                   "prompt_positions": prompt_positions}, f)


def test_oracle(tmp, fixture):
    with open(os.path.join(fixture, "config.json")) as f:
        mcfg = json.load(f)
    d, n = mcfg["hidden_size"], mcfg["num_hidden_layers"]
    items = []
    for l in range(n):
        m = make(Loreft, d=d, r=R, seed=200 + l)
        with torch.no_grad():  # a strong enough edit to move the generations
            m.learned_source.weight.mul_(4.0)
            m.learned_source.bias.mul_(4.0)
        items.append((l, "block_output", m))
    src = os.path.join(tmp, "oracle_loreft")
    save_pyvene(src, items)
    torch.set_num_threads(2)
    base_model = reference.Model(fixture, torch.float64)
    prompts = [[298, 10, 20, 30, 40, 50, 60, 70], [298, 5, 7, 11, 13]]
    for pp in ("all", "f1+l1"):
        conv = os.path.join(tmp, f"oracle_conv_{pp}")
        rc, _, err = run_conv("--reft", src, "--out", conv, "--prompt-positions", pp)
        if not check(rc == 0, f"oracle {pp}: convert exit {rc} {err.strip()[-300:]}"):
            continue
        orig = os.path.join(tmp, f"oracle_orig_{pp}")
        affine_adapter(orig, items, d, pp)
        m_conv, m_orig = reference.Model(fixture, torch.float64), reference.Model(fixture, torch.float64)
        m_conv.load_adapter(conv)
        m_orig.load_adapter(orig)
        for positions in ("all", "prompt"):
            for ids in prompts:
                a, fa = reference.generate(m_conv, ids, 10, ignore_eos=True,
                                           adapter_positions=positions, return_full=True)
                b, fb = reference.generate(m_orig, ids, 10, ignore_eos=True,
                                           adapter_positions=positions, return_full=True)
                _, f0 = reference.generate(base_model, ids, 10, ignore_eos=True, return_full=True)
                diff = max(float(np.abs(x - y).max()) for x, y in zip(fa, fb))
                effect = float(np.abs(fa[0] - f0[0]).max())
                # 1e-4: the converted adapter is stored in float32, the measured one in float64.
                check(a["token_ids"] == b["token_ids"] and diff < 1e-4 and effect > 1e-2,
                      f"oracle prompt_positions={pp} positions={positions} len={len(ids)}: "
                      f"same tokens {a['token_ids'] == b['token_ids']}, max |dlogprob| "
                      f"{diff:.2e}, adapter effect {effect:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixture", help="tiny-llama fixture folder for the oracle check")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tmp = tempfile.mkdtemp(prefix="convert_pyreft_")
    try:
        test_types(tmp)
        test_options_and_args_json(tmp)
        test_mixed_and_layouts(tmp)
        test_refusals(tmp)
        if a.fixture:
            if os.path.isfile(os.path.join(a.fixture, "config.json")):
                test_oracle(tmp, a.fixture)
            else:
                print(f"note: no fixture at {a.fixture}; oracle check skipped")
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    if FAILS:
        print(f"FAIL: {len(FAILS)} check(s) failed")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
