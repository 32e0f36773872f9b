#!/usr/bin/python3
"""Drive the preft CLI and compare its greedy generations with the Python oracle / a fixture.

  compare_preft.py --preft build/tools/preft --preset tiny|tiny-qwen2|tiny-mistral --workdir DIR
      For a couple of seeds: `preft make-model --preset P --dtype f32 --seed S --out ...`, then for
      several prompts (lengths 3..70+, crossing 16-token KV blocks and the llama3
      original_max_position_embeddings) runs
      `preft generate --model M --prompt-ids ... --max-tokens 16 --logprobs 5 --json --ignore-eos`
      and the float64 oracle (reference.py). Needs torch (exit 77 "SKIP: torch not available").

  compare_preft.py --preft build/tools/preft --fixture shared/fixtures/tiny-llama --modes base
      Runs preft on each case of DIR/reference.json for the requested modes (numpy/json only).
      Adapter modes pass `--adapter DIR/<adapter> --adapter-positions prompt|all` to preft.

Criteria: identical token ids, and max |logprob diff| < tol (1e-4) over the chosen tokens and the
top-K entries (matched by token id). A divergence is tolerated (reported as a NOTE, comparison of
that case stops there) only at an exact near-tie: the reference's margin between its token and
preft's token is below tol; --strict turns that off. Prints a PASS/FAIL line; exits 0/1 (77 = skip).
"""

import argparse
import json
import os
import subprocess
import sys

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, timeout=240):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"command failed (rc={p.returncode}): {' '.join(cmd)}\n"
                           f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p.stdout


def parse_json_output(text):
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON object in preft output: {text[:500]!r}")
    obj, _ = json.JSONDecoder().raw_decode(text[start:])
    return obj


def norm_top(top):
    """[[id, lp], ...] or [{"token_id", "logprob"}, ...] -> [(id, lp), ...]."""
    out = []
    for e in top:
        if isinstance(e, dict):
            out.append((int(e["token_id"]), float(e["logprob"])))
        else:
            out.append((int(e[0]), float(e[1])))
    return out


KV_DTYPE = "auto"  # preft generate --kv-dtype (main sets it from --kv-dtype)


def preft_generate(preft, model_dir, prompt_ids, max_tokens, k, ignore_eos=True, adapter=None,
                   positions=None):
    cmd = [preft, "generate", "--model", model_dir,
           "--prompt-ids", ",".join(str(t) for t in prompt_ids),
           "--max-tokens", str(max_tokens), "--logprobs", str(k), "--json",
           "--kv-dtype", KV_DTYPE]
    if ignore_eos:
        cmd.append("--ignore-eos")
    if adapter:
        cmd += ["--adapter", adapter, "--adapter-positions", positions]
    return parse_json_output(run(cmd))


class Verdict:
    def __init__(self):
        self.max_diff = 0.0
        self.failures = []
        self.notes = []
        self.cases = 0


