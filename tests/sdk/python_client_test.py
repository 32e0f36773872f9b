#!/usr/bin/env python3
"""The Python SDK (clients/python) against `preft serve`: generate and stream equal to
`preft generate` for the base model and an adapter (PreFT positions), early close cancels,
abort, adapter admin, and server errors as PreftError with their gRPC codes.

Usage: python_client_test.py BUILD_DIR WORK_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import grpc


def main():
    build, work = sys.argv[1:3]
    sys.path.insert(0, os.path.join(build, "clients", "python"))
    from preft_client import Client, Positions, PreftError  # noqa: E402

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(f"{work}/adapters")
    preft = f"{build}/tools/preft"
    run = lambda *a: subprocess.run([preft, *a], check=True, capture_output=True, text=True).stdout
    run("make-model", "--preset", "tiny", "--seed", "11", "--out", f"{work}/model")
    run("make-adapter", "--model", f"{work}/model", "--kind", "lora", "--rank", "4", "--seed", "3",
        "--out", f"{work}/adapters/u1")
    server = subprocess.Popen([preft, "serve", "--model", f"{work}/model", "--listen", "127.0.0.1:0",
                               "--adapter-root", f"{work}/adapters", "--threads", "1"],
                              stdout=subprocess.PIPE, text=True)
    failures = 0

    def expect(ok, what):
        nonlocal failures
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'}: {what}", flush=True)

    try:
        address = None
        deadline = time.time() + 60
        while address is None and time.time() < deadline:
            m = re.search(r"listening on (\S+)", server.stdout.readline())
            address = m.group(1) if m else None
        with Client(address, timeout=60) as c:
            a = c.register_adapter("u1", "u1")
            expect(a.name == "u1" and a.version == 1 and a.type == "lora", f"registered {a}")
            for model, adapter in (("", None), ("u1", f"{work}/adapters/u1")):
                ref_args = ["generate", "--model", f"{work}/model", "--prompt", "python sdk",
                            "--max-tokens", "10", "--ignore-eos", "--json"]
                if adapter:
                    ref_args += ["--adapter", adapter, "--adapter-positions", "prompt"]
                want = json.loads(run(*ref_args))["token_ids"]
                got = c.generate("python sdk", model=model, positions=Positions.PROMPT,
                                 max_tokens=10, ignore_eos=True)
                expect(got.token_ids == want and got.finish_reason == "length" and
                       got.completion_tokens == 10, f"generate {model or 'base'} == preft generate")
                streamed = [d for d in c.stream("python sdk", model=model,
                                                positions=Positions.PROMPT, max_tokens=10,
                                                ignore_eos=True)]
                ids = [t for d in streamed for t in d.token_ids]
                expect(ids == want and streamed[-1].finish_reason == "length",
                       f"stream {model or 'base'}: {len(streamed)} deltas")
            # A prompt sent twice: the second time its full blocks come from the prefix cache.
            long_prompt = list(range(3, 43))
            first = c.generate(long_prompt, max_tokens=2, ignore_eos=True)
            again = c.generate(long_prompt, max_tokens=2, ignore_eos=True)
            expect(first.cached_tokens == 0 and again.cached_tokens == 32 and
                   again.prompt_tokens == 40 and again.token_ids == first.token_ids,
                   f"cached_tokens {first.cached_tokens}, then {again.cached_tokens}")
            # Processed logprobs (the distribution sampled from) through the cluster equal the
            # engine's, and differ from the raw softmax at temperature 0.7.
            sampled = ["--temperature", "0.7", "--seed", "5", "--logprobs", "0"]
            want = json.loads(run("generate", "--model", f"{work}/model", "--prompt", "python sdk",
                                  "--max-tokens", "6", "--ignore-eos", "--json",
                                  "--logprobs-mode", "processed", *sampled))
            kw = dict(max_tokens=6, ignore_eos=True, temperature=0.7, seed=5, logprobs=0)
            proc = c.generate("python sdk", logprobs_mode="processed", **kw)
            raw = c.generate("python sdk", logprobs_mode="raw", **kw)
            expect(proc.token_ids == want["token_ids"] == raw.token_ids, "sampled tokens agree")
            expect(all(abs(a.logprob - b["logprob"]) < 1e-4
                       for a, b in zip(proc.logprobs, want["logprobs"])) and
                   len(proc.logprobs) == 6, "processed logprobs == preft generate's")
            expect(any(abs(a.logprob - b.logprob) > 1e-3 for a, b in zip(proc.logprobs, raw.logprobs)),
                   "processed logprobs differ from raw ones at temperature 0.7")
            # Closing a stream early cancels it.
            it = c.stream("close me", max_tokens=1500, ignore_eos=True)
            next(it)
            it.close()
            # Abort from another thread: the generation ends with reason abort.
            def abort_soon():
                for _ in range(2000):
                    try:
                        c.abort("py-abort")
                        return
                    except PreftError as e:
                        if e.code != grpc.StatusCode.NOT_FOUND:
                            raise
                        time.sleep(0.001)
            t = threading.Thread(target=abort_soon)
            t.start()
            aborted = c.generate("abort me", max_tokens=1500, ignore_eos=True,
                                 request_id="py-abort")
            t.join()
            expect(aborted.finish_reason == "abort", f"abort: {aborted.finish_reason}")
            v = c.update_adapter("u1", f"{work}/adapters/u1")
            expect(v == 2, f"update_adapter -> version {v}")
            expect([x.version for x in c.adapters()] == [2], "adapters() lists version 2")
            for what, call, code in [
                ("unknown adapter", lambda: c.generate("x", model="nobody"), grpc.StatusCode.NOT_FOUND),
                ("bad token id", lambda: c.generate([10 ** 8]), grpc.StatusCode.INVALID_ARGUMENT),
                ("path outside the root", lambda: c.register_adapter("e", "../.."),
                 grpc.StatusCode.INVALID_ARGUMENT),
            ]:
                try:
                    call()
                    expect(False, f"{what} was accepted")
                except PreftError as e:
                    expect(e.code == code, f"{what}: {e}")
            c.unload_adapter("u1", unregister=True)
            expect(c.adapters() == [], "unregistered")
    finally:
        server.terminate()
        server.wait(30)
    print(f"python client: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
