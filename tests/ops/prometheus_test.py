#!/usr/bin/env python3
"""A real Prometheus scrapes a multi-process preft cluster under load (issue 5).

Starts scripts/local-cluster.sh (router, 2 prefill, 2 decode over UCX), a Prometheus server
(Debian's `prometheus`) scraping every process's /metrics each second, drives base, PreFT and
all-position requests through `preft client`, then asks Prometheus's HTTP query API:
histogram_quantile over the TTFT histograms, the KV usage gauges, and that the tiers' token
counters add up to what the router served.

Usage: prometheus_test.py SOURCE_DIR BUILD_DIR WORK_DIR
"""
import concurrent.futures
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

SKIP = 77  # ctest SKIP_RETURN_CODE


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Checks:
    def __init__(self):
        self.failures = 0

    def expect(self, ok, what):
        print(("ok: " if ok else "FAIL: ") + what, flush=True)
        if not ok:
            self.failures += 1


def exported_names(addresses):
    """Metric names the processes export (histograms also as _bucket, _sum, _count)."""
    names = set()
    for addr in addresses:
        for line in http_get(f"http://{addr}/metrics").splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names.add(name)
                if kind in ("histogram", "summary"):
                    names.update(name + s for s in ("_bucket", "_sum", "_count"))
    return names


def check_dashboard(path, targets, query, checks):
    """Every PromQL expression of the Grafana dashboard parses, names only metrics the
    processes export, and shows data after the load."""
    with open(path) as f:
        dashboard = json.load(f)
    defaults = {v["name"]: v["query"] for v in dashboard["templating"]["list"]
                if v["type"] == "textbox"}
    exported = exported_names([a for addrs in targets.values() for a in addrs])
    exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    checks.expect(len(exprs) >= 30, f"dashboard has {len(exprs)} queries")
    for title, expr in exprs:
        names = set(re.findall(r"preft:[a-z0-9_:]+", expr))
        unknown = names - exported
        checks.expect(names and not unknown, f"{title}: names {sorted(names)} exported"
                      + (f" (unknown: {sorted(unknown)})" if unknown else ""))
        q = expr.replace("$__rate_interval", "2m")
        for var, value in defaults.items():
            q = q.replace(f"${var}", value)
        try:
            result = query(q)
        except Exception as e:  # a PromQL error comes back as HTTP 400
            checks.expect(False, f"{title}: {q}: {e}")
            continue
        values = [v for v in result.values() if not math.isnan(v)]
        checks.expect(bool(values), f"{title}: shows data ({len(values)} series)")