def compare_case(label, got, ref_tokens, ref_lp_of, ref_topk, ref_margin, k, tol, strict, v,
                 expect_len=None):
    """Compare one preft result with a reference.

    ref_lp_of(i, tok) -> reference logprob of `tok` at step i, or None if unknown;
    ref_topk(i) -> reference top-k [(id, lp)] at step i; ref_margin(i, tok) -> reference
    (top1 lp - lp(tok)) or None."""
    v.cases += 1
    toks = [int(t) for t in got.get("token_ids", [])]
    steps = got.get("logprobs") or []
    case_diff = 0.0
    problems = []
    if expect_len is not None and len(toks) != expect_len:
        problems.append(f"generated {len(toks)} tokens, expected {expect_len} "
                        f"(finish_reason={got.get('finish_reason')})")
    if len(steps) != len(toks):
        problems.append(f"{len(steps)} logprob entries for {len(toks)} tokens")
    n = min(len(toks), len(ref_tokens), len(steps))
    stopped = False
    for i in range(n):
        st = steps[i]
        tok = toks[i]
        if int(st.get("token_id", tok)) != tok:
            problems.append(f"step {i}: logprobs.token_id {st.get('token_id')} != token {tok}")
        if tok != ref_tokens[i]:
            margin = ref_margin(i, tok)
            if not strict and margin is not None and margin < tol:
                v.notes.append(f"{label}: near-tie divergence at step {i} (ref {ref_tokens[i]}, "
                               f"preft {tok}, ref margin {margin:.2e}); later steps not compared")
                n, stopped = i, True  # stop comparing: contexts differ from here on
                break
            problems.append(f"step {i}: token {tok} != reference {ref_tokens[i]} "
                            f"(ref margin {margin if margin is None else f'{margin:.3e}'})")
            n, stopped = i, True
            break
        lp_ref = ref_lp_of(i, tok)
        d = abs(float(st["logprob"]) - lp_ref)
        case_diff = max(case_diff, d)
        top = norm_top(st.get("top") or [])
        rtop = ref_topk(i)
        if len(top) != min(k, len(rtop)) and len(top) != k:
            problems.append(f"step {i}: {len(top)} top entries, expected {k}")
        kth = rtop[min(k, len(rtop)) - 1][1]
        for j, (tid, lp) in enumerate(top):
            if j and lp > top[j - 1][1] + 1e-12:
                problems.append(f"step {i}: top list not sorted at {j}")
            r = ref_lp_of(i, tid)
            if r is None:
                # fixture: id outside the reference's top-k; allowed only as a boundary tie
                if lp > kth + tol:
                    problems.append(f"step {i}: top id {tid} (lp {lp:.6f}) not in reference "
                                    f"top-{k} (kth {kth:.6f})")
                continue
            case_diff = max(case_diff, abs(lp - r))
            if r < kth - tol:
                problems.append(f"step {i}: top id {tid} has reference lp {r:.6f} below "
                                f"the reference k-th {kth:.6f}")
    if not stopped and len(toks) != len(ref_tokens):
        problems.append(f"length {len(toks)} != reference {len(ref_tokens)}")
    v.max_diff = max(v.max_diff, case_diff)
    if case_diff >= tol:
        problems.append(f"max |logprob diff| {case_diff:.3e} >= {tol:g}")
    status = "ok" if not problems else "FAIL"
    print(f"  {status:4s} {label}: tokens {n}/{len(ref_tokens)} compared, "
          f"max|dlp|={case_diff:.3e}")
    if problems:
        print(f"       preft  {toks}\n       ref    {list(ref_tokens)}")
        for p in problems[:8]:
            print(f"       - {p}")
        v.failures.append(f"{label}: {problems[0]}")


# --------------------------------------------------------------------------------------------

def prompt_lengths(cfg, max_tokens):
    """Prompt lengths: short, crossing 16-token KV blocks, and past the llama3
    original_max_position_embeddings / a small Mistral sliding window when those are short."""
    cap = int(cfg.get("max_position_embeddings", 1 << 30)) - max_tokens
    lengths = [3, 11, 17, 40, 70]
    rs = cfg.get("rope_scaling") or {}
    om = rs.get("original_max_position_embeddings")
    if om and int(om) <= 256:
        lengths.append(int(om) + 6)
    sw = cfg.get("sliding_window")
    if sw and cfg.get("model_type") == "mistral" and int(sw) <= 256:
        lengths.append(int(sw) + 5)
    return sorted(set(min(L, cap) for L in lengths if L >= 1))


def oracle_kv_dtype(args):
    """What preft's cache holds (--kv-dtype, or auto: the checkpoint's dtype), for the oracle to
    round K and V to: torch.bfloat16, "fp8_e4m3", or None (kept exact)."""
    import torch
    if KV_DTYPE == "fp8_e4m3":
        return KV_DTYPE
    bf16 = KV_DTYPE == "bf16" or (KV_DTYPE == "auto" and args.model_dtype == "bf16")
    return torch.bfloat16 if bf16 else None


