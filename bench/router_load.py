#!/usr/bin/python3
"""What N open streams cost one router, with the C++ load generator (bench/router_load.cc):

    bench/router_load.py --build build --load build-bench/bench/router_load \\
        --levels 100,1000,5000 [--apis direct,grpc,http] [--router-env MALLOC_ARENA_MAX=2]

For each level and API (direct: the workers' own Run RPC, no router; grpc: the router's Generate;
http: its OpenAI /v1/completions SSE door) it starts fresh colocated decode workers and a fresh
router (--colocated, --http-listen), so no level inherits another's heap, runs router_load, and
samples the router's threads, RSS and smaps_rollup once every stream has its first token (or
--settle-s passes), and CPU use over the --hold-s window after that; then --probes requests go
one at a time while the N stay open. Prints one table row per (api, level) (see print_table):
the router's added TTFT is its p50 minus direct's p50 at the same N, for the burst and for the
probes; the probes' is the issue's figure, its ratio against the first level's is the target
(<= 2 at 5,000 against 100). --pin gives the router a core of its own.

Why several workers: a decode engine runs at most 256 sequences at once (SchedulerConfig::
max_running, no flag), the rest wait in its queue without tokens, so a level of N streams gets
ceil(N/128) workers (--streams-per-worker: headroom, as the router balances by free KV
blocks, not by running sequences, and at 192 a few streams of 5,000 waited in a full worker's
queue), each with KV for 256 whole sequences. The workers run at nice 19 (--worker-nice) so
that on a small host the router and the client win the cores: the router's added TTFT is then
its own work, not its wait for a core 20+ busy workers hold. Generations are
--max-tokens 600 long: at 100 streams one worker decodes ~195 tokens/s a stream, so 600 tokens
keep every stream open ~3 s, past the settle, the --hold-s window and the probes; at 5,000 a
stream gets ~10 tokens/s and lives about a minute.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_streams import proc_status  # noqa: E402  (threads, RSS KiB of a pid)

CLK_TCK = os.sysconf("SC_CLK_TCK")
MAX_RUNNING = 256  # common/engine/scheduler.h


def smaps_rollup(pid):
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def cpu_s(pid):
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def host_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # busy (not idle, not iowait), all; in ticks


def launch(argv, log, env=None, nice=0):
    return subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def address(p, log):
    """Waits for a launched server's "listening on ADDR" line."""
    deadline = time.time() + 120
    while time.time() < deadline:
        text = open(log).read()
        if "listening on" in text:
            return text.split("listening on ")[1].split()[0]
        if p.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{p.args[0]} did not start; see {log}")


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def snapshot_binaries(build, run):
    """Copies the three binaries into the run folder: every level then runs the same build,
    even while someone rebuilds `build` (a binary briefly missing is waited for)."""
    out = os.path.join(run, "bin")
    os.makedirs(out)
    for rel in ["services/decode/preft-decode", "services/router/preft-router", "tools/preft"]:
        src = os.path.join(build, rel)
        for _ in range(300):
            try:
                shutil.copy2(src, out)
                break
            except OSError:
                time.sleep(2)
        else:
            raise RuntimeError(f"{src} stayed unreadable for 10 minutes")
    return out


