#!/usr/bin/python3
"""Convert a pyreft (pyvene) checkpoint into preft's DiReFT adapter format.

Input: a folder written by pyreft's `ReftModel.save(dir)` (= pyvene `IntervenableModel.save`):
`config.json` (an IntervenableConfig: "representations", "intervention_types", ...) plus one
`intkey_{key}.bin` (torch.save of the intervention's state_dict) per intervention, key
`layer.{L}.comp.{component}.unit.{unit}.nunit.{n}#{i}`. A trainer checkpoint
(`ReftTrainer.save_model` -> `intervenable_model/`, no config.json) also works when
--intervention-type is given or the type can be inferred from the saved tensors.
If the folder holds pyreft's example `args.json` (examples/loreft/train.py), its "position",
"act_fn", "share_weights" and "model" entries are used as defaults.

Output: `adapter_config.json` ({"peft_type": "DIREFT", "r", "layers", "component":
"block_output", "act_fn": "linear", "prompt_positions", ["preft_positions"],
["base_model_name_or_path"]}) and `adapter_model.safetensors` (float32) with, per layer i,
`layers.{i}.direft.learned_source.weight` = W1 [r, d], `.learned_source.bias` = b1 [r],
`.proj_layer.weight` = W2 [r, d], for the intervention h' = h + (h W1^T + b1) W2.

Supported interventions (identity activation only), with R = rotate_layer.weight [d, r]
(orthonormal columns), W, b = learned_source, P = proj_layer.weight [r, d], pb = its bias:
  LoreftIntervention     h + (h W^T + b - h R) R^T      -> W1 = W - R^T, b1 = b,      W2 = R^T
  DireftIntervention     h + (h W^T + b) R^T            -> W1 = W,       b1 = b,      W2 = R^T
  NodireftIntervention   h + (h W^T + b) P              -> W1 = W,       b1 = b,      W2 = P
  NoreftIntervention     h + (h W^T + b - h P^T - pb) P -> W1 = W - P,   b1 = b - pb, W2 = P
  ConsreftIntervention   h + (b - h R) R^T              -> W1 = -R^T,    b1 = b,      W2 = R^T
  LobireftIntervention   h + b R^T                      -> W1 = 0,       b1 = b,      W2 = R^T
Layers of different rank are zero-padded to the largest rank (exact).

Usage:
  convert_pyreft.py --reft DIR --out DIR [--prompt-positions all|fN+lM]
                    [--positions prompt|all] [--base-model NAME]
                    [--act-fn NAME] [--intervention-type NAME]
Errors: a message on stderr and exit status 1.
"""

import argparse
import json
import os
import re
import struct
import sys

try:
    import numpy as np
    import torch
except ImportError:  # pragma: no cover - depends on the interpreter
    np = torch = None


class ConvertError(Exception):
    pass


# pyreft class name -> the form its forward has (see the module docstring).
SUPPORTED = {
    "LoreftIntervention": "loreft",
    "LoreftIntervention_IdentityInit": "loreft",  # same forward and state_dict as LoReFT
    "DireftIntervention": "direft",
    "NodireftIntervention": "nodireft",
    "NoreftIntervention": "noreft",
    "ConsreftIntervention": "consreft",
    "LobireftIntervention": "lobireft",
}
# Forms whose forward applies act_fn (ConsReFT and LobiReFT have none).
USES_ACT = {"loreft", "direft", "nodireft", "noreft"}
# transformers' ACT2FN names that are the identity.
IDENTITY_ACTS = {None, "", "linear", "identity", "none"}

POSITIONS_RE = re.compile(r"^(all|f\d+\+l\d+|f\d+|l\d+)$")
KEY_RE = re.compile(r"^layer\.(-?\d+)\.comp\.(.+)\.unit\.(.+)\.nunit\.(\d+)#(\d+)$")
KEY_NOLAYER_RE = re.compile(r"^comp\.(.+)\.unit\.(.+)\.nunit\.(\d+)#(\d+)$")
REPR_FIELDS = ["layer", "component", "unit", "max_number_of_units", "low_rank_dimension",
               "intervention_type", "intervention", "subspace_partition", "group_key",
               "intervention_link_key", "moe_key", "source_representation",
               "hidden_source_representation"]
REPR_DEFAULTS = {"layer": 0, "component": "block_output", "unit": "pos", "max_number_of_units": 1}


