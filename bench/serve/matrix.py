#!/usr/bin/python3
"""The headline benchmark: PreFT vs multi-LoRA serving throughput, every mode in one run.

For each deployment (disaggregated: router + prefill + decode processes with UCX between the
tiers; colocated: router + workers that run prompt and decode in one engine), each number of
distinct adapters N and each load, this starts a fresh cluster of the real binaries, registers
N adapters made on the fly (LoRA rank 16 on every projection, DiReFT rank 4 on every layer by
default), drives it with `preft bench` through the public gRPC API, samples the workers'
Prometheus endpoints while it runs, and stops it. Modes, on the same workload and model:

  base     no adapter
  lorap    LoRA on prompt tokens only (PreFT); decode workers hold no adapter
  direftp  DiReFT on prompt tokens only (PreFT); decode workers hold no adapter
  lora     LoRA on every token: decode workers run it too (the multi-LoRA baseline)
  direft   DiReFT on every token (the all-position ReFT baseline)

Writes OUT/results.json (every cell, the ratios), OUT/results.csv, OUT/ratios.csv and, with
gnuplot, OUT/throughput_vs_adapters.svg and OUT/latency_vs_load.svg (OUT/plots.gp redraws
them); prints the ratio table. Progress and each process's log go to OUT/logs/; each cell's
result is kept in OUT/cells/, and a rerun into the same OUT measures only the missing cells.
On a shared host, --repeat K runs every cell K times (rounds after the first in a shuffled
order) and reports each cell's median round, with every round's throughput beside it, and
each ratio also round by round (round r over round r) with the median of those.

  bench/serve/matrix.py --build build --model models/qwen2.5-0.5b --preset qwen2.5-0.5b \\
      --adapters 64,512 --concurrency 64 --requests 128 --out bench/results/qwen
"""
import argparse
import csv
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

MODES = {  # name -> (adapter kind, positions, decode workers hold adapters)
    "base": (None, None, False),
    "lorap": ("lora", "prompt", False),
    "direftp": ("direft", "prompt", False),
    "lora": ("lora", "all", True),
    "direft": ("direft", "all", True),
}
BASELINE = {"lorap": "lora", "direftp": "lora"}  # PreFT mode -> the multi-LoRA baseline
ACQUIRE_RESULTS = ("compute_hit", "joined", "host_hit", "disk_load", "load_failure")
# The router's split of the time to first token (preft:router_ttft_stage_seconds), in order.
TTFT_STAGES = ("admit", "reserve", "prefill_queue", "prefill_compute", "kv_transfer",
               "prefill_rpc", "decode_start")


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def ints(text):
    return [int(x) for x in text.split(",") if x]


class Metrics:
    """Scrapes Prometheus text endpoints: sums of samples by name and label filter."""

    LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')

    @staticmethod
    def scrape(address):
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = []
        for line in text.splitlines():
            m = Metrics.LINE.match(line)
            if m:
                out.append((m.group(1), m.group(2) or "", float(m.group(3))))
        return out

    @staticmethod
    def total(samples, name, label=""):
        return sum(v for n, l, v in samples if n == name and label in l)


def cpu_count(spec):
    """CPUs in a taskset list such as "0-3,6"."""
    n = 0
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def pinned(argv, cpus):
    """`argv` confined to `cpus` (taskset), its engine with one thread per CPU."""
    argv = list(argv)
    argv[argv.index("--threads") + 1] = str(cpu_count(cpus))
    return ["taskset", "-c", cpus, *argv]