def run_preset(args):
    try:
        import numpy as np
        import torch
    except ImportError:
        print("SKIP: torch not available (run with /usr/bin/python3)")
        return SKIP
    sys.dont_write_bytecode = True
    sys.path.insert(0, HERE)
    import reference
    torch.set_num_threads(2)
    v = Verdict()
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        mdir = os.path.join(args.workdir, f"{args.preset}-seed{seed}")
        os.makedirs(args.workdir, exist_ok=True)
        run([args.preft, "make-model", "--preset", args.preset, "--dtype", args.model_dtype,
             "--seed", str(seed), "--out", mdir] + (["--kv-scales"] if args.kv_scales else []))
        model = reference.Model(mdir, torch.float64, oracle_kv_dtype(args))
        cfg = model.config
        if model.unused_weights:
            v.notes.append(f"seed {seed}: checkpoint tensors HF would ignore (oracle ignores "
                           f"them too): {model.unused_weights[:6]}")
        vocab = int(cfg["vocab_size"])
        rng = np.random.RandomState(1000 + seed)
        print(f"model {args.preset} seed {seed}: {model.arch}, hidden {model.hidden}, layers "
              f"{model.n_layers}, heads {model.n_heads}/{model.n_kv}, head_dim {model.head_dim}, "
              f"vocab {vocab}, rope_scaling {cfg.get('rope_scaling')}")
        for L in prompt_lengths(cfg, args.max_tokens):
            prompt = [int(t) for t in rng.randint(0, vocab, size=L)]
            got = preft_generate(args.preft, mdir, prompt, args.max_tokens, args.logprobs)
            if [int(t) for t in got.get("prompt_ids", prompt)] != prompt:
                v.failures.append(f"seed {seed} len {L}: prompt_ids not echoed")
            ref, full = reference.generate(model, prompt, args.max_tokens, args.logprobs,
                                           ignore_eos=True, return_full=True)
            rtoks = ref["token_ids"]
            compare_case(
                f"{args.preset} seed={seed} prompt_len={L}", got, rtoks,
                lambda i, t: float(full[i][t]),
                lambda i: [(t, float(full[i][t])) for t in
                           np.argsort(-full[i], kind="stable")[:args.logprobs]],
                lambda i, t: float(full[i].max() - full[i][t]),
                args.logprobs, args.tol, args.strict, v, expect_len=args.max_tokens)
        if args.adapter_modes:
            compare_adapters(args, mdir, seed, rng, v)
    return finish(v, f"preft vs oracle ({args.preset}, seeds {args.seeds})", args.tol)


# mode -> (adapter kind, positions)
ADAPTER_MODES = {"lora": ("lora", "all"), "lorap": ("lora", "prompt"),
                 "direft": ("direft", "all"), "direftp": ("direft", "prompt")}


def train_data(path):
    """A small SFT set for `preft train sft` (--train-adapters)."""
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"Question {i}: what is {i} plus {i}?",
                                "completion": f"It is {2 * i}, I think."}) + "\n")
    return path


def compare_adapters(args, mdir, seed, rng, v):
    """Adapters run by preft and the oracle: random ones made by `preft make-adapter` (LoRA
    rank 8 on all projections; DiReFT rank 4 intervening on the first 2 and last 3 prompt
    tokens), or with --train-adapters the same shapes trained by `preft train sft` (the files
    the trainer writes, read by the oracle as PEFT / pyreft-converted folders)."""
    import numpy as np
    import reference
    adirs = {}
    for kind, extra in (("lora", ["--rank", "8", "--alpha", "16"]),
                        ("direft", ["--rank", "4", "--prompt-positions", "f2+l3"])):
        adirs[kind] = os.path.join(args.workdir, f"{args.preset}-seed{seed}-{kind}")
        if args.train_adapters:
            data = train_data(os.path.join(args.workdir, "train.jsonl"))
            run([args.preft, "train", "sft", "--model", mdir, "--data", data, "--kind", kind,
                 "--seed", str(seed), "--steps", "30", "--lr", "2e-2", "--schedule", "constant",
                 "--threads", "2"] + extra + ["--out", adirs[kind]])
        else:
            run([args.preft, "make-adapter", "--model", mdir, "--kind", kind, "--seed",
                 str(seed)] + extra + ["--out", adirs[kind]])
    oracles = {}
    vocab = None
    for mode in args.adapter_modes.split(","):
        kind, positions = ADAPTER_MODES[mode]
        if kind not in oracles:
            oracles[kind] = reference.Model(mdir, reference.torch.float64, oracle_kv_dtype(args))
            oracles[kind].load_adapter(adirs[kind])
        model = oracles[kind]
        vocab = int(model.config["vocab_size"])
        for L in (3, 17, 40):
            prompt = [int(t) for t in rng.randint(0, vocab, size=L)]
            got = preft_generate(args.preft, mdir, prompt, args.max_tokens, args.logprobs,
                                 adapter=adirs[kind], positions=positions)
            ref, full = reference.generate(model, prompt, args.max_tokens, args.logprobs,
                                           ignore_eos=True, adapter_positions=positions,
                                           return_full=True)
            compare_case(
                f"{args.preset} seed={seed} {mode} prompt_len={L}", got, ref["token_ids"],
                lambda i, t: float(full[i][t]),
                lambda i: [(t, float(full[i][t])) for t in
                           np.argsort(-full[i], kind="stable")[:args.logprobs]],
                lambda i, t: float(full[i].max() - full[i][t]),
                args.logprobs, args.tol, args.strict, v, expect_len=args.max_tokens)