# ---------------------------------------------------------------------------------------------
# Reading the checkpoint
# ---------------------------------------------------------------------------------------------

def class_name(type_str):
    """"<class 'pyreft.interventions.LoreftIntervention'>" -> "LoreftIntervention"."""
    s = str(type_str).strip()
    m = re.match(r"^<class '([^']+)'>$", s)
    if m:
        s = m.group(1)
    return s.split(".")[-1]


def _repr_dict(rep):
    if isinstance(rep, dict):
        d = dict(rep)
    elif isinstance(rep, (list, tuple)):
        d = dict(zip(REPR_FIELDS, rep))
    else:
        raise ConvertError(f"config.json: unreadable representation entry {rep!r}")
    for k, v in REPR_DEFAULTS.items():
        if d.get(k) is None:
            d[k] = v
    return d


def representation_key(rep, counter):
    """pyvene IntervenableModel._get_representation_key."""
    l, c, u, n = rep["layer"], rep["component"], rep["unit"], rep["max_number_of_units"]
    proposal = f"comp.{c}.unit.{u}.nunit.{n}" if "." in str(c) else \
        f"layer.{l}.comp.{c}.unit.{u}.nunit.{n}"
    counter[proposal] = counter.get(proposal, -1) + 1
    return f"{proposal}#{counter[proposal]}"


def load_bin(path):
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except TypeError:  # torch < 1.13 has no weights_only
            sd = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - report any unpickling problem
        raise ConvertError(f"cannot read {path}: {e}") from e
    if not isinstance(sd, dict):
        raise ConvertError(f"{path}: expected a state dict, found {type(sd).__name__}")
    return sd


def find_checkpoint_dir(d):
    if not os.path.isdir(d):
        raise ConvertError(f"--reft {d}: not a directory")
    has = lambda p: any(f.startswith("intkey_") and f.endswith(".bin") for f in os.listdir(p))
    if has(d):
        return d
    sub = os.path.join(d, "intervenable_model")  # ReftTrainer.save_model layout
    if os.path.isdir(sub) and has(sub):
        return sub
    raise ConvertError(f"--reft {d}: no intkey_*.bin intervention files "
                       f"(expected a folder written by pyreft's ReftModel.save)")


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read {path}: {e}") from e


def infer_type(sd):
    if "rotate_layer" in sd:
        return "LoreftIntervention"
    if any(k.startswith("rotate_layer.") for k in sd):
        if "learned_source.weight" in sd:
            return "DireftIntervention"
        return None  # ConsReFT / LobiReFT: ambiguous
    return None  # proj_layer: NoReFT / NoDiReFT: ambiguous


def list_interventions(ckpt_dir, reft_dir, override_type, log):
    """[(key, class_name, rep_dict_or_None)] in pyvene's order."""
    cfg_path = None
    for d in (ckpt_dir, reft_dir):
        if os.path.isfile(os.path.join(d, "config.json")):
            cfg_path = os.path.join(d, "config.json")
            break
    files = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("intkey_") and f.endswith(".bin"))
    out = []
    if cfg_path is not None:
        cfg = read_json(cfg_path)
        if not isinstance(cfg, dict) or cfg.get("representations") is None:
            log(f"note: {cfg_path} is not a pyvene IntervenableConfig (no \"representations\"); "
                f"reading the interventions from the intkey_*.bin file names")
            cfg_path = None
    if cfg_path is not None:
        reps = cfg["representations"]
        if not isinstance(reps, list):
            reps = [reps]
        reps = [_repr_dict(r) for r in reps]
        types = cfg.get("intervention_types")
        if not isinstance(types, list):
            types = [types] * len(reps)
        if len(types) != len(reps):
            raise ConvertError(f"{cfg_path}: {len(types)} intervention_types for "
                               f"{len(reps)} representations")
        counter = {}
        for rep, t in zip(reps, types):
            key = representation_key(rep, counter)
            name = override_type or (class_name(t) if t is not None else None)
            out.append((key, name, rep))
        keys = {k for k, _, _ in out}
        missing = [k for k in keys if f"intkey_{k}.bin" not in files]
        if missing:
            raise ConvertError(f"{ckpt_dir}: config.json names intervention {missing[0]} but "
                               f"intkey_{missing[0]}.bin is missing")
        extra = [f for f in files if f[len("intkey_"):-len(".bin")] not in keys]
        if extra:
            raise ConvertError(f"{ckpt_dir}: {extra[0]} is not described by config.json")
    else:
        for f in files:
            out.append((f[len("intkey_"):-len(".bin")], override_type, None))
    return out