class Cluster:
    """The real binaries on 127.0.0.1; each process logs to LOGS/<name>.log."""

    def __init__(self, args, logs, deployment, decode_adapters, adapter_root, store_mib):
        self.procs = []
        self.logs = logs
        os.makedirs(logs, exist_ok=True)
        b = args.build
        worker = ["--model", args.model, "--metrics-listen", "127.0.0.1:0",
                  "--threads", str(args.threads), "--max-batch-tokens", str(args.max_batch_tokens),
                  "--device", args.device, "--kv-dtype", args.kv_dtype]
        if args.prefix_caching == "off":
            worker += ["--no-prefix-caching"]
        if args.tensor_parallel > 1:
            worker += ["--tensor-parallel", str(args.tensor_parallel)]
        store = ["--adapter-root", adapter_root,
                 "--adapter-host-bytes", str(store_mib[0] << 20),
                 "--adapter-compute-bytes", str(store_mib[1] << 20),
                 "--adapter-loader-threads", str(args.adapter_loader_threads),
                 "--adapter-loader-nice", str(args.adapter_loader_nice)]
        kv = ["--kv-bytes", str(args.kv_mib << 20)]
        # A colocated worker moves no KV: its transport stays in process.
        transport = args.transport if deployment == "disaggregated" else "inproc"
        decode = [f"{b}/services/decode/preft-decode", *worker, *kv, "--transport", transport]
        if transport in ("ucx", "cuda_ipc"):  # cuda_ipc's notices go over UCX
            decode += ["--ucx-tls", args.ucx_tls, "--ucx-spin-us", str(args.ucx_spin_us)]
        router = [f"{b}/services/router/preft-router", "--model", args.model,
                  "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                  "--adapter-root", adapter_root, "--admission-timeout-s", "600"]
        if deployment == "colocated":
            decode += ["--colocated", *store]
            router += ["--colocated"]
        elif decode_adapters:
            decode += ["--adapters", "all-positions", *store]
        pin = {}
        if deployment == "disaggregated" and args.tier_cpus:
            pin = dict(zip(("prefill", "decode"), args.tier_cpus.split(":")))
            decode = pinned(decode, pin["decode"])
        decodes = [self.start(f"decode-{i}", decode) for i in range(args.decode_workers)]
        self.decode_metrics = [self.address(n, metrics=True) for n in decodes]
        router += ["--decode", ",".join(self.address(n) for n in decodes)]
        self.prefill_metrics = []
        if deployment == "disaggregated":
            prefill = [f"{b}/services/prefill/preft-prefill", *worker, *store,
                       "--kv-bytes", str(args.prefill_kv_mib << 20),
                       "--transport", args.transport]
            if args.transport in ("ucx", "cuda_ipc"):
                prefill += ["--ucx-tls", args.ucx_tls, "--ucx-spin-us", str(args.ucx_spin_us)]
            if pin:
                prefill = pinned(prefill, pin["prefill"])
            prefills = [self.start(f"prefill-{i}", prefill) for i in range(args.prefill_workers)]
            self.prefill_metrics = [self.address(n, metrics=True) for n in prefills]
            router += ["--prefill", ",".join(self.address(n) for n in prefills)]
        self.start("router", router)
        self.router = self.address("router")
        self.router_metrics = self.address("router", metrics=True)

    def start(self, name, argv):
        f = open(os.path.join(self.logs, f"{name}.log"), "w")
        self.procs.append((name, subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)))
        return name

    def address(self, name, metrics=False):
        pattern = (r"metrics on http://([^/\s]+)/metrics" if metrics else r"listening on (\S+)")
        path = os.path.join(self.logs, f"{name}.log")
        proc = dict(self.procs)[name]
        for _ in range(3000):
            m = re.search(pattern, open(path).read())
            if m:
                return m.group(1)
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{open(path).read()}")
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not start:\n{open(path).read()}")

    def stop(self):
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log(f"{name} did not drain in 60 s: killed")
                p.kill()
                p.wait()


class Sampler(threading.Thread):
    """KV usage of the decode tier, sampled every `period` while the load runs."""

    def __init__(self, decode_metrics, period=0.5):
        super().__init__(daemon=True)
        self.addresses, self.period = decode_metrics, period
        self.usage = []
        self.stopping = threading.Event()

    def run(self):
        while not self.stopping.wait(self.period):
            try:
                values = [Metrics.total(Metrics.scrape(a), "preft:kv_cache_usage_perc")
                          for a in self.addresses]
                self.usage.append(sum(values) / len(values))
            except OSError:
                pass


