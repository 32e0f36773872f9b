#!/usr/bin/python3
"""A soak with faults: mixed-adapter load through a pair of routers while a random process of
the cluster (a decode or prefill worker, or a router) is killed with SIGKILL every
--kill-every seconds and started again on the same port.

    scripts/soak.py --build build --minutes 30 [--kill-every 120] [--clients 6] [--out FILE]

Everything runs on 127.0.0.1: 2 decode workers, 2 prefill workers (KV over UCX shared memory),
2 routers sharing one adapter root (the durable registry), the tiny preset and 8 adapters
(LoRAP and DiReFTP) made on the fly. Each client thread picks a request from a fixed set of
32 (greedy or seeded, a base model or an adapter) and a router; UNAVAILABLE answers are
retried on the other router (at most 3 tries in all, as a client library would).

Every request ends in exactly one class:
  correct  - its tokens equal the same request's solo run (made before any fault); `retried`
             counts those that needed a second or third try
  wrong    - it completed with other tokens (target 0)
  failed   - an error with a retryable code and a message, after the retries (clients can act)
  lost     - anything else: a stream that ended without a finish, no answer before the
             client's deadline, an error without a message (target 0)
At the end: every decode and prefill worker's KV blocks are free again (leaked, target 0) and
both routers list every adapter at its version (registry entries lost, target 0). The table
goes to stdout (markdown) and, with --out, as JSON.
"""
import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