def parse_key(key):
    m = KEY_RE.match(key)
    if m:
        return int(m.group(1)), m.group(2), m.group(3), int(m.group(4)), int(m.group(5))
    m = KEY_NOLAYER_RE.match(key)
    if m:
        return None, m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
    raise ConvertError(f"unrecognised intervention key {key!r}")


# ---------------------------------------------------------------------------------------------
# Materialising weights
# ---------------------------------------------------------------------------------------------

def _f64(t, what):
    if not torch.is_tensor(t):
        raise ConvertError(f"{what}: expected a tensor, found {type(t).__name__}")
    return t.detach().to(torch.float64).cpu()


class _RotateLayer(torch.nn.Module if torch is not None else object):
    """Same parameter layout as pyreft's LowRankRotateLayer: weight [n, m]."""

    def __init__(self, n, m):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n, m, dtype=torch.float64))
        torch.nn.init.orthogonal_(self.weight)


def rotate_weight(sd, what):
    """rotate_layer.weight [d, r] as pyreft's forward sees it."""
    if "rotate_layer" in sd:  # LoReFT's own state_dict: the materialised weight
        return _f64(sd["rotate_layer"], what + " rotate_layer")
    if "rotate_layer.weight" in sd:  # an unparametrised save
        return _f64(sd["rotate_layer.weight"], what + " rotate_layer.weight")
    ok = "rotate_layer.parametrizations.weight.original"
    if ok not in sd:
        raise ConvertError(f"{what}: no rotate_layer weights (keys: {sorted(sd)})")
    sub = {k[len("rotate_layer."):]: _f64(v, what + " " + k)
           for k, v in sd.items() if k.startswith("rotate_layer.")}
    n, m = sub["parametrizations.weight.original"].shape
    use_triv = "parametrizations.weight.0.base" in sub
    # Rebuild the module exactly as pyreft does (torch.nn.utils.parametrizations.orthogonal with
    # its default map: matrix_exp for square, householder otherwise) and let torch compute .weight.
    mod = torch.nn.utils.parametrizations.orthogonal(_RotateLayer(n, m),
                                                     use_trivialization=use_triv)
    try:
        mod.load_state_dict(sub, strict=True)
    except RuntimeError as e:
        raise ConvertError(f"{what}: cannot load the orthogonal parametrisation of "
                           f"rotate_layer: {e}") from e
    with torch.no_grad():
        return mod.weight.detach().clone()


def linear(sd, name, what, bias=True):
    wk, bk = name + ".weight", name + ".bias"
    if wk not in sd:
        raise ConvertError(f"{what}: missing {wk} (keys: {sorted(sd)})")
    w = _f64(sd[wk], what + " " + wk)
    b = _f64(sd[bk], what + " " + bk) if bk in sd else None
    if bias and b is None:
        raise ConvertError(f"{what}: missing {bk}")
    return w, b