def main():
    src, build, work = sys.argv[1:4]
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("prometheus is not installed (scripts/install-deps.sh installs it); skipping")
        return SKIP
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(f"{work}/adapters")
    preft = f"{build}/tools/preft"
    run = lambda *args: subprocess.run(args, check=True, capture_output=True, text=True).stdout
    run(preft, "make-model", "--preset", "tiny", "--seed", "3", "--out", f"{work}/model")
    run(preft, "make-adapter", "--model", f"{work}/model", "--kind", "lora", "--rank", "4",
        "--seed", "4", "--out", f"{work}/adapters/u1")

    env = dict(os.environ, RUN_DIR=f"{work}/run")
    cluster = [ "bash", f"{src}/scripts/local-cluster.sh"]
    router = subprocess.run(cluster + ["start", build, f"{work}/model", f"{work}/adapters"],
                            env=env, check=True, capture_output=True, text=True).stdout.strip()
    prom = None
    checks = Checks()
    try:
        targets = {}
        with open(f"{work}/run/metrics-targets") as f:
            for line in f:
                name, addr = line.split()
                targets.setdefault(name.split("-")[0], []).append(addr)
        checks.expect(sorted(len(v) for v in targets.values()) == [1, 2, 2],
                      f"metrics endpoints of every process: {targets}")

        port = free_port()
        scrape = "\n".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(addrs)}"
            for job, addrs in sorted(targets.items()))
        with open(f"{work}/prometheus.yml", "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    f"scrape_configs:\n{scrape}\n")
        prom_log = open(f"{work}/prometheus.log", "w")
        prom = subprocess.Popen(
            [prometheus, f"--config.file={work}/prometheus.yml",
             f"--storage.tsdb.path={work}/tsdb", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=prom_log, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                http_get(f"{api}/-/ready")
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("prometheus did not become ready; see prometheus.log")

        def query(expr):
            url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            body = json.loads(http_get(url))
            assert body["status"] == "success", body
            return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                    for r in body["data"]["result"]}

        def scalar(expr):
            values = list(query(expr).values())
            return values[0] if len(values) == 1 else None

        # Load starts once every target has been scraped: a counter first seen mid-load has no
        # earlier sample, and increase() would miss what happened before it.
        deadline = time.time() + 20
        while scalar("count(up == 1)") != 5 and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1.2)

        client = [preft, "client", "--server", router, "--timeout-s", "60"]
        run(*client, "register", "--name", "u1", "--path", "u1")
        kinds = [[], ["--model", "u1", "--adapter-positions", "prompt"],
                 ["--model", "u1", "--adapter-positions", "all"]]
        jobs = [kinds[i % 3] + ["--prompt", f"request {i} " + "words " * (i % 7),
                                "--max-tokens", str(8 + i % 9), "--ignore-eos", "--json"]
                for i in range(36)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda a: json.loads(run(*client, "generate", *a)), jobs))
        served = sum(len(o["token_ids"]) for o in outs)
        checks.expect(all(len(o["token_ids"]) == 8 + i % 9 for i, o in enumerate(outs)),
                      f"36 requests served ({served} tokens)")

        # Everything the load did is visible after two scrapes of every target.
        deadline = time.time() + 20
        while time.time() < deadline:
            got = scalar("sum(preft:router_requests_total)")
            if got == 36 and scalar("count(up == 1)") == 5:
                time.sleep(2.5)
                break
            time.sleep(0.5)
        checks.expect(scalar("count(up == 1)") == 5, "all 5 targets up")
        checks.expect(scalar('sum(preft:router_requests_total{code="ok"})') == 36,
                      "router counted 36 ok requests")
        by_positions = query("sum by (positions) (preft:router_requests_total)")
        checks.expect(len(by_positions) == 3 and all(v == 12 for v in by_positions.values()),
                      f"12 requests each of base, prompt, all: {by_positions}")

        # Tokens add up across tiers: prefill computes every prompt token and samples each
        # first token; decode samples the rest; the router relays them all.
        router_gen = scalar("sum(preft:router_generation_tokens_total)")
        worker_gen = scalar("sum(preft:generation_tokens_total)")
        checks.expect(router_gen == served and worker_gen == served,
                      f"generation tokens: router {router_gen}, workers {worker_gen}, "
                      f"clients got {served}")
        router_prompt = scalar("sum(preft:router_prompt_tokens_total)")
        prefill_prompt = scalar('sum(preft:prompt_tokens_total{job="prefill"})')
        decode_prompt = scalar('sum(preft:prompt_tokens_total{job="decode"})')
        checks.expect(router_prompt is not None and router_prompt > 0 and
                      prefill_prompt == router_prompt and decode_prompt == 0,
                      f"prompt tokens: router {router_prompt}, prefill {prefill_prompt}, "
                      f"decode {decode_prompt}")

        # Latency quantiles from the histograms, as a dashboard computes them.
        for name, expr in [
            ("router TTFT p50", "histogram_quantile(0.5, sum by (le) "
                                "(increase(preft:router_time_to_first_token_seconds_bucket[5m])))"),
            ("router TTFT p99", "histogram_quantile(0.99, sum by (le) "
                                "(increase(preft:router_time_to_first_token_seconds_bucket[5m])))"),
            ("prefill TTFT p90", "histogram_quantile(0.9, sum by (le) (increase("
                                 "preft:time_to_first_token_seconds_bucket{job=\"prefill\"}[5m])))"),
            ("router ITL p50", "histogram_quantile(0.5, sum by (le) "
                               "(increase(preft:router_inter_token_latency_seconds_bucket[5m])))"),
            ("e2e p90", "histogram_quantile(0.9, sum by (le) "
                        "(increase(preft:router_e2e_request_latency_seconds_bucket[5m])))"),
        ]:
            v = scalar(expr)
            checks.expect(v is not None and 0 < v < 30, f"{name} = {v} s")
        p50 = scalar("histogram_quantile(0.5, sum by (le) "
                     "(increase(preft:router_time_to_first_token_seconds_bucket[5m])))")
        p99 = scalar("histogram_quantile(0.99, sum by (le) "
                     "(increase(preft:router_time_to_first_token_seconds_bucket[5m])))")
        checks.expect(p50 is not None and p99 is not None and p50 <= p99, "TTFT p50 <= p99")
        stages = query("sum by (stage) (preft:router_ttft_stage_seconds_count)")
        checks.expect(len(stages) == 7 and all(v == 36 for v in stages.values()),
                      f"TTFT split into 7 stages, each observed 36 times: {stages}")

        time.sleep(2.5)  # two scrapes after the burst
        now_usage = query('preft:kv_cache_usage_perc{job="decode"}')
        checks.expect(len(now_usage) == 2 and all(v == 0 for v in now_usage.values()),
                      f"decode KV usage back to 0 when idle: {now_usage}")
        blocks = scalar('sum(preft:kv_blocks{job="decode",state="free"}) / '
                        'sum(preft:kv_blocks{job="decode"})')
        checks.expect(blocks == 1, f"every decode block free when idle: {blocks}")

        acquires = scalar('sum(preft:adapter_acquires_total{job="prefill"})')
        checks.expect(acquires == 24, f"prefill adapter acquisitions: {acquires} (24 asked)")
        loads = scalar('sum(preft:adapter_load_seconds_count{job="prefill"})')
        misses = scalar('sum(preft:adapter_acquires_total{job="prefill",result!="compute_hit"})')
        checks.expect(loads is not None and loads >= 1 and loads == misses,
                      f"adapter load times: {loads}, one per miss ({misses})")
        info = query('preft:lora_requests_info{job="prefill"}')
        checks.expect(len(info) == 2, f"one lora_requests_info series per prefill worker: {info}")
        transfers = scalar('sum(preft:kv_transfer_seconds_count{job="prefill"})')
        checks.expect(transfers == 36, f"36 KV transfers timed: {transfers}")
        bytes_ = scalar('sum(preft:kv_transfer_bytes_total{job="prefill"})')
        checks.expect(bytes_ is not None and bytes_ > 0, f"KV bytes pushed: {bytes_}")
        routed = query('sum by (choice) (preft:router_routing_decisions_total{tier="prefill"})')
        checks.expect(sum(routed.values()) == 36, f"prefill routing decisions: {routed}")

        # Sustained load until Prometheus has seen both decode workers' KV in use (the gauge is
        # a sample: short requests can fall between scrapes).
        seen = {}
        deadline = time.time() + 60
        long_job = ["--prompt", "a longer generation " * 8, "--max-tokens", "400", "--ignore-eos",
                    "--json"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            while time.time() < deadline:
                list(pool.map(lambda k: run(*client, "generate", *k, *long_job), kinds + [[]]))
                seen = query('max_over_time(preft:kv_cache_usage_perc{job="decode"}[5m])')
                if len(seen) == 2 and all(v > 0 for v in seen.values()):
                    break
        checks.expect(len(seen) == 2 and all(0 < v <= 1 for v in seen.values()),
                      f"decode KV usage seen in (0, 1] on both workers under load: {seen}")

        check_dashboard(f"{src}/deploy/grafana/preft.json", targets, query, checks)
    finally:
        subprocess.run(cluster + ["stop"], env=env)
        if prom is not None:
            prom.terminate()
            prom.wait(10)
    print(f"prometheus test: {checks.failures} failures")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
