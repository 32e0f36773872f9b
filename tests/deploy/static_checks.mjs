// Checks across a rendered overlay's objects that no schema can make: that Services,
// probes, the ServiceMonitor and the router's worker specs reach ports the binaries bind per
// their args, that HPAs ask for metrics prometheus-adapter serves, and the operational rules
// (drain before kill, sizes, read-only model, shared adapter root, non-root).

import { parse as parseYaml } from "yaml";
import { containerPort, flagValue, labelsMatch, parseQuantity } from "./pods.mjs";

// What each image runs. `health` is the service its readiness reports on (the transport
// self-check); `metrics` are named here as well as derived from the HPAs, so a series that
// goes missing from a binary fails even before an HPA uses it.
export const TIERS = {
  "preft/router": { binary: "services/router/preft-router", health: "", metrics: [] },
  "preft/prefill": {
    binary: "services/prefill/preft-prefill",
    health: "preft.worker.v1.PrefillWorker",
    metrics: ["preft:num_requests_waiting"],
  },
  "preft/decode": {
    binary: "services/decode/preft-decode",
    health: "preft.worker.v1.DecodeWorker",
    metrics: ["preft:kv_cache_usage_perc", "preft:num_requests_running"],
  },
};
export const tierOf = (pod) => Object.entries(TIERS).find(([image]) => pod.image.endsWith(image));

// After --drain-timeout-s the binaries give gRPC calls this long to end (rpc::Server::Shutdown).
const kShutdownGraceS = 5;
// Weights load before the server starts; a startup probe must wait at least this long.
const kMinStartupS = 300;

// prometheus-adapter rules -> [{series, exposed}] (one series per rule, as deploy/ writes them).
export function parseAdapterRules(configMap, check) {
  const rules = parseYaml(configMap.data?.["config.yaml"] ?? "")?.rules ?? [];
  const out = [];
  for (const r of rules) {
    const series = /^([a-zA-Z_:][a-zA-Z0-9_:]*)\{/.exec(r.seriesQuery ?? "")?.[1];
    if (!check(series, `adapter rule '${r.seriesQuery}': expected one series name before '{'`)) continue;
    const as = (r.name?.as ?? "").replace(/\$\{(\d+)\}/g, "$$$1");
    const exposed = r.name?.matches ? series.replace(new RegExp(r.name.matches), as) : series;
    check(/^[a-z0-9_.-]+$/.test(exposed), `adapter rule for ${series}: exposes '${exposed}', not a Kubernetes-safe name`);
    check(r.resources?.overrides?.pod?.resource === "pod" && r.resources?.overrides?.namespace?.resource === "namespace",
      `adapter rule for ${series}: needs namespace and pod overrides for Pods metrics`);
    check(["<<.Series>>", "<<.LabelMatchers>>"].every((t) => r.metricsQuery?.includes(t)),
      `adapter rule for ${series}: metricsQuery must use <<.Series>> and <<.LabelMatchers>>`);
    out.push({ series, exposed });
  }
  return out;
}

function checkPod(p, check) {
  const tier = tierOf(p)?.[1];
  if (!check(tier, `${p.name}: image ${p.image} is none of ${Object.keys(TIERS).join(", ")}`)) return;
  const c = p.container;
  check(labelsMatch(p.deployment.spec.selector.matchLabels, p.labels), `${p.name}: selector does not match the pod labels`);
  check(/:[^/]+$/.test(c.image) && !c.image.endsWith(":latest"), `${p.name}: image ${c.image} has no fixed tag`);
  const unresolved = p.args.filter((a) => /\$\([^)]*\)/.test(a));
  check(unresolved.length === 0, `${p.name}: unresolved variables in args: ${unresolved.join(" ")}`);
  // CLI11 reads "--flag=" as a flag without its value and takes the next argument instead.
  const empty = p.flags.filter((f) => f.value === "").map((f) => f.name);
  check(empty.length === 0, `${p.name}: empty values (a $(VAR) set to ""?) for ${empty.join(" ")}`);

  for (const port of c.ports ?? []) {
    check(p.listens.has(port.containerPort), `${p.name}: containerPort ${port.name ?? ""} ${port.containerPort} is bound by no --*listen flag`);
  }
  for (const [port, flag] of p.listens) {
    check(containerPort(c, port) !== undefined, `${p.name}: ${flag} binds ${port}, which is no declared containerPort`);
  }

  for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const probe = c[kind];
    if (!check(probe?.grpc, `${p.name}: no grpc ${kind}`)) continue;
    check(p.listens.get(probe.grpc.port) === "--listen", `${p.name}: ${kind} port ${probe.grpc.port} is not the --listen (gRPC) port`);
  }
  check(c.readinessProbe?.grpc?.service === (tier.health || undefined),
    `${p.name}: readiness should ask for service '${tier.health}' (got '${c.readinessProbe?.grpc?.service ?? ""}')`);
  const startup = c.startupProbe ?? {};
  const startupS = (startup.periodSeconds ?? 10) * (startup.failureThreshold ?? 3);
  check(startupS >= kMinStartupS, `${p.name}: startupProbe waits ${startupS} s, under ${kMinStartupS} s for loading weights`);

  const drainS = Number(flagValue(p.flags, "--drain-timeout-s") ?? 30);
  const graceS = p.spec.terminationGracePeriodSeconds ?? 30;
  check(graceS > drainS + kShutdownGraceS,
    `${p.name}: terminationGracePeriodSeconds ${graceS} must exceed --drain-timeout-s ${drainS} + ${kShutdownGraceS} s of shutdown`);

  for (const kind of ["requests", "limits"]) {
    for (const res of ["cpu", "memory"]) check(c.resources?.[kind]?.[res], `${p.name}: no ${kind}.${res}`);
  }
  const kvBytes = flagValue(p.flags, "--kv-bytes");
  if (kvBytes !== undefined && c.resources?.limits?.memory) {
    check(Number(kvBytes) < parseQuantity(c.resources.limits.memory), `${p.name}: --kv-bytes ${kvBytes} does not fit limits.memory ${c.resources.limits.memory}`);
  }
  // A pod given a GPU runs its forward there, and one running on a GPU asks for one.
  const gpus = Number(c.resources?.limits?.["nvidia.com/gpu"] ?? 0);
  const device = flagValue(p.flags, "--device") ?? "cpu";
  check((gpus > 0) === (device === "cuda"), `${p.name}: --device ${device} with ${gpus} nvidia.com/gpu`);
  // A model split over N GPUs (ranks on devices 0 .. N-1) needs the pod to hold N of them.
  const tp = Number(flagValue(p.flags, "--tensor-parallel") ?? 1);
  check(device !== "cuda" || tp === gpus, `${p.name}: --tensor-parallel ${tp} with ${gpus} nvidia.com/gpu`);
  check(p.spec.securityContext?.runAsNonRoot || c.securityContext?.runAsNonRoot, `${p.name}: not runAsNonRoot`);
  check(c.securityContext?.allowPrivilegeEscalation === false, `${p.name}: allowPrivilegeEscalation is not false`);
}