STEP_SERIES = ("preft:forward_seconds_sum", "preft:forward_seconds_count",
               "preft:iteration_tokens_total_sum")


def counters(cluster):
    """One scrape of every worker: adapter store acquires by result (all workers), and each
    tier's engine-step counters (where a step's time goes, the forward against the whole
    inter-token gap, without a profiler), summed; and the router's TTFT stage sums and counts."""
    out = {"acquires": dict.fromkeys(ACQUIRE_RESULTS, 0.0), "disk_load_s": 0.0}
    r = Metrics.scrape(cluster.router_metrics)
    out["stages"] = {st: (Metrics.total(r, "preft:router_ttft_stage_seconds_sum", f'stage="{st}"'),
                          Metrics.total(r, "preft:router_ttft_stage_seconds_count",
                                        f'stage="{st}"'))
                     for st in TTFT_STAGES}
    for tier, workers in (("decode", cluster.decode_metrics), ("prefill", cluster.prefill_metrics)):
        steps = out[tier] = dict.fromkeys(STEP_SERIES, 0.0)
        for a in workers:
            s = Metrics.scrape(a)
            for r in ACQUIRE_RESULTS:
                out["acquires"][r] += Metrics.total(s, "preft:adapter_acquires_total",
                                                    f'result="{r}"')
            out["disk_load_s"] += Metrics.total(s, "preft:adapter_disk_load_seconds_total")
            for name in STEP_SERIES:
                steps[name] += Metrics.total(s, name)
    return out


def stage_means(before, after):
    """Mean milliseconds of each TTFT stage over the cell's requests (stages a deployment
    never enters, such as reserve when colocated, are left out)."""
    out = {}
    for st in TTFT_STAGES:
        total = after[st][0] - before[st][0]
        count = after[st][1] - before[st][1]
        if count:
            out[st] = 1e3 * total / count
    return out


def step_summary(before, after, seconds, workers):
    steps = after["preft:forward_seconds_count"] - before["preft:forward_seconds_count"]
    busy = after["preft:forward_seconds_sum"] - before["preft:forward_seconds_sum"]
    tokens = after["preft:iteration_tokens_total_sum"] - before["preft:iteration_tokens_total_sum"]
    return {
        "steps": steps,
        # schedule + forward + sample, per step (preft:forward_seconds)
        "step_ms_mean": 1e3 * busy / steps if steps else None,
        "tokens_per_step": tokens / steps if steps else None,
        # share of the cell each of the tier's engines spent in steps; the rest is token
        # delivery, waiting for work and the loop itself
        "step_busy": busy / (seconds * max(1, len(workers))) if seconds else None,
    }


def make_model(args):
    if os.path.exists(os.path.join(args.model, "config.json")):
        return
    if not args.preset:
        sys.exit(f"matrix: no model in {args.model} (pass --preset to make one)")
    log(f"making the {args.preset} model in {args.model}")
    subprocess.run([f"{args.build}/tools/preft", "make-model", "--preset", args.preset,
                    "--dtype", args.dtype, "--seed", "1", "--out", args.model], check=True)


