// Starts what each rendered Deployment would run, on loopback: the real binary with the
// manifest's args, replacing only what differs on this machine (addresses and ports, volume
// paths, the KV size, UCX transports this host lacks), then asks each port what the kubelet,
// Prometheus and a client would: every probe's gRPC health check, GET on the ServiceMonitor's
// path, one request through the router, and a SIGTERM drain within the grace period.

import { execFile, spawn, spawnSync } from "node:child_process";
import { existsSync, mkdirSync, openSync, readFileSync } from "node:fs";
import http from "node:http";
import { createServer } from "node:net";
import { join } from "node:path";
import { promisify } from "node:util";
import { addressPort, containerPort, flagValue, labelsMatch } from "./pods.mjs";
import { tierOf } from "./static_checks.mjs";

const execFileP = promisify(execFile);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const kStartS = 60;                // a tiny model loads in well under a second
const kLocalKvBytes = 64 << 20;    // the manifests' budgets would take GBs here
const kLifetimeS = 300;            // no child outlives this, even if the test is killed
// Whether this machine can run --device cuda (else the pods' engines run on the CPU here).
const kHasGpu = spawnSync("nvidia-smi", ["-L"], { stdio: "ignore" }).status === 0;
// UCX transports any Linux host has; others (rc, cuda_*) become tcp here.
const kLocalTls = new Set(["tcp", "self", "posix", "sysv", "cma", "shm", "sm", "mm"]);

const children = new Set();
// Each child leads its own process group (`timeout` and the binary): kill both.
export function killAll() {
  for (const c of children) {
    try { process.kill(-c.pid, "SIGKILL"); } catch {}
  }
  children.clear();
}

// Ports free now, for processes that bind them a moment later. Taken below Linux's ephemeral
// range (32768-60999 by default), so the outgoing connections of whatever else runs on the
// machine (other tests, a build) cannot take one in between; each is checked free by binding.
async function freePorts(n) {
  const servers = [];
  for (let tries = 0; servers.length < n && tries < 1000; tries++) {
    const port = 20000 + Math.floor(Math.random() * 12000);
    const s = createServer();
    const ok = await new Promise((resolve) => {
      s.once("error", () => resolve(false)).listen(port, "127.0.0.1", () => resolve(true));
    });
    if (ok) servers.push(s);
  }
  if (servers.length < n) throw new Error(`no ${n} free ports below 32000`);
  const ports = servers.map((s) => s.address().port);
  await Promise.all(servers.map((s) => new Promise((r) => s.close(r))));
  return ports;
}

function httpGet(port, path) {
  return new Promise((resolve, reject) => {
    const req = http.get({ host: "127.0.0.1", port, path, timeout: 5000 }, (res) => {
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (d) => (body += d));
      res.on("end", () => resolve({ status: res.statusCode, type: res.headers["content-type"] ?? "", body }));
    });
    req.on("timeout", () => req.destroy(new Error("timed out")));
    req.on("error", reject);
  });
}

// What a kubelet grpc probe sees: "SERVING", another status, or the error.
async function health(preft, port, service) {
  const args = ["client", "--server", `127.0.0.1:${port}`, "--timeout-s", "2", "health"];
  if (service) args.push("--service", service);
  try {
    return (await execFileP(preft, args, { timeout: 10000 })).stdout.trim();
  } catch (e) {
    return `${e.stdout ?? ""}${e.stderr ?? ""}`.trim() || e.message;
  }
}

const logTail = (file) => readFileSync(file, "utf8").trim().split("\n").slice(-8).join("\n    ");

// Local stand-ins for the pod's volumes: one folder per claim (shared by the pods that mount
// it, as in the cluster), one per emptyDir.
function localPath(p, path, volumesDir) {
  const mount = (p.container.volumeMounts ?? [])
    .filter((m) => path === m.mountPath || path.startsWith(m.mountPath.replace(/\/?$/, "/")))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  if (!mount) return undefined;
  const volume = p.spec.volumes.find((v) => v.name === mount.name);
  const key = volume.persistentVolumeClaim ? `pvc-${volume.persistentVolumeClaim.claimName}` : `${p.name}-${volume.name}`;
  mkdirSync(join(volumesDir, key), { recursive: true });
  return join(volumesDir, key, path.slice(mount.mountPath.length));
}