RETRYABLE = {"UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A cluster process that can be killed and started again with the same arguments."""

    def __init__(self, name, argv, run_dir):
        self.name, self.argv, self.run_dir, self.p, self.starts = name, argv, run_dir, None, 0

    def start(self):
        self.starts += 1
        log = open(os.path.join(self.run_dir, f"{self.name}.{self.starts}.log"), "w")
        self.p = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        path = log.name
        deadline = time.time() + 60
        while time.time() < deadline:
            if "listening on" in open(path).read():
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start; see {path}")

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def stop(self):
        if self.p and self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.kill()


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--kill-every", type=float, default=120)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--keep", action="store_true", help="keep the run folder (logs)")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "clients", "python"))
    from preft_client import Client, Positions, PreftError  # noqa: E402

    rng = random.Random(args.seed)
    run = tempfile.mkdtemp(prefix="preft-soak-")
    preft = os.path.join(build, "tools", "preft")
    model, root = os.path.join(run, "model"), os.path.join(run, "adapters")
    subprocess.run([preft, "make-model", "--preset", "tiny", "--dtype", "f32", "--seed", "7",
                    "--out", model], check=True, stdout=subprocess.DEVNULL)
    adapters = []
    for i in range(8):
        kind = "lora" if i % 2 == 0 else "direft"
        name = f"u{i}"
        subprocess.run([preft, "make-adapter", "--model", model, "--kind", kind, "--rank",
                        "8" if kind == "lora" else "4", "--seed", str(100 + i), "--out",
                        os.path.join(root, name)], check=True, stdout=subprocess.DEVNULL)
        adapters.append(name)

    ports = {n: free_port() for n in
             ["decode0", "decode1", "prefill0", "prefill1", "router0", "router1",
              "m_decode0", "m_decode1", "m_prefill0", "m_prefill1"]}
    common = ["--model", model, "--threads", "1", "--adapter-root", root]
    ucx = ["--transport", "ucx", "--ucx-tls", "posix,self"]
    procs = {}
    for i in range(2):
        procs[f"decode{i}"] = Proc(f"decode{i}", [
            os.path.join(build, "services/decode/preft-decode"), *common, *ucx,
            "--kv-bytes", str(16 << 20), "--listen", f"127.0.0.1:{ports[f'decode{i}']}",
            "--metrics-listen", f"127.0.0.1:{ports[f'm_decode{i}']}"], run)
        procs[f"prefill{i}"] = Proc(f"prefill{i}", [
            os.path.join(build, "services/prefill/preft-prefill"), *common, *ucx,
            "--kv-bytes", str(8 << 20), "--listen", f"127.0.0.1:{ports[f'prefill{i}']}",
            "--metrics-listen", f"127.0.0.1:{ports[f'm_prefill{i}']}"], run)
    decode = ",".join(f"127.0.0.1:{ports[f'decode{i}']}" for i in range(2))
    prefill = ",".join(f"127.0.0.1:{ports[f'prefill{i}']}" for i in range(2))
    for i in range(2):
        procs[f"router{i}"] = Proc(f"router{i}", [
            os.path.join(build, "services/router/preft-router"), "--model", model,
            "--adapter-root", root, "--decode", decode, "--prefill", prefill,
            "--listen", f"127.0.0.1:{ports[f'router{i}']}", "--drain-min-s", "0"], run)
    for name in ["decode0", "decode1", "prefill0", "prefill1", "router0", "router1"]:
        procs[name].start()
    routers = [f"127.0.0.1:{ports['router0']}", f"127.0.0.1:{ports['router1']}"]
    clients = [Client(a, timeout=60) for a in routers]
    for name in adapters:
        clients[0].register_adapter(name, name)
    registered = {a.name: a.version for a in clients[1].adapters()}
    assert set(registered) == set(adapters), f"router1 sees {registered}"

    # The fixed set of requests, and each one's solo run before any fault.
    requests = []
    for i in range(32):
        model_name = "" if i % 4 == 0 else adapters[i % len(adapters)]
        requests.append(dict(prompt=f"request {i}: " + "word " * rng.randint(2, 60),
                             model=model_name,
                             positions=Positions.PROMPT if model_name else Positions.DEFAULT,
                             max_tokens=rng.randint(8, 96), ignore_eos=True,
                             temperature=0.0 if i % 3 else 0.8, seed=i))
    solo = [clients[0].generate(**r).token_ids for r in requests]

    counts = {"sent": 0, "correct": 0, "wrong": 0, "failed": 0, "lost": 0, "retried": 0}
    failures, lost_examples = {}, []
    lock = threading.Lock()
    stop_at = time.time() + args.minutes * 60

    def client_loop(k):
        local = random.Random(args.seed * 1000 + k)
        while time.time() < stop_at:
            i = local.randrange(len(requests))
            first = local.randrange(2)
            outcome, detail, tries = None, "", 0
            for attempt in range(3):
                tries = attempt + 1
                c = clients[(first + attempt) % 2]
                try:
                    out = c.generate(**requests[i])
                    if not out.finish_reason:
                        outcome, detail = "lost", "stream ended without a finish"
                    else:
                        outcome = "correct" if out.token_ids == solo[i] else "wrong"
                    break
                except PreftError as e:
                    code = e.code.name
                    if code == "DEADLINE_EXCEEDED":  # the client's own 60 s: nothing answered
                        outcome, detail = "lost", "no answer within 60 s"
                        break
                    if code not in RETRYABLE or not e.message:
                        outcome, detail = "lost", f"{code}: {e.message!r}"
                        break
                    outcome, detail = "failed", f"{code}: {e.message[:80]}"
                    if code == "UNAVAILABLE" or code == "CANCELLED":
                        time.sleep(0.2)
                        continue
                    break
            with lock:
                counts["sent"] += 1
                counts[outcome] += 1
                counts["retried"] += tries > 1
                if outcome == "failed":
                    failures[detail] = failures.get(detail, 0) + 1
                if outcome in ("lost", "wrong") and len(lost_examples) < 10:
                    lost_examples.append(f"{outcome} request {i}: {detail}")

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    kills = []
    victims = ["decode0", "decode1", "prefill0", "prefill1", "router0", "router1"]
    next_kill = time.time() + args.kill_every
    while time.time() < stop_at:
        time.sleep(1)
        if time.time() >= next_kill and time.time() < stop_at - 10:
            victim = rng.choice(victims)
            procs[victim].kill()
            time.sleep(rng.uniform(1, 4))
            procs[victim].start()
            kills.append(victim)
            print(f"[{time.strftime('%H:%M:%S')}] killed and restarted {victim}; so far "
                  f"{counts}", flush=True)
            next_kill = time.time() + args.kill_every
    for t in threads:
        t.join()

    # Nothing held: every worker's KV free again once leases run out (30 s) and the
    # quarantine after a lost transfer ends.
    leaked = {}
    deadline = time.time() + 90
    while True:
        leaked = {}
        for name in ["decode0", "decode1", "prefill0", "prefill1"]:
            m = metrics(ports[f"m_{name}"])
            used = sum(v for k, v in m.items() if k.startswith("preft:kv_cache_usage_perc"))
            if used > 0:
                leaked[name] = used
        if not leaked or time.time() > deadline:
            break
        time.sleep(2)
    registry_lost = 0
    for c in clients:
        seen = {a.name: a.version for a in c.adapters()}
        registry_lost += sum(1 for n, v in registered.items() if seen.get(n) != v)

    result = dict(minutes=args.minutes, kill_every_s=args.kill_every, clients=args.clients,
                  kills=kills, **counts, failed_by_reason=failures, examples=lost_examples,
                  kv_leaked=leaked, registry_entries_lost=registry_lost)
    print()
    print(f"| soak | {args.minutes:g} min, kill -9 every {args.kill_every:g} s, "
          f"{args.clients} clients |")
    print("|---|---|")
    for k in ["sent", "correct", "retried", "failed", "lost", "wrong"]:
        print(f"| {k} | {counts[k]} |")
    print(f"| kills | {len(kills)}: {', '.join(kills)} |")
    print(f"| KV blocks leaked | {'0' if not leaked else leaked} |")
    print(f"| registry entries lost | {registry_lost} |")
    for reason, n in sorted(failures.items(), key=lambda kv: -kv[1]):
        print(f"| failed: {reason} | {n} |")
    for e in lost_examples:
        print(f"| example | {e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    for c in clients:
        c.close()
    for name in ["router0", "router1", "prefill0", "prefill1", "decode0", "decode1"]:
        procs[name].stop()
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    else:
        print(f"logs in {run}")
    ok = counts["lost"] == 0 and counts["wrong"] == 0 and not leaked and registry_lost == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