def make_adapters(args, kind, n):
    """N adapters of `kind` under args.adapter_dir, kept between runs (same seeds, same files)."""
    rank = args.lora_rank if kind == "lora" else args.direft_rank
    names = []
    for i in range(n):
        name = f"{kind}-r{rank}-{i:03d}"
        path = os.path.join(args.adapter_dir, name)
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            if i % 32 == 0:
                log(f"making {kind} adapters {i}..{min(n, i + 32) - 1} in {args.adapter_dir}")
            cmd = [f"{args.build}/tools/preft", "make-adapter", "--model", args.model,
                   "--kind", kind, "--rank", str(rank), "--layers", "all",
                   "--dtype", args.dtype, "--seed", str(1000 + i), "--out", path]
            if kind == "lora":
                cmd += ["--targets", "all"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        names.append(name)
    return names


def register(args, router, names, adapter_dir):
    """Registers the cell's adapters; with --preload each is also loaded, before the clock
    starts, on every worker that runs adapters."""
    try:
        from preft_client import Client
    except ImportError:  # no Python gRPC here (a bare GPU image): the C++ client, one call each
        for name in names:
            subprocess.run([f"{args.build}/tools/preft", "client", "--server", router,
                            "register", "--name", name,
                            "--path", os.path.abspath(os.path.join(adapter_dir, name)),
                            *(["--load"] if args.preload else [])],
                           check=True, stdout=subprocess.DEVNULL)
        return
    with Client(router) as c:
        for name in names:
            c.register_adapter(name, os.path.abspath(os.path.join(adapter_dir, name)),
                               load=args.preload)


def adapter_mib(args, names):
    """The store budgets (host, compute) for a cell: as given, or with --preload at least
    what the cell's adapters take (their files' bytes, plus 10%), so none is evicted."""
    host, compute = args.adapter_host_mib, args.adapter_compute_mib
    if args.preload and names:
        files = sum(os.path.getsize(os.path.join(args.adapter_dir, n, "adapter_model.safetensors"))
                    for n in names)
        need = int(files * 1.1) >> 20
        host, compute = max(host, need), max(compute, need)
    return host, compute


def run_cell(args, deployment, mode, n, concurrency, requests, round_index=0):
    """One cell's result, kept in OUT/cells/CELL.json (CELL-rK.json for round K > 0): a rerun
    with the same OUT measures only the cells it lacks (a failed or interrupted run loses
    nothing already measured)."""
    cell = f"{deployment}-{mode}-n{n}-c{concurrency}" + (f"-r{round_index}" if round_index else "")
    path = os.path.join(args.out, "cells", f"{cell}.json")
    if os.path.exists(path):
        log(f"cell {cell}: kept from an earlier run ({path})")
        return json.load(open(path))
    result = measure_cell(args, cell, deployment, mode, n, concurrency, requests)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f)
    return result