def workers_for(args, n):
    return args.workers if args.workers > 0 else -(-n // args.streams_per_worker)


def run_one(args, model, run, api, n):
    """Starts the workers (and, for grpc/http, the router), loads them with n streams; returns
    the row's figures."""
    bin_dir = args.bin_dir
    # --pin: the router alone on the first CPU, the workers and the client on the others.
    pin_router = ["taskset", "-c", "0"] if args.pin else []
    pin_rest = ["taskset", "-c", f"1-{os.cpu_count() - 1}"] if args.pin else []
    procs = []
    try:
        logs = [os.path.join(run, f"decode{w}.log") for w in range(workers_for(args, n))]
        for log in logs:  # all at once: 27 workers one by one take half a minute
            procs.append(launch(pin_rest + [os.path.join(bin_dir, "preft-decode"), "--model", model,
                                 "--colocated", "--adapter-root", run, "--transport", "inproc",
                                 "--threads", "1", "--kv-bytes", str(args.worker_kv_mib << 20),
                                 "--max-batch-tokens", str(args.max_batch_tokens)],
                                log, nice=args.worker_nice))
        workers = [address(p, log) for p, log in zip(procs, logs)]
        router = None
        if api == "direct":
            target = ",".join(workers)
        else:
            env = dict(os.environ)
            for kv in args.router_env:
                k, _, v = kv.partition("=")
                env[k] = v
            log = os.path.join(run, f"router-{api}-{n}-{time.time():.0f}.log")
            router = launch(
                pin_router + [os.path.join(bin_dir, "preft-router"), "--model", model,
                 "--colocated", "--decode", ",".join(workers), "--adapter-root", run,
                 "--http-listen", "127.0.0.1:0", "--http-max-connections", str(max(10000, 2 * n)),
                 "--http-max-connections-per-client", str(max(512, 2 * n))] + args.router_arg,
                log, env=env)
            procs.append(router)
            raddr = address(router, log)
            text = open(log).read()
            target = raddr if api == "grpc" else text.split("http://")[1].split("/")[0]
            time.sleep(1.5)  # first status polls of every worker
        idle = proc_status(router.pid) if router else None
        idle_smaps = smaps_rollup(router.pid) if router else None
        load = subprocess.Popen(
            pin_rest + [os.path.abspath(args.load), "--api", api, "--target", target, "--streams", str(n),
             "--max-tokens", str(args.max_tokens), "--settle-s", str(args.settle_s),
             "--hold-s", str(args.hold_s), "--probes", str(args.probes),
             "--model", os.path.basename(model)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stderr_lines = []
        settled = threading.Event()

        def pump():
            for line in load.stderr:
                stderr_lines.append(line)
                if "settled" in line:
                    settled.set()
            settled.set()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        settled.wait()
        row = {"api": api, "n": n}
        if router and router.poll() is None:
            row["threads"], row["rss"] = proc_status(router.pid)
            row["idle_threads"], row["idle_rss"] = idle
            row["smaps"], row["idle_smaps"] = smaps_rollup(router.pid), idle_smaps
        # CPU over most of the hold window, while every stream is open.
        pids = {"router": [router.pid] if router else [], "load": [load.pid],
                "workers": [p.pid for p in procs if p is not router]}
        c0 = {k: sum(cpu_s(p) for p in v) for k, v in pids.items()}
        h0 = host_busy()
        window = args.hold_s * 0.8
        time.sleep(window)
        c1 = {k: sum(cpu_s(p) for p in v) for k, v in pids.items()}
        h1 = host_busy()
        row["cpu"] = {k: (c1[k] - c0[k]) / window for k in c0}  # cores
        row["host_busy"] = (h1[0] - h0[0]) / max(1, h1[1] - h0[1])
        row["router_cpu_total_s"] = cpu_s(router.pid) if router else None
        out, _ = load.communicate(timeout=120)
        t.join(timeout=5)
        try:
            row["load"] = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            raise RuntimeError(f"router_load printed no result: {out!r} {''.join(stderr_lines)}")
        return row
    finally:
        stop(procs)


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="where preft-router, preft-decode, preft are")
    ap.add_argument("--load", default="build-bench/bench/router_load", help="router_load binary")
    ap.add_argument("--levels", default="100,1000,5000")
    ap.add_argument("--apis", default="direct,grpc,http")
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--workers", type=int, default=0,
                    help="colocated decode workers (0: ceil(streams / --streams-per-worker))")
    ap.add_argument("--worker-kv-mib", type=int, default=128)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--worker-nice", type=int, default=19,
                    help="nice the workers so the router and the client win the shared cores")
    ap.add_argument("--settle-s", type=float, default=60)
    ap.add_argument("--hold-s", type=float, default=1.5)
    ap.add_argument("--probes", type=int, default=40,
                    help="requests sent one at a time once the N are open (steady-state TTFT)")
    ap.add_argument("--pin", action="store_true",
                    help="the router alone on CPU 0, workers and client on the rest (taskset): "
                         "its added TTFT without waiting for a core")
    ap.add_argument("--router-env", action="append", default=[],
                    help="KEY=VALUE in the router's environment (repeatable)")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="an extra preft-router argument (repeatable), e.g. --router-arg=--relay-threads=0")
    ap.add_argument("--repeat", type=int, default=3, help="runs per (api, level); medians shown")
    ap.add_argument("--streams-per-worker", type=int, default=128,
                    help=f"workers per level: ceil(streams / this); under {MAX_RUNNING} because "
                         "the router balances by free KV blocks, not running sequences, and a "
                         "worker sent more than it runs queues the rest")
    ap.add_argument("--json", default="", help="also write every row here")
    ap.add_argument("--table-from", default="", help="print the table of an earlier --json")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    apis = args.apis.split(",")
    if args.table_from:
        with open(args.table_from) as f:
            return print_table(json.load(f), levels, apis)
    run = tempfile.mkdtemp(prefix="preft-router-load-")
    model = os.path.join(run, "model")
    args.bin_dir = snapshot_binaries(os.path.abspath(args.build), run)
    subprocess.run([os.path.join(args.bin_dir, "preft"), "make-model",
                    "--preset", "tiny", "--dtype", "f32", "--seed", "7", "--out", model],
                   check=True, stdout=subprocess.DEVNULL)
    cpu_model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu_model = next((l.split(":", 1)[1].strip() for l in cpu_model.splitlines()
                      if l.startswith("Model name")), "?")
    print(f"host: {cpu_model}, {os.cpu_count()} cores; colocated workers: "
          f"{', '.join(str(workers_for(args, n)) for n in levels)} (nice {args.worker_nice}); "
          f"tiny f32, 4-token prompts, {args.max_tokens} tokens a stream; router env "
          f"{' '.join(args.router_env) or '-'}; {args.repeat} runs each"
          f"{'; router pinned to CPU 0, the rest to the others' if args.pin else ''}", flush=True)
    rows = []
    for n in levels:
        for rep in range(args.repeat):  # APIs interleaved: others' load hits each alike
            for api in apis:
                row = run_one(args, model, run, api, n)
                rows.append(row)
                print(f"# {api} {n} #{rep}: {json.dumps(row['load'])} cpu {row['cpu']} "
                      f"host {row['host_busy']:.2f}", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print_table(rows, levels, apis)
    if any(r["load"].get("errors", {}).get("count") for r in rows):
        print(f"streams failed: the logs are in {run}", file=sys.stderr)
    else:
        shutil.rmtree(run)  # the logs stay only when a run failed


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def print_table(rows, levels, apis):
    """One row per (api, level), medians over the repeats. "µs / token": the router's CPU over
    the hold window per token (HTTP: per event) relayed. Two TTFTs: the burst's (all N
    streams opened at once: its p50 waits for half the burst to be admitted, so it grows with N
    by construction) and the probes' (requests sent one at a time while the N are open: what
    N open streams cost a new request, the issue's "added TTFT"). Added = router - direct at
    the same N; ratio = added at this level / added at the first level."""
    ncpu = os.cpu_count()
    group = {}
    for r in rows:
        group.setdefault((r["api"], r["n"]), []).append(r)
    ttft = {k: {kind: median(r["load"][kind]["p50"] for r in v)
                for kind in ("ttft_ms", "probe_ttft_ms")} for k, v in group.items()}
    print("| API | streams | with tokens | router threads (idle) | RSS MiB (idle) | RSS KiB / stream "
          "| burst TTFT p50 / p99 ms | added | probe TTFT p50 [range] / p99 ms | added | added / "
          "first level | cores: router, load, workers, other | tok/s | router µs / token "
          "| load KiB / stream |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    first = {}
    for api in apis:
        for n in levels:
            v = group.get((api, n), [])
            if not v:
                continue
            loads = [r["load"] for r in v]
            m = lambda f: median(f(r) for r in v)  # noqa: E731
            added = {}
            for kind in ("ttft_ms", "probe_ttft_ms"):
                here, there = ttft[(api, n)][kind], ttft.get(("direct", n), {}).get(kind)
                added[kind] = here - there if api != "direct" and None not in (here, there) else None
            ratio = None
            if added["probe_ttft_ms"] is not None:
                first.setdefault(api, added["probe_ttft_ms"])
                ratio = added["probe_ttft_ms"] / first[api] if first[api] > 0 else None
            if all("rss" in r for r in v):
                router_cols = (f"{m(lambda r: r['threads']):.0f} ({m(lambda r: r['idle_threads']):.0f}) | "
                               f"{m(lambda r: r['rss']) / 1024:.0f} ({m(lambda r: r['idle_rss']) / 1024:.0f}) | "
                               f"{m(lambda r: (r['rss'] - r['idle_rss']) / n):.1f}")
            else:
                router_cols = "- | - | -"
            cores = {k: m(lambda r: r["cpu"][k]) for k in ("router", "load", "workers")}
            other = m(lambda r: r["host_busy"] * ncpu - sum(r["cpu"].values()))
            probes = [L["probe_ttft_ms"]["p50"] for L in loads if L["probe_ttft_ms"]["p50"] is not None]
            spread = f" [{min(probes):.1f}-{max(probes):.1f}]" if len(probes) > 1 else ""
            settled = sum(L["settled"] for L in loads)
            print(f"| {api} | {n} | {min(L['streams_with_tokens'] for L in loads)}"
                  f"{'' if settled == len(loads) else f' ({len(loads) - settled} of {len(loads)} not settled)'} | "
                  f"{router_cols} | {fmt(ttft[(api, n)]['ttft_ms'], '.0f')} / "
                  f"{fmt(median(L['ttft_ms']['p99'] for L in loads), '.0f')} | "
                  f"{fmt(added['ttft_ms'], '.0f')} | {fmt(ttft[(api, n)]['probe_ttft_ms'], '.1f')}{spread} / "
                  f"{fmt(median(L['probe_ttft_ms']['p99'] for L in loads), '.1f')} | "
                  f"{fmt(added['probe_ttft_ms'], '.1f')} | {fmt(ratio, '.2f')} | "
                  f"{cores['router']:.2f}, {cores['load']:.2f}, {cores['workers']:.2f}, {other:.2f} | "
                  f"{median(L['tokens_per_s'] for L in loads):.0f} | "
                  f"{fmt(m(lambda r: r['cpu']['router'] / max(1.0, r['load']['tokens_per_s']) * 1e6) if api != 'direct' else None)} | "
                  f"{median(L['client_rss_kib']['per_stream'] for L in loads):.1f} |", flush=True)
            for L in loads:
                if L["errors"]["count"] or L["ended_before_sample"] or L["open_at_end_of_hold"] < n:
                    print(f"|  | note: {L['errors']['count']} errors "
                          f"({L['errors']['first'][:120]}), {L['ended_before_sample']} ended "
                          f"before the sample, {L['open_at_end_of_hold']} open at the end of the "
                          f"hold |", flush=True)


if __name__ == "__main__":
    main()
