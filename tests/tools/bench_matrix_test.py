#!/usr/bin/python3
"""bench/serve/matrix.py on a tiny model: every mode and deployment starts, serves every request
and token, and the outputs (JSON, CSV, ratios, plots) hold what they claim. Timings are printed,
not asserted.

Usage: bench_matrix_test.py SOURCE_DIR BUILD_DIR WORK_DIR
"""
import csv
import json
import os
import shutil
import subprocess
import sys


def main():
    src, build, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    deployments = "disaggregated,colocated"
    cmd = ["/usr/bin/python3", f"{src}/bench/serve/matrix.py", "--build", build,
           "--model", f"{work}/model", "--preset", "tiny", "--dtype", "f32", "--out", f"{work}/out",
           "--deployments", deployments, "--adapters", "3", "--concurrency", "2,4",
           "--requests", "10", "--prompt-tokens", "8:24", "--max-tokens", "5",
           "--kv-mib", "32", "--prefill-kv-mib", "32", "--adapter-host-mib", "16",
           "--adapter-compute-mib", "16", "--threads", "1", "--tier-cpus", "0:0"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    print(out.stdout)
    if out.returncode != 0:
        print(out.stderr[-4000:])
        return 1
    failures = []
    check = lambda ok, what: ok or failures.append(what)  # noqa: E731
    bad = subprocess.run(cmd[:-1] + ["0-1"], capture_output=True, text=True)
    check(bad.returncode != 0 and "--tier-cpus wants PREFILL:DECODE" in bad.stderr,
          f"a bad --tier-cpus is refused: {bad.stderr[-300:]}")
    r = json.load(open(f"{work}/out/results.json"))
    cells = r["cells"]
    modes = ["base", "lorap", "direftp", "lora", "direft"]
    want = {(d, m, c) for d in deployments.split(",") for m in modes for c in (2, 4)}
    check({(c["deployment"], c["mode"], c["concurrency"]) for c in cells} == want,
          "every deployment x mode x load measured once")
    for c in cells:
        name = f'{c["deployment"]}-{c["mode"]}-c{c["concurrency"]}'
        check(c["failed"] == 0 and c["requests"] == 10, f"{name}: all 10 requests served")
        check(c["generated_tokens"] == c["requested_tokens"] == 50, f"{name}: every token")
        check(c["num_adapters"] == (0 if c["mode"] == "base" else 3), f"{name}: N")
        check(c["adapters"] == (1 if c["mode"] == "base" else 3), f"{name}: adapters sent")
        acq = sum(c["adapter_acquires"].values())
        if c["mode"] == "base":
            check(acq == 0 and c["adapter_hit_rate"] is None and
                  c["adapter_disk_load_ms_mean"] is None, f"{name}: no adapter acquired")
        else:
            # One acquire per request on the tier that runs the prompt (and, for the
            # all-position baseline when disaggregated, one more on the decode tier).
            per = 2 if c["deployment"] == "disaggregated" and c["mode"] in ("lora", "direft") else 1
            check(acq == 10 * per, f"{name}: {acq} acquires, want {10 * per}")
            check(0 <= c["adapter_hit_rate"] <= 1 and c["adapter_acquires"]["load_failure"] == 0,
                  f"{name}: hit rate")
            # Every cell starts a fresh cluster, so its first request per adapter reads it
            # from disk, and the loads' own time is reported.
            check(c["adapter_acquires"]["disk_load"] > 0 and c["adapter_disk_load_ms_mean"] > 0,
                  f"{name}: disk loads timed ({c['adapter_disk_load_ms_mean']})")
        check(0 <= c["kv_usage_mean"] <= c["kv_usage_max"] <= 1, f"{name}: KV usage")
        check(c["ttft_ms"]["p50"] <= c["ttft_ms"]["p99"], f"{name}: TTFT percentiles")
        st = c["decode_steps"]
        # Every token after the first is one decode step's row (the first may come from a
        # prefill worker), and steps never take more than the cell's time.
        check(st["steps"] > 0 and st["tokens_per_step"] * st["steps"] >= 50 - 10,
              f"{name}: decode steps {st}")
        check(0 < st["step_busy"] <= 1 and st["step_ms_mean"] > 0, f"{name}: step time {st}")
        # The router's TTFT split: every stage of a disaggregated call (they add up to the
        # router's TTFT, so their means stay under the slowest request's), only admission
        # when colocated.
        stages = c["ttft_stage_ms_mean"]
        want_stages = (["admit", "reserve", "prefill_queue", "prefill_compute", "kv_transfer",
                        "prefill_rpc", "decode_start"] if c["deployment"] == "disaggregated"
                       else ["admit"])
        check(list(stages) == want_stages and all(v >= 0 for v in stages.values()) and
              sum(stages.values()) <= c["ttft_ms"]["p99"] + 1, f"{name}: TTFT stages {stages}")
        pt = c.get("prefill_steps")
        check((pt is not None) == (c["deployment"] == "disaggregated"), f"{name}: prefill steps")
        if pt:  # every prompt token goes through a prefill step
            check(pt["steps"] > 0 and pt["tokens_per_step"] * pt["steps"] >= 10 * 8
                  and 0 < pt["step_busy"] <= 1, f"{name}: prefill steps {pt}")
    ratios = {(x["deployment"], x["mode"], x["concurrency"]): x for x in r["ratios"]}
    tps = {(c["deployment"], c["mode"], c["concurrency"]): c["output_tokens_per_s"] for c in cells}
    for d in deployments.split(","):
        for m in ("lorap", "direftp"):
            for conc in (2, 4):
                x = ratios[(d, m, conc)]
                check(abs(x["vs_multi_lora"] - tps[(d, m, conc)] / tps[(d, "lora", conc)]) < 1e-9,
                      f"{d}-{m}-c{conc}: ratio to multi-LoRA")
                check(abs(x["vs_base"] - tps[(d, m, conc)] / tps[(d, "base", conc)]) < 1e-9,
                      f"{d}-{m}-c{conc}: ratio to base")
    rows = list(csv.DictReader(open(f"{work}/out/results.csv")))
    check(len(rows) == len(cells) and all(float(x["output_tokens_per_s"]) > 0 for x in rows),
          "results.csv has every cell")
    check(all((x["ttft_reserve_ms_mean"] != "") == (x["deployment"] == "disaggregated")
              for x in rows), "results.csv has the TTFT stages of disaggregated cells")
    check(len(list(csv.DictReader(open(f"{work}/out/ratios.csv")))) == len(r["ratios"]),
          "ratios.csv has every ratio")
    for svg in ("throughput_vs_adapters.svg", "latency_vs_load.svg"):
        text = open(f"{work}/out/{svg}").read() if os.path.exists(f"{work}/out/{svg}") else ""
        check("<svg" in text and "lorap" in text and "disaggregated" in text, f"{svg} drawn")
    # A bad mode is refused with a message and exit code.
    bad = subprocess.run(cmd[:2] + ["--build", build, "--model", f"{work}/model", "--out",
                                    f"{work}/bad", "--modes", "base,qlora"],
                         capture_output=True, text=True)
    check(bad.returncode != 0 and "unknown mode 'qlora'" in bad.stderr, "bad mode refused")
    bad = subprocess.run(cmd[:2] + ["--build", build, "--model", f"{work}/model", "--out",
                                    f"{work}/bad", "--repeat", "0"], capture_output=True, text=True)
    check(bad.returncode != 0 and "--repeat must be at least 1" in bad.stderr, "--repeat 0 refused")
    # Rounds: round 0 comes from the first run's kept cells, round 1 is measured; each cell
    # reports the lower-middle round's record whole, with both throughputs beside it.
    rep = subprocess.run(cmd[:2] + ["--build", build, "--model", f"{work}/model", "--out",
                                    f"{work}/out", "--deployments", "colocated", "--modes",
                                    "base,lorap", "--adapters", "3", "--concurrency", "2",
                                    "--requests", "10", "--prompt-tokens", "8:24",
                                    "--max-tokens", "5", "--kv-mib", "32", "--threads", "1",
                                    "--repeat", "2"], capture_output=True, text=True)
    if rep.returncode != 0:
        print(rep.stderr[-4000:])
    check(rep.returncode == 0, "--repeat 2 runs")
    if rep.returncode == 0:
        got = json.load(open(f"{work}/out/results.json"))["cells"]
        check(len(got) == 2, "--repeat 2: one result per cell")
        for c in got:
            name = f'colocated-{c["mode"]}-n{c["num_adapters"]}-c2'
            check(os.path.exists(f"{work}/out/cells/{name}-r1.json"), f"{name}: round 1 kept")
            rounds = c["output_tokens_per_s_rounds"]
            check(c["rounds"] == 2 and len(rounds) == 2 and
                  c["output_tokens_per_s"] == min(rounds), f"{name}: median of 2 rounds")
            check(rounds[0] == tps[("colocated", c["mode"], 2)], f"{name}: round 0 reused")
            check(c["failed"] == 0 and c["generated_tokens"] == 50, f"{name}: every token")
        # Each ratio also round by round: round r of LoRAP over round r of base.
        rounds = {c["mode"]: c["output_tokens_per_s_rounds"] for c in got}
        paired = [a / b for a, b in zip(rounds["lorap"], rounds["base"])]
        x = json.load(open(f"{work}/out/results.json"))["ratios"][0]
        check(x["mode"] == "lorap" and len(x["vs_base_rounds"]) == 2 and
              all(abs(a - b) < 1e-9 for a, b in zip(x["vs_base_rounds"], paired)) and
              abs(x["vs_base_paired"] - sum(paired) / 2) < 1e-9, f"paired ratios by round: {x}")
        table = open(f"{work}/out/table.md").read()
        check(f"({paired[0]:.2f}/{paired[1]:.2f})" in table, "the table shows the rounds' ratios")
    for f in failures:
        print("FAIL:", f)
    print(f"bench matrix: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