def run_fixture(args):
    path = os.path.join(args.fixture, "reference.json")
    if not os.path.exists(path):
        print(f"SKIP: fixture not found: {path}")
        return SKIP
    with open(path) as f:
        ref = json.load(f)
    modes = args.modes.split(",")
    v = Verdict()
    for c in ref["cases"]:
        if c["mode"] not in modes:
            continue
        adapter = os.path.join(args.fixture, c["adapter"]) if c.get("adapter") else None
        got = preft_generate(args.preft, args.fixture, c["prompt_ids"], len(c["token_ids"]),
                             args.logprobs, ignore_eos=True, adapter=adapter,
                             positions=c.get("adapter_positions"))
        steps = c["logprobs"]

        def lp_of(i, t, steps=steps):
            st = steps[i]
            if t == st["token_id"]:
                return st["logprob"]
            return next((lp for tid, lp in st["top"] if tid == t), None)

        def margin(i, t, steps=steps):
            st = steps[i]
            r = lp_of(i, t)
            return None if r is None else st["top"][0][1] - r

        compare_case(f"fixture mode={c['mode']} prompt_len={len(c['prompt_ids'])}", got,
                     c["token_ids"], lp_of, lambda i, steps=steps: [tuple(e) for e in steps[i]["top"]],
                     margin, min(args.logprobs, len(steps[0]["top"])), args.tol, args.strict, v,
                     expect_len=len(c["token_ids"]))
    if v.cases == 0:
        print(f"FAIL: no fixture cases for modes {modes}")
        return 1
    return finish(v, f"preft vs fixture {args.fixture} (modes {args.modes})", args.tol)


def finish(v, what, tol):
    for n in v.notes:
        print(f"NOTE: {n}")
    if v.failures:
        print(f"FAIL: {what}: {len(v.failures)}/{v.cases} cases failed; max |logprob diff| = "
              f"{v.max_diff:.3e} (tol {tol:g}); first: {v.failures[0]}")
        return 1
    print(f"PASS: {what}: {v.cases} cases, tokens identical, max |logprob diff| = "
          f"{v.max_diff:.3e} (tol {tol:g})")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preft", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--preset")
    g.add_argument("--fixture")
    ap.add_argument("--modes", default="base")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--adapter-modes", default="",
                    help="with --preset: also compare these of lora,lorap,direft,direftp")
    ap.add_argument("--train-adapters", action="store_true",
                    help="adapters trained by `preft train sft` instead of random ones")
    ap.add_argument("--workdir", default="compare-work")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--model-dtype", default="f32", choices=["f32", "bf16"],
                    help="with --preset: the made checkpoint's dtype")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "f32", "bf16", "fp8_e4m3"],
                    help="preft's --kv-dtype; the oracle rounds K and V as preft's cache "
                         "stores them (bf16, or fp8 e4m3 with the checkpoint's scales)")
    ap.add_argument("--kv-scales", action="store_true",
                    help="with --preset: make-model --kv-scales (fp8 KV scales in the checkpoint)")
    ap.add_argument("--strict", action="store_true", help="no near-tie tolerance")
    args = ap.parse_args(argv)
    global KV_DTYPE
    KV_DTYPE = args.kv_dtype
    if not os.path.exists(args.preft):
        print(f"FAIL: preft binary not found: {args.preft}")
        return 1
    os.makedirs(args.workdir, exist_ok=True)
    try:
        return run_preset(args) if args.preset else run_fixture(args)
    except (RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        print(f"FAIL: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