def measure_cell(args, cell, deployment, mode, n, concurrency, requests):
    kind, positions, decode_adapters = MODES[mode]
    names = make_adapters(args, kind, n) if kind else []
    # Each cell registers its adapters afresh: the router keeps its registry in the adapter
    # root (durable across restarts), so the previous cell's records are cleared first.
    shutil.rmtree(os.path.join(args.adapter_dir, ".preft-registry"), ignore_errors=True)
    log(f"cell {cell}: starting the cluster")
    cluster = Cluster(args, os.path.join(args.out, "logs", cell), deployment, decode_adapters,
                      os.path.abspath(args.adapter_dir), adapter_mib(args, names))
    try:
        if args.preload and names:
            log(f"cell {cell}: loading {len(names)} adapters on the workers before the clock")
        register(args, cluster.router, names, args.adapter_dir)
        if args.preload and names:
            time.sleep(1.2)  # the preloads reach the workers' counters (refreshed every 0.5 s)
        before = counters(cluster)
        sampler = Sampler(cluster.decode_metrics)
        sampler.start()
        cmd = [f"{args.build}/tools/preft", "bench", "--server", cluster.router, "--json",
               "--requests", str(requests), "--concurrency", str(concurrency),
               "--seed", str(args.seed), "--timeout-s", "3600"]
        cmd += (["--lengths", args.lengths] if args.lengths else
                ["--prompt-tokens", args.prompt_tokens, "--max-tokens", args.max_tokens])
        if args.rate:
            cmd += ["--rate", str(args.rate)]
        cmd += ["--shared-prefix-tokens", str(args.shared_prefix_tokens), "--turns", str(args.turns)]
        if names:
            cmd += ["--adapters", ",".join(names), "--adapter-positions", positions]
        log(f"cell {cell}: {requests} requests, {concurrency} concurrent")
        bench = subprocess.run(cmd, capture_output=True, text=True)
        sampler.stopping.set()
        sampler.join()
        if bench.returncode != 0:
            raise RuntimeError(f"preft bench failed in {cell}: {bench.stderr.strip()}")
        result = json.loads(bench.stdout)
        time.sleep(1.2)  # the workers refresh their gauges and store counters every 0.5 s
        after = counters(cluster)
    finally:
        cluster.stop()
    got = {r: after["acquires"][r] - before["acquires"][r] for r in ACQUIRE_RESULTS}
    total = sum(got.values())
    # One disk load's own cost on the loader thread (what waits add beyond it is queueing).
    disk_s = after["disk_load_s"] - before["disk_load_s"]
    result.update({
        "deployment": deployment, "mode": mode, "num_adapters": n, "concurrency": concurrency,
        "kv_usage_mean": sum(sampler.usage) / len(sampler.usage) if sampler.usage else 0,
        "kv_usage_max": max(sampler.usage, default=0),
        "adapter_acquires": got,
        "adapter_hit_rate": got["compute_hit"] / total if total else None,
        "adapter_disk_load_ms_mean": 1e3 * disk_s / got["disk_load"] if got["disk_load"] else None,
        "decode_steps": step_summary(before["decode"], after["decode"], result.get("seconds"),
                                     cluster.decode_metrics),
        "ttft_stage_ms_mean": stage_means(before["stages"], after["stages"]),
    })
    if cluster.prefill_metrics:
        result["prefill_steps"] = step_summary(before["prefill"], after["prefill"],
                                               result.get("seconds"), cluster.prefill_metrics)
    step = "".join(
        f", {tier} step {st['step_ms_mean']:.1f} ms x {st['steps']:.0f} "
        f"({st['tokens_per_step']:.1f} tokens, busy {100 * st['step_busy']:.0f}%)"
        for tier in ("decode", "prefill")
        for st in [result.get(f"{tier}_steps")] if st and st["steps"])
    stages = ", ".join(f"{st} {ms:.0f}" for st, ms in result["ttft_stage_ms_mean"].items())
    if result["adapter_disk_load_ms_mean"] is not None:
        step += f", adapter disk load {result['adapter_disk_load_ms_mean']:.1f} ms each"
    log(f"cell {cell}: {result['output_tokens_per_s']:.1f} tok/s, "
        f"TTFT p50 {result['ttft_ms']['p50']:.0f} ms, ITL p50 {result['itl_ms']['p50']:.1f} ms{step}"
        f"; TTFT by stage, mean ms: {stages}")
    return result


def ratios(cells):
    """PreFT / multi-LoRA and PreFT / base, per deployment, N and load, from the cells' reported
    (median) rounds; with --repeat, also round by round (round r of one cell over round r of
    the other: measured minutes apart, so a slow spell of the host hits both) and the median
    of those paired ratios (a statistic, so an even count takes the middle two's mean)."""
    by = {(c["deployment"], c["mode"], c["num_adapters"], c["concurrency"]): c for c in cells}
    base = {(c["deployment"], c["concurrency"]): c for c in cells if c["mode"] == "base"}
    out = []
    for (dep, mode, n, conc), c in sorted(by.items()):
        if mode not in BASELINE:
            continue
        row = {"deployment": dep, "mode": mode, "num_adapters": n, "concurrency": conc}
        for name, ref in (("vs_multi_lora", by.get((dep, BASELINE[mode], n, conc))),
                          ("vs_base", base.get((dep, conc)))):
            if not ref:
                continue
            row[name] = c["output_tokens_per_s"] / ref["output_tokens_per_s"]
            mine, theirs = (x.get("output_tokens_per_s_rounds", []) for x in (c, ref))
            if len(mine) > 1 and len(mine) == len(theirs):
                paired = [a / b for a, b in zip(mine, theirs)]
                row[f"{name}_rounds"] = paired
                row[f"{name}_paired"] = statistics.median(paired)
        out.append(row)
    return out