// The volume a path lies on: {mount, claim}, or undefined.
function volumeOf(p, path) {
  const mount = (p.container.volumeMounts ?? [])
    .filter((m) => path === m.mountPath || path?.startsWith(m.mountPath.replace(/\/?$/, "/")))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  const volume = mount && p.spec.volumes?.find((v) => v.name === mount.name);
  return mount && { mount, claim: volume?.persistentVolumeClaim?.claimName };
}

// The model is read-only everywhere; the adapter root is one volume, written by the router.
function checkVolumes(pods, check) {
  const claims = { "--model": new Set(), "--adapter-root": new Set() };
  for (const p of pods) {
    for (const flag of Object.keys(claims)) {
      const path = flagValue(p.flags, flag);
      if (path === undefined) continue;
      const v = volumeOf(p, path);
      if (!check(v?.claim, `${p.name}: ${flag} ${path} is on no PersistentVolumeClaim mount`)) continue;
      claims[flag].add(v.claim);
      const writes = flag === "--adapter-root" && p.image.endsWith("preft/router");
      check(Boolean(v.mount.readOnly) === !writes, `${p.name}: ${flag} mount ${v.mount.mountPath} should be ${writes ? "writable" : "readOnly"}`);
    }
  }
  for (const [flag, set] of Object.entries(claims)) {
    check(set.size === 1, `${flag}: every pod should use one shared volume (claims: ${[...set].join(", ") || "none"})`);
  }
}

// A Service port's pod and container port (the one bound per the args), or undefined.
function servicePort(svc, port, pods, check) {
  const selected = pods.filter((p) => labelsMatch(svc.spec.selector, p.labels));
  if (!check(selected.length === 1, `Service ${svc.metadata.name}: selects ${selected.length} Deployments, want 1`)) return undefined;
  const p = selected[0];
  const cp = containerPort(p.container, port.targetPort ?? port.port);
  if (!check(cp !== undefined && p.listens.has(cp), `Service ${svc.metadata.name} port ${port.name}: targetPort ${port.targetPort} is no port ${p.name} binds`)) return undefined;
  return { pod: p, containerPort: cp, flag: p.listens.get(cp) };
}

// The router finds workers through headless Services: the DNS answer is pod addresses, so
// the port in the spec must be the container's own.
function checkWorkerSpecs(pods, services, check) {
  for (const router of pods.filter((p) => p.image.endsWith("preft/router"))) {
    for (const [flag, image] of [["--prefill", "preft/prefill"], ["--decode", "preft/decode"]]) {
      for (const spec of (flagValue(router.flags, flag) ?? "").split(",").filter(Boolean)) {
        const m = /^dns:([^:]+):(\d+)$/.exec(spec);
        if (!check(m, `${router.name} ${flag} ${spec}: not dns:SERVICE:PORT (a fixed address does not follow pods)`)) continue;
        const svc = services.find((s) => s.metadata.name === m[1]);
        if (!check(svc, `${router.name} ${flag} ${spec}: no Service ${m[1]}`)) continue;
        check(svc.spec.clusterIP === "None", `${router.name} ${flag}: Service ${m[1]} is not headless`);
        const port = svc.spec.ports.find((x) => x.port === Number(m[2]));
        if (!check(port, `${router.name} ${flag} ${spec}: Service ${m[1]} has no port ${m[2]}`)) continue;
        const target = servicePort(svc, port, pods, check);
        if (!target) continue;
        check(target.containerPort === Number(m[2]) && target.flag === "--listen",
          `${router.name} ${flag} ${spec}: pods serve gRPC on ${target.containerPort} (${target.flag})`);
        check(target.pod.image.endsWith(image), `${router.name} ${flag} ${spec}: selects ${target.pod.name}, not ${image}`);
      }
    }
  }
}