// The pod's flags for this machine; `notes` says what was replaced beyond addresses and paths.
function localFlags(p, ctx, notes) {
  const local = (flag, v) => {
    if (flag === "--prefill" || flag === "--decode") return v.split(",").map((s) => ctx.resolveSpec(s)).join(",");
    if (flag === "--kv-bytes" && Number(v) > kLocalKvBytes) {
      notes.add(`--kv-bytes ${v} -> ${kLocalKvBytes}`);
      return String(kLocalKvBytes);
    }
    if (flag === "--ucx-tls" && !v.split(",").every((t) => kLocalTls.has(t))) {
      notes.add(`--ucx-tls ${v} -> tcp (no RDMA or CUDA here)`);
      return "tcp";
    }
    if (flag === "--ucx-net-devices" && v) {
      notes.add(`--ucx-net-devices ${v} -> lo`);
      return "lo";
    }
    if (flag === "--device" && v !== "cpu" && !kHasGpu) {
      notes.add(`--device ${v} -> cpu (no GPU here)`);
      return "cpu";
    }
    if (flag === "--tensor-parallel" && v !== "1" && !kHasGpu) {
      notes.add(`--tensor-parallel ${v} -> 1 (no GPU here)`);
      return "1";
    }
    const port = addressPort(v);
    if (port !== undefined && containerPort(p.container, port) !== undefined) return `127.0.0.1:${ctx.ports.get(p.name).get(port)}`;
    return (v.startsWith("/") && localPath(p, v, ctx.volumesDir)) || v;
  };
  return p.flags.map((f) => ({ name: f.name, value: f.value === undefined ? undefined : local(f.name, f.value) }));
}

function start(bin, args, env, log) {
  const fd = openSync(log, "w");
  const child = spawn("timeout", ["-k", "5", String(kLifetimeS), bin, ...args],
    { env, stdio: ["ignore", fd, fd], detached: true });
  children.add(child);
  child.exited = new Promise((resolve) => child.on("exit", (code, signal) => {
    children.delete(child);
    resolve(code ?? signal);
  }));
  return child;
}

async function waitServing(child, preft, port, service) {
  const deadline = Date.now() + kStartS * 1000;
  let last = "";
  while (Date.now() < deadline) {
    if (child.exitCode !== null || child.signalCode !== null) return `exited (${child.exitCode ?? child.signalCode})`;
    last = await health(preft, port, service);
    if (last === "SERVING") return last;
    await sleep(200);
  }
  return `not SERVING after ${kStartS} s (last answer: ${last})`;
}

