#!/usr/bin/python3
"""How many open streams one router holds, and what each costs it: N concurrent streaming
Generate calls (long generations on the tiny preset) through one router in front of one
colocated decode worker, for N in --levels. At each level, once every stream has its first
token (or --settle seconds pass): streams receiving tokens, the router's threads and RSS, and
client-side TTFT p50/p99. Run it for two router builds in one go to compare them:

    bench/router_streams.py --build build --levels 100,1000 [--baseline-build OLD_BUILD]

Prints one table row per (build, level); ratios against the first level of each build.
"""
import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return int(out["Threads"]), int(out["VmRSS"].split()[0])  # threads, KiB


def start(argv, log):
    p = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        text = open(log).read()
        if "listening on" in text:
            return p, text.split("listening on ")[1].split()[0]
        if p.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{argv[0]} did not start; see {log}")


async def settle_and_summarise(first, n, started, settle):
    """Waits until all `n` streams had a first token (`first`: stream -> seconds) or `settle`
    seconds passed; returns (streams with tokens, TTFT p50, TTFT p99)."""
    while len(first) < n and time.time() - started < settle:
        await asyncio.sleep(0.1)
    ttfts = sorted(first.values())
    if not ttfts:
        return 0, float("nan"), float("nan")
    return len(ttfts), statistics.median(ttfts), ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]


async def level(pb, pb_grpc, address, n, max_tokens, settle):
    import grpc
    channels = [grpc.aio.insecure_channel(address) for _ in range(max(1, n // 100))]
    first = {}
    started = time.time()
    calls = []

    async def one(i):
        stub = pb_grpc.PreftStub(channels[i % len(channels)])
        req = pb.GenerateRequest(stream=True)
        req.token_ids.ids.extend([1, 2, 3, 4 + i % 50])
        req.sampling.max_tokens = max_tokens
        req.sampling.ignore_eos = True
        call = stub.Generate(req)
        calls.append(call)
        t0 = time.time()
        try:
            async for msg in call:
                if msg.token_ids and i not in first:
                    first[i] = time.time() - t0
        except grpc.aio.AioRpcError:
            pass

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    result = await settle_and_summarise(first, n, started, settle)
    for c in calls:
        c.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in channels:
        await ch.close()
    return result


async def level_http(address, n, max_tokens, settle):
    """The same over the OpenAI HTTP door: streamed /v1/completions, one connection each."""
    host, port = address.rsplit(":", 1)
    first = {}
    started = time.time()
    writers = []

    async def one(i):
        t0 = time.time()
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return
        writers.append(writer)
        body = ('{"model": "model", "prompt": [1, 2, 3, %d], "max_tokens": %d, '
                '"ignore_eos": true, "stream": true}' % (4 + i % 50, max_tokens))
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        try:
            await writer.drain()
            got = b""
            while i not in first:
                chunk = await reader.read(4096)
                if not chunk:
                    return
                got += chunk
                if b'"text"' in got:
                    first[i] = time.time() - t0
            while await reader.read(65536):
                pass
        except (OSError, asyncio.CancelledError):
            pass

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    result = await settle_and_summarise(first, n, started, settle)
    for w in writers:
        w.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return result


def run_build(build, model, levels, max_tokens, settle, run, http):
    sys.path.insert(0, os.path.join(build, "clients", "python", "preft_client", "_proto"))
    from preft.v1 import preft_pb2 as pb, preft_pb2_grpc as pb_grpc  # noqa: E402
    decode, daddr = start([os.path.join(build, "services/decode/preft-decode"), "--model", model,
                           "--colocated", "--adapter-root", run, "--transport", "inproc",
                           "--threads", "1", "--kv-bytes", str(1 << 30)],
                          os.path.join(run, "decode.log"))
    router, raddr = start([os.path.join(build, "services/router/preft-router"), "--model", model,
                           "--colocated", "--decode", daddr, "--adapter-root", run,
                           "--http-listen", "127.0.0.1:0"], os.path.join(run, "router.log"))
    haddr = open(os.path.join(run, "router.log")).read().split("http://")[1].split("/")[0]
    try:
        time.sleep(1)
        idle_threads, idle_rss = proc_status(router.pid)
        for n in levels:
            async def measure():
                task = asyncio.create_task(
                    level_http(haddr, n, max_tokens, settle) if http
                    else level(pb, pb_grpc, raddr, n, max_tokens, settle))
                # Sampled while the streams are open.
                await asyncio.sleep(settle * 0.8)
                sample = proc_status(router.pid)
                return await task, sample
            (got, p50, p99), (threads, rss) = asyncio.run(measure())
            yield (n, got, threads, idle_threads, rss, idle_rss, p50, p99)
    finally:
        router.terminate()
        decode.terminate()
        router.wait()
        decode.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--baseline-build", default="")
    ap.add_argument("--levels", default="100,1000")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--settle", type=float, default=6.0)
    ap.add_argument("--http", action="store_true", help="through the OpenAI HTTP door")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    run = tempfile.mkdtemp(prefix="preft-router-streams-")
    builds = [b for b in [args.baseline_build, args.build] if b]
    model = os.path.join(run, "model")
    subprocess.run([os.path.join(os.path.abspath(builds[-1]), "tools/preft"), "make-model",
                    "--preset", "tiny", "--dtype", "f32", "--seed", "7", "--out", model],
                   check=True, stdout=subprocess.DEVNULL)
    print("| build | streams | with tokens | router threads (idle) | RSS MiB (idle) | "
          "RSS KiB / stream | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for b in builds:
        b = os.path.abspath(b)
        for n, got, threads, idle_t, rss, idle_rss, p50, p99 in run_build(
                b, model, levels, args.max_tokens, args.settle, run, args.http):
            print(f"| {os.path.basename(b)}{' HTTP' if args.http else ''} | {n} | {got} | {threads} ({idle_t}) | "
                  f"{rss / 1024:.0f} ({idle_rss / 1024:.0f}) | {(rss - idle_rss) / n:.1f} | "
                  f"{p50 * 1e3:.1f} | {p99 * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