def to_direft(form, sd, what):
    """(W1 [r, d], b1 [r], W2 [r, d]) in float64 for one intervention."""
    if form in ("loreft", "direft", "consreft", "lobireft"):
        R = rotate_weight(sd, what)  # [d, r]
        if R.dim() != 2:
            raise ConvertError(f"{what}: rotate_layer weight has shape {tuple(R.shape)}")
        d, r = R.shape
        W2 = R.T.contiguous()
        if form in ("loreft", "direft"):
            if "learned_source.weight" in sd:
                W, b = linear(sd, "learned_source", what)
            elif "weight" in sd and "bias" in sd:
                # LoreftIntervention.state_dict stores learned_source's tensors unprefixed.
                W, b = _f64(sd["weight"], what + " weight"), _f64(sd["bias"], what + " bias")
            else:
                raise ConvertError(f"{what}: missing learned_source weights (keys: {sorted(sd)})")
            if tuple(W.shape) != (r, d) or tuple(b.shape) != (r,):
                raise ConvertError(f"{what}: learned_source {tuple(W.shape)}/{tuple(b.shape)} does "
                                   f"not match rotate_layer [{d}, {r}]")
            W1 = W - W2 if form == "loreft" else W
            return W1, b, W2
        if "learned_source" not in sd:
            raise ConvertError(f"{what}: missing learned_source (keys: {sorted(sd)})")
        b = _f64(sd["learned_source"], what + " learned_source")
        if tuple(b.shape) != (r,):
            raise ConvertError(f"{what}: learned_source {tuple(b.shape)} does not match rank {r}")
        W1 = -W2 if form == "consreft" else torch.zeros_like(W2)
        return W1.clone(), b, W2
    if form in ("noreft", "nodireft"):
        P, pb = linear(sd, "proj_layer", what, bias=False)
        W, b = linear(sd, "learned_source", what)
        if P.shape != W.shape or tuple(b.shape) != (W.shape[0],):
            raise ConvertError(f"{what}: proj_layer {tuple(P.shape)} and learned_source "
                               f"{tuple(W.shape)} disagree")
        if form == "nodireft":  # forward uses proj_layer.weight only; its bias is unused
            return W, b, P
        b1 = b - pb if pb is not None else b
        return W - P, b1, P
    raise AssertionError(form)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def write_safetensors(path, tensors):
    """tensors: {name: float64 torch tensor}; written as little-endian F32."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name].numpy().astype("<f4"))
        raw = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def convert(reft_dir, out_dir, prompt_positions=None, positions=None, base_model=None,
            act_fn=None, intervention_type=None, log=None):
    log = log or (lambda msg: print(msg, file=sys.stderr))
    ckpt = find_checkpoint_dir(reft_dir)
    args = {}
    for d in (ckpt, reft_dir):
        p = os.path.join(d, "args.json")
        if os.path.isfile(p):
            args = read_json(p)
            break

    # Activation: pyvene does not record the intervention's constructor arguments, so it comes
    # from --act-fn or pyreft's example args.json; pyreft's default (act_fn=None) is linear.
    act = act_fn if act_fn is not None else args.get("act_fn")
    act_norm = act.lower() if isinstance(act, str) else act

    # Positions.
    pp = prompt_positions if prompt_positions is not None else args.get("position")
    if pp is None:
        pp = "all"
        log("note: the checkpoint does not record its intervention positions; using "
            "prompt_positions \"all\" (pass --prompt-positions fN+lM to match pyreft training)")
    pp = str(pp).strip()
    if not POSITIONS_RE.match(pp):
        raise ConvertError(f"prompt positions {pp!r}: expected \"all\" or pyreft's fN+lM / fN / lM")
    if positions is not None and positions not in ("prompt", "all"):
        raise ConvertError(f"--positions {positions!r}: expected prompt or all")

    if intervention_type is not None:
        intervention_type = class_name(intervention_type)
    entries = list_interventions(ckpt, reft_dir, intervention_type, log)
    if not entries:
        raise ConvertError(f"{ckpt}: no interventions")

    pyt = os.path.join(ckpt, "pytorch_model.bin")
    if os.path.isfile(pyt):
        extra = load_bin(pyt)
        if extra:
            raise ConvertError(f"{pyt} holds {len(extra)} trained base-model tensors (e.g. "
                               f"{sorted(extra)[0]}); preft's DiReFT format carries only the "
                               f"interventions")

    per_layer = {}  # layer -> [(key, W1, b1, W2)]
    for key, name, rep in entries:
        layer, comp, unit, nunit, _ = parse_key(key)
        if comp != "block_output":
            raise ConvertError(f"intervention {key}: component {comp!r} is not supported "
                               f"(preft's DiReFT intervenes on \"block_output\" only)")
        if layer is None or layer < 0:
            raise ConvertError(f"intervention {key}: no layer index")
        if unit != "pos" or nunit != 1:
            raise ConvertError(f"intervention {key}: unit {unit!r} x {nunit} is not supported "
                               f"(only unit \"pos\", max_number_of_units 1)")
        if rep is not None and rep.get("subspace_partition") is not None:
            raise ConvertError(f"intervention {key}: subspace_partition is not supported")
        path = os.path.join(ckpt, f"intkey_{key}.bin")
        sd = load_bin(path)
        if name is None:
            name = infer_type(sd)
            if name is None:
                raise ConvertError(f"{path}: no config.json to name the intervention type and the "
                                   f"tensors ({sorted(sd)}) are ambiguous; pass "
                                   f"--intervention-type")
        form = SUPPORTED.get(name)
        if form is None:
            raise ConvertError(f"intervention {key}: type {name!r} is not supported (supported: "
                               f"{', '.join(sorted(SUPPORTED))})")
        if form in USES_ACT and act_norm not in IDENTITY_ACTS:
            raise ConvertError(f"act_fn {act!r} is not supported: preft's DiReFT applies the "
                               f"identity (\"linear\") activation only")
        W1, b1, W2 = to_direft(form, sd, f"intervention {key} ({name})")
        if rep is not None and rep.get("low_rank_dimension") not in (None, W1.shape[0]):
            raise ConvertError(f"intervention {key}: rank {W1.shape[0]} but config.json says "
                               f"low_rank_dimension {rep['low_rank_dimension']}")
        for t, what in ((W1, "W1"), (b1, "b1"), (W2, "W2")):
            if not bool(torch.isfinite(t).all()):
                raise ConvertError(f"intervention {key}: non-finite values in {what}")
        per_layer.setdefault(layer, []).append((key, W1, b1, W2))

    d = None
    layers = {}
    for layer, items in sorted(per_layer.items()):
        key0, W1, b1, W2 = items[0]
        for key, W1o, b1o, W2o in items[1:]:
            same = (W1o.shape == W1.shape and torch.equal(W1o, W1) and torch.equal(b1o, b1)
                    and torch.equal(W2o, W2))
            if not same:
                raise ConvertError(
                    f"layer {layer} has {len(items)} different interventions ({key0}, {key}): "
                    f"pyreft trains separate first-N and last-M interventions when a fN+lM run "
                    f"does not share weights; preft's DiReFT holds one intervention per layer "
                    f"(retrain with --share_weights)")
        if d is None:
            d = W1.shape[1]
        elif W1.shape[1] != d:
            raise ConvertError(f"layer {layer}: hidden size {W1.shape[1]} differs from {d}")
        layers[layer] = (W1, b1, W2)

    r = max(W1.shape[0] for W1, _, _ in layers.values())
    tensors = {}
    for layer, (W1, b1, W2) in layers.items():
        pad = r - W1.shape[0]
        if pad:
            W1 = torch.cat([W1, W1.new_zeros(pad, d)])
            b1 = torch.cat([b1, b1.new_zeros(pad)])
            W2 = torch.cat([W2, W2.new_zeros(pad, d)])
        p = f"layers.{layer}.direft."
        tensors[p + "learned_source.weight"] = W1
        tensors[p + "learned_source.bias"] = b1
        tensors[p + "proj_layer.weight"] = W2

    cfg = {"peft_type": "DIREFT", "r": int(r), "layers": sorted(layers), "component": "block_output",
           "act_fn": "linear", "prompt_positions": pp}
    if positions is not None:
        cfg["preft_positions"] = positions
    bm = base_model if base_model is not None else args.get("model")
    if bm:
        cfg["base_model_name_or_path"] = str(bm)

    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reft", required=True, help="pyreft checkpoint folder (ReftModel.save)")
    ap.add_argument("--out", required=True, help="output DiReFT adapter folder")
    ap.add_argument("--prompt-positions", help="all | fN+lM | fN | lM (default: args.json's "
                    "\"position\", else all)")
    ap.add_argument("--positions", choices=["prompt", "all"],
                    help="preft_positions: serve on prompt tokens only (DiReFTP) or all tokens")
    ap.add_argument("--base-model", help="base_model_name_or_path to record")
    ap.add_argument("--act-fn", help="the interventions' act_fn when args.json does not say "
                    "(pyvene does not save it); only linear/identity convert")
    ap.add_argument("--intervention-type", help="pyreft class name, when config.json is absent "
                    "or to override it")
    a = ap.parse_args(argv)
    if torch is None:
        print("convert_pyreft: needs torch and numpy (use /usr/bin/python3)", file=sys.stderr)
        return 1
    try:
        cfg = convert(a.reft, a.out, a.prompt_positions, a.positions, a.base_model, a.act_fn,
                      a.intervention_type)
    except ConvertError as e:
        print(f"convert_pyreft: error: {e}", file=sys.stderr)
        return 1
    print(f"convert_pyreft: wrote {a.out}: DiReFT r={cfg['r']} layers={cfg['layers']} "
          f"prompt_positions={cfg['prompt_positions']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