// -> [{pod, containerPort, path}] that Prometheus scrapes.
function checkServiceMonitors(pods, objs, services, check) {
  const scrapes = [];
  for (const sm of objs.filter((o) => o.kind === "ServiceMonitor")) {
    const selected = services.filter((s) => labelsMatch(sm.spec.selector.matchLabels, s.metadata.labels));
    for (const ep of sm.spec.endpoints ?? []) {
      for (const svc of selected) {
        const port = svc.spec.ports.find((x) => x.name === ep.port);
        if (!check(port, `ServiceMonitor ${sm.metadata.name}: Service ${svc.metadata.name} has no port '${ep.port}'`)) continue;
        const target = servicePort(svc, port, pods, check);
        if (!target) continue;
        check(target.flag === "--metrics-listen", `ServiceMonitor ${sm.metadata.name}: ${svc.metadata.name}:${ep.port} is bound by ${target.flag}, not --metrics-listen`);
        scrapes.push({ pod: target.pod, containerPort: target.containerPort, path: ep.path ?? "/metrics" });
      }
    }
  }
  for (const p of pods) check(scrapes.some((s) => s.pod === p), `${p.name}: no ServiceMonitor scrapes it`);
  return scrapes;
}

// Adds the series each HPA needs to `required` (pod name -> Set).
function checkAutoscalers(pods, objs, rules, required, check) {
  for (const hpa of objs.filter((o) => o.kind === "HorizontalPodAutoscaler")) {
    const name = `HPA ${hpa.metadata.name}`;
    const ref = hpa.spec.scaleTargetRef;
    const p = pods.find((x) => ref.kind === "Deployment" && x.name === ref.name);
    if (!check(p, `${name}: no Deployment ${ref.name}`)) continue;
    check(p.deployment.spec.replicas === undefined, `${name}: Deployment ${p.name} sets replicas, which each apply resets under the HPA`);
    check((hpa.spec.minReplicas ?? 1) <= hpa.spec.maxReplicas, `${name}: minReplicas above maxReplicas`);
    for (const m of hpa.spec.metrics ?? []) {
      if (m.type === "Resource") continue;
      if (!check(m.type === "Pods", `${name}: metric type ${m.type} not checked here`)) continue;
      const rule = rules.find((r) => r.exposed === m.pods.metric.name);
      if (!check(rule, `${name}: prometheus-adapter serves no metric '${m.pods.metric.name}' (it serves ${rules.map((r) => r.exposed).join(", ")})`)) continue;
      required.get(p.name).add(rule.series);
    }
  }
}

function checkDisruptionBudgets(pods, objs, check) {
  const pdbs = objs.filter((o) => o.kind === "PodDisruptionBudget");
  for (const p of pods) {
    const mine = pdbs.filter((b) => labelsMatch(b.spec.selector?.matchLabels, p.labels));
    if (!check(mine.length === 1, `${p.name}: ${mine.length} PodDisruptionBudgets select it, want 1`)) continue;
    const fixed = p.deployment.spec.replicas;
    const min = mine[0].spec.minAvailable;
    check(fixed === undefined || typeof min !== "number" || min < fixed,
      `${p.name}: PodDisruptionBudget minAvailable ${min} with ${fixed} replicas blocks every node drain`);
  }
}

// Returns {required: pod name -> Set of series its /metrics must have, scrapes}.
export function staticChecks(pods, objs, rules, check) {
  const services = objs.filter((o) => o.kind === "Service");
  const required = new Map(pods.map((p) => [p.name, new Set(tierOf(p)?.[1].metrics ?? [])]));
  for (const p of pods) checkPod(p, check);
  for (const svc of services) for (const port of svc.spec.ports) servicePort(svc, port, pods, check);
  checkVolumes(pods, check);
  checkWorkerSpecs(pods, services, check);
  const scrapes = checkServiceMonitors(pods, objs, services, check);
  checkAutoscalers(pods, objs, rules, required, check);
  checkDisruptionBudgets(pods, objs, check);
  // Every rule's series is then fetched from a binary by the live checks.
  const wanted = new Set([...required.values()].flatMap((s) => [...s]));
  for (const r of rules) check(wanted.has(r.series), `adapter rule for ${r.series}: no tier is expected to export it`);
  return { required, scrapes };
}