// `pods`: describePods with this machine's downward API; `required`: pod name -> series its
// /metrics must have; `scrapes`: the ServiceMonitor's targets (from the static checks).
export async function liveChecks({ overlay, objs, pods, required, scrapes, build, work, check, note }) {
  const preft = join(build, "tools/preft");
  const ports = new Map(pods.map((p) => [p.name, new Map()]));  // pod -> containerPort -> loopback port
  const wanted = pods.flatMap((p) => (p.container.ports ?? []).map((x) => [p.name, x.containerPort]));
  const free = await freePorts(wanted.length);
  wanted.forEach(([name, port], i) => ports.get(name).set(port, free[i]));
  const services = objs.filter((o) => o.kind === "Service");
  const ctx = {
    ports,
    volumesDir: join(work, "volumes"),
    resolveSpec(spec) {  // dns:SERVICE:PORT -> the loopback address of the pod it selects
      const m = /^dns:([^:]+):(\d+)$/.exec(spec);
      const svc = m && services.find((s) => s.metadata.name === m[1]);
      const p = svc && pods.find((x) => labelsMatch(svc.spec.selector, x.labels));
      return p && ports.get(p.name).has(Number(m[2])) ? `127.0.0.1:${ports.get(p.name).get(Number(m[2]))}` : spec;
    },
  };
  const notes = new Set();
  // A pod of an unknown image failed the static checks; nothing to start for it.
  const runs = pods.filter(tierOf).map((p) => ({ p, tier: tierOf(p)[1], flags: localFlags(p, ctx, notes) }));
  if (notes.size) note(`${overlay}: replaced on loopback: ${[...notes].join("; ")}`);

  for (const { flags } of runs) {  // the model the pods mount: a tiny generated one
    const model = flagValue(flags, "--model");
    if (model && !existsSync(join(model, "config.json"))) {
      await execFileP(preft, ["make-model", "--preset", "tiny", "--seed", "1", "--out", model], { timeout: 60000 });
    }
  }
  for (const r of runs) {
    r.log = join(work, `${r.p.name}.log`);
    const args = r.flags.map((f) => (f.value === undefined ? f.name : `${f.name}=${f.value}`));
    r.child = start(join(build, r.tier.binary), args, { ...process.env, ...r.p.vars, UCX_NET_DEVICES: "lo" }, r.log);
  }

  // Every probe the kubelet would run, on the port it names.
  for (const { p, child, log } of runs) {
    let up = true;
    for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const g = p.container[kind]?.grpc;
      const port = g && ports.get(p.name).get(g.port);
      if (!port) continue;  // the static checks said why
      const got = await waitServing(child, preft, port, g.service);
      up &&= check(got === "SERVING", `${overlay} ${p.name}: ${kind} (grpc port ${g.port}, service '${g.service ?? ""}'): ${got}\n    ${logTail(log)}`);
      if (child.exitCode === 2) check(false, `${overlay} ${p.name}: refused the manifest's flags: ${p.args.join(" ")}`);
      if (!up) break;
    }
    if (up) note(`${overlay} ${p.name}: runs with the manifest's flags; every probe SERVING`);
  }

  // What Prometheus scrapes, holding what the HPAs and prometheus-adapter use.
  for (const s of scrapes) {
    const port = ports.get(s.pod.name).get(s.containerPort);
    let res;
    try {
      res = await httpGet(port, s.path);
    } catch (e) {
      check(false, `${overlay} ${s.pod.name}: GET ${s.path} on metrics port ${s.containerPort}: ${e.message}`);
      continue;
    }
    check(res.status === 200 && res.type.startsWith("text/plain"), `${overlay} ${s.pod.name}: GET ${s.path}: ${res.status} ${res.type}`);
    const missing = [...required.get(s.pod.name)].filter((m) => !new RegExp(`^${m}[ {]`, "m").test(res.body));
    if (check(missing.length === 0, `${overlay} ${s.pod.name}: GET ${s.path} lacks ${missing.join(", ")}`)) {
      note(`${overlay} ${s.pod.name}: GET ${s.path} has ${[...required.get(s.pod.name)].join(", ") || "(none required)"}`);
    }
  }

  // One request through the router, which found its workers through the dns: specs.
  const router = runs.find((r) => r.p.image.endsWith("preft/router"));
  const routerPort = router && ports.get(router.p.name).get(addressPort(flagValue(router.p.flags, "--listen")));
  if (routerPort) {
    try {
      const { stdout } = await execFileP(preft, ["client", "--server", `127.0.0.1:${routerPort}`, "--timeout-s", "30",
        "generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos", "--json"], { timeout: 60000 });
      const tokens = JSON.parse(stdout).token_ids;
      if (check(tokens?.length === 4, `${overlay}: generate through the router: ${stdout.trim()}`)) {
        note(`${overlay}: a request through the router -> ${JSON.stringify(tokens)}`);
      }
    } catch (e) {
      check(false, `${overlay}: generate through the router failed: ${e.stderr || e.message}`);
    }
  }

  // SIGTERM as the kubelet sends it, router first: each drains and exits 0 within its grace.
  for (const { p, child, log } of [...runs].sort((a, b) => (b === router) - (a === router))) {
    if (child.exitCode !== null || child.signalCode !== null) continue;
    const graceS = p.spec.terminationGracePeriodSeconds ?? 30;
    child.kill("SIGTERM");  // `timeout` passes it on
    let timer;
    const code = await Promise.race([child.exited,
      new Promise((r) => (timer = setTimeout(r, graceS * 1000, "still running")))]);
    clearTimeout(timer);
    check(code === 0, `${overlay} ${p.name}: after SIGTERM: ${code} within ${graceS} s\n    ${logTail(log)}`);
  }
  killAll();
}