def median_round(results):
    """The round with the median throughput (the lower middle of an even count), whole, so its
    latencies belong to the same run; every round's throughput rides along."""
    chosen = dict(sorted(results, key=lambda c: c["output_tokens_per_s"])[(len(results) - 1) // 2])
    chosen["rounds"] = len(results)
    chosen["output_tokens_per_s_rounds"] = [c["output_tokens_per_s"] for c in results]
    return chosen


def write_csv(path, rows, fields):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def flatten(c):
    row = dict(c)
    for k in ("ttft_ms", "itl_ms", "e2e_ms"):
        for q, v in c[k].items():
            row[f"{k[:-3]}_{q}_ms"] = v
    for tier in ("decode", "prefill"):
        for k, v in (c.get(f"{tier}_steps") or {}).items():
            row[f"{tier}_{k}"] = v
    for st, ms in (c.get("ttft_stage_ms_mean") or {}).items():
        row[f"ttft_{st}_ms_mean"] = ms
    return row


CSV_FIELDS = ["deployment", "mode", "num_adapters", "concurrency", "requests", "failed",
              "generated_tokens", "seconds", "output_tokens_per_s", "requests_per_s",
              "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
              "itl_p99_ms", "e2e_p50_ms", "kv_usage_mean", "kv_usage_max", "adapter_hit_rate",
              "decode_step_ms_mean", "decode_tokens_per_step", "decode_step_busy",
              "prefill_step_ms_mean", "prefill_tokens_per_step", "prefill_step_busy", "rounds",
              "adapter_disk_load_ms_mean",
              *(f"ttft_{st}_ms_mean" for st in TTFT_STAGES)]


def plot(out, cells, top_c, load_n):
    """Writes the plots' data and gnuplot script; draws SVGs when gnuplot is installed.
    Throughput vs N at concurrency `top_c`; latency vs load at N = `load_n`."""
    series = sorted({(c["deployment"], c["mode"]) for c in cells})
    thr, lat = [], []
    for dep, mode in series:
        name = f"{dep}-{mode}"
        pts = sorted((c["num_adapters"], c["output_tokens_per_s"]) for c in cells
                     if (c["deployment"], c["mode"], c["concurrency"]) == (dep, mode, top_c))
        if mode == "base" and pts:  # one run stands for every N
            pts = [(n, pts[0][1]) for n in sorted({c["num_adapters"] for c in cells} - {0})]
        data = os.path.join(out, f"plot-{name}-throughput.dat")
        with open(data, "w") as f:
            f.writelines(f"{n} {v}\n" for n, v in pts)
        thr.append(f"'{os.path.basename(data)}' using 1:2 with linespoints title '{name}'")
        pts = sorted((c["output_tokens_per_s"], c["ttft_ms"]["p50"], c["itl_ms"]["p50"])
                     for c in cells if (c["deployment"], c["mode"]) == (dep, mode)
                     and c["num_adapters"] in (load_n, 0))  # base runs once, as N = 0
        data = os.path.join(out, f"plot-{name}-latency.dat")
        with open(data, "w") as f:
            f.writelines(f"{x} {t} {i}\n" for x, t, i in pts)
        lat.append(f"'{os.path.basename(data)}' using 1:2 with linespoints title '{name}'")
    script = f"""set terminal svg size 900,560 dynamic background rgb 'white'
set key outside right
set grid
set output 'throughput_vs_adapters.svg'
set title 'Output throughput vs distinct adapters ({top_c} concurrent requests)'
set xlabel 'distinct adapters'
set ylabel 'output tokens/s'
set logscale x 2
plot {', '.join(thr)}
unset logscale x
set output 'latency_vs_load.svg'
set title 'Time to first token vs throughput ({load_n} adapters; one point per load)'
set xlabel 'output tokens/s'
set ylabel 'TTFT p50 (ms)'
plot {', '.join(lat)}
"""
    with open(os.path.join(out, "plots.gp"), "w") as f:
        f.write(script)
    if shutil.which("gnuplot"):
        drawn = subprocess.run(["gnuplot", "plots.gp"], cwd=out, capture_output=True, text=True)
        if drawn.returncode != 0:  # e.g. nothing to draw against N: the tables still stand
            log(f"gnuplot failed: {drawn.stderr.strip()[-300:]}")
    else:
        log("gnuplot is not installed: plots.gp and its data written, no SVG drawn")


def table(cells, rows):
    lines = ["| deployment | N | conc | mode | tok/s | TTFT p50 ms | ITL p50 ms | KV use | hit rate |"
             " / multi-LoRA | / base |", "|" + "---|" * 11]
    ratio = {(r["deployment"], r["mode"], r["num_adapters"], r["concurrency"]): r for r in rows}
    for c in sorted(cells, key=lambda c: (c["deployment"], c["num_adapters"], c["concurrency"],
                                          list(MODES).index(c["mode"]))):
        r = ratio.get((c["deployment"], c["mode"], c["num_adapters"], c["concurrency"]), {})
        opt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731  (absent: no adapter/ratio)

        def ratio_text(name):  # "0.95 (0.99/0.90/0.97)": the rounds' paired ratios beside it
            rounds = r.get(f"{name}_rounds")
            text = opt(r.get(name))
            return text if not rounds else f"{text} ({'/'.join(f'{x:.2f}' for x in rounds)})"
        lines.append(
            f"| {c['deployment']} | {c['num_adapters']} | {c['concurrency']} | {c['mode']} | "
            f"{c['output_tokens_per_s']:.1f} | {c['ttft_ms']['p50']:.0f} | "
            f"{c['itl_ms']['p50']:.1f} | {c['kv_usage_mean']:.2f} | "
            f"{opt(c['adapter_hit_rate'])} | {ratio_text('vs_multi_lora')} | {ratio_text('vs_base')} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--model", required=True, help="base model folder")
    p.add_argument("--preset", help="make a random model of this preset if --model has none")
    p.add_argument("--dtype", default="bf16", help="of the model and adapters made here")
    p.add_argument("--adapter-dir", help="where adapters are made (default: MODEL-adapters)")
    p.add_argument("--out", required=True)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--deployments", default="disaggregated,colocated")
    p.add_argument("--adapters", default="64,512", help="distinct adapters N (list)")
    p.add_argument("--concurrency", default="64", help="closed-loop concurrency (list)")
    p.add_argument("--latency-loads", default="",
                   help="more concurrency levels, run at the first N only (latency vs load)")
    p.add_argument("--latency-requests", type=int, help="requests per --latency-loads cell "
                   "(default: --requests)")
    p.add_argument("--rate", type=float, default=0, help="Poisson arrivals/s (0: closed loop)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every cell, each after the first in a new order; a cell "
                        "reports its median round (shared hosts drift +-15%% over minutes)")
    p.add_argument("--prompt-tokens", default="128")
    p.add_argument("--max-tokens", default="128")
    p.add_argument("--lengths", help="JSONL of prompt_tokens/max_tokens (see preft bench)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--direft-rank", type=int, default=4)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="per engine (0: all cores)")
    p.add_argument("--tier-cpus", metavar="PREFILL:DECODE", default="",
                   help="disaggregated cells: the prefill and decode workers on these CPUs "
                        "(taskset lists, e.g. 0:1), as on machines of their own; by default "
                        "every process shares every core")
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--kv-mib", type=int, default=1024, help="decode (or colocated) KV pool")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "f32", "bf16", "fp8_e4m3"],
                   help="both tiers' --kv-dtype (auto: the model's dtype, bf16 for --dtype bf16)")
    p.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                   help="every worker's prefix cache (off: --no-prefix-caching)")
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="a system prompt of N tokens before every request's own (preft bench)")
    p.add_argument("--turns", type=int, default=1, help="turns per conversation (preft bench)")
    p.add_argument("--prefill-kv-mib", type=int, default=512)
    p.add_argument("--adapter-host-mib", type=int, default=2048)
    p.add_argument("--adapter-compute-mib", type=int, default=2048)
    p.add_argument("--preload", action="store_true",
                   help="load each cell's adapters on its workers before the clock starts (the "
                        "adapters resident in memory, as S-LoRA serves them; budgets grown to "
                        "hold them) instead of on first use from disk")
    p.add_argument("--adapter-loader-threads", type=int, default=1,
                   help="per worker: adapters loaded from disk at once")
    p.add_argument("--adapter-loader-nice", type=int, default=10,
                   help="how much nicer than the engine the workers' adapter loaders run")
    p.add_argument("--transport", default="ucx", choices=["ucx", "cuda_ipc", "grpc"],
                   help="disaggregated cells' KV transport (cuda_ipc: GPU to GPU, --device cuda)")
    p.add_argument("--ucx-tls", default="posix,self")
    p.add_argument("--ucx-spin-us", type=float, default=0,
                   help="the workers' --ucx-spin-us (UCX progress thread busy-poll)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where every worker runs its forward (cuda: the first GPU; prefill "
                        "and disaggregated decode workers stage KV through host memory)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="with --device cuda: every worker splits the model over GPUs 0..N-1 "
                        "(workers of both tiers share them)")
    args = p.parse_args()
    if args.tensor_parallel > 1 and (args.device != "cuda" or args.transport == "cuda_ipc"):
        sys.exit("matrix: --tensor-parallel needs --device cuda and a host-memory transport")
    args.adapter_dir = args.adapter_dir or args.model.rstrip("/") + "-adapters"
    sys.path.insert(0, os.path.join(args.build, "clients", "python"))
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            sys.exit(f"matrix: unknown mode '{m}' (use {', '.join(MODES)})")
    deployments = args.deployments.split(",")
    for d in deployments:
        if d not in ("disaggregated", "colocated"):
            sys.exit(f"matrix: unknown deployment '{d}' (use disaggregated, colocated)")
    if args.repeat < 1:
        sys.exit(f"matrix: --repeat must be at least 1, not {args.repeat}")
    if args.tier_cpus:
        lists = args.tier_cpus.split(":")
        try:
            if len(lists) != 2 or min(cpu_count(c) for c in lists) < 1:
                raise ValueError
        except ValueError:
            sys.exit(f"matrix: --tier-cpus wants PREFILL:DECODE CPU lists (e.g. 0:1 or 0-7:8-15), "
                     f"not '{args.tier_cpus}'")
    os.makedirs(args.out, exist_ok=True)
    make_model(args)
    plan = [(conc, ints(args.adapters), args.requests) for conc in ints(args.concurrency)]
    plan += [(conc, ints(args.adapters)[:1], args.latency_requests or args.requests)
             for conc in ints(args.latency_loads)]
    specs = []  # (deployment, mode, N, concurrency, requests)
    for dep in deployments:
        for conc, ns, requests in plan:
            if "base" in modes:  # independent of N: measured once per deployment and load
                specs.append((dep, "base", 0, conc, requests))
            for n in ns:
                specs.extend((dep, mode, n, conc, requests)
                             for mode in MODES if mode in modes and mode != "base")
    runs = {spec: [] for spec in specs}
    for r in range(args.repeat):
        order = list(specs)
        if r > 0:  # later rounds in a new order, so a slow spell of the host hits other cells
            random.Random(args.seed + r).shuffle(order)
        for spec in order:
            runs[spec].append(run_cell(args, *spec, round_index=r))
    cells = [median_round(runs[spec]) for spec in specs]
    rows = ratios(cells)
    config = dict(vars(args))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"config": config, "cells": cells, "ratios": rows}, f, indent=1)
    write_csv(os.path.join(args.out, "results.csv"), [flatten(c) for c in cells], CSV_FIELDS)
    write_csv(os.path.join(args.out, "ratios.csv"),
              [{k: " ".join(f"{x:.4f}" for x in v) if isinstance(v, list) else v
                for k, v in r.items()} for r in rows],
              ["deployment", "mode", "num_adapters", "concurrency", "vs_multi_lora", "vs_base",
               "vs_multi_lora_paired", "vs_base_paired", "vs_multi_lora_rounds",
               "vs_base_rounds"])
    plot(args.out, cells, max(ints(args.concurrency)), ints(args.adapters)[0])
    text = table(cells, rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
