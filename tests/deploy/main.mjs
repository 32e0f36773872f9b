// deploy_manifests: renders deploy/kustomize's overlays with `kubectl kustomize`, validates
// every object offline against the Kubernetes API schemas, checks the objects against each
// other, then starts the real binaries with each overlay's args and checks that they serve
// what the probes, Services, ServiceMonitor and HPAs expect.
//   node main.mjs SOURCE_DIR BUILD_DIR WORK_DIR     (run.sh checks the tools first)

import { execFileSync } from "node:child_process";
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments } from "yaml";
import { describePods } from "./pods.mjs";
import { checkFields, validateSchemas } from "./schema.mjs";
import { parseAdapterRules, staticChecks } from "./static_checks.mjs";
import { killAll, liveChecks } from "./live_checks.mjs";

const OVERLAYS = ["cpu", "gpu"];
const kDeadlineS = 240;  // below ctest's TIMEOUT, so children are killed by us, not orphaned

const [source, build, work] = process.argv.slice(2);
let passed = 0;
let failed = 0;
function check(ok, message) {
  if (ok) {
    passed++;
  } else {
    failed++;
    console.log(`FAIL: ${message}`);
  }
  return Boolean(ok);
}
const note = (message) => console.log(`ok: ${message}`);

function render(dir) {
  const out = execFileSync("kubectl", ["kustomize", dir], { encoding: "utf8", timeout: 60000, stdio: ["ignore", "pipe", "pipe"] });
  return parseAllDocuments(out).map((d) => {
    if (d.errors.length) throw new Error(d.errors[0].message);
    return d.toJS();
  }).filter(Boolean);
}

// The downward API's answers in the cluster and on this machine's loopback.
const fields = (podIP) => ({
  "status.podIP": podIP, "metadata.name": "pod", "metadata.namespace": "preft", "spec.nodeName": "node",
});

async function main() {
  rmSync(work, { recursive: true, force: true });
  mkdirSync(work, { recursive: true });
  const kustomize = join(source, "deploy/kustomize");
  const rendered = {};
  for (const name of [...OVERLAYS, "prometheus-adapter"]) {
    const dir = join(kustomize, name === "prometheus-adapter" ? name : `overlays/${name}`);
    try {
      rendered[name] = render(dir);
      note(`${name}: kubectl kustomize rendered ${rendered[name].length} objects`);
    } catch (e) {
      check(false, `kubectl kustomize ${dir}: ${e.stderr || e.message}`);
    }
  }

  const failedBefore = failed;
  const named = [];
  for (const [name, objs] of Object.entries(rendered)) {
    for (const p of await validateSchemas(objs)) check(false, `${name}: ${p}`);
    named.push(...objs.map((obj) => ({ name: `${name} ${obj.kind}/${obj.metadata?.name}`, obj })));
  }
  for (const p of await checkFields(named, join(work, "types"))) check(false, `unknown or mistyped field: ${p}`);
  if (failed === failedBefore) note(`${named.length} objects valid against the API schemas and types`);

  const adapterConfig = rendered["prometheus-adapter"]?.find((o) => o.kind === "ConfigMap");
  const rules = check(adapterConfig, "prometheus-adapter: no rules ConfigMap") ? parseAdapterRules(adapterConfig, check) : [];

  for (const overlay of OVERLAYS) {
    const objs = rendered[overlay];
    if (!objs) continue;
    let pods, localPods;
    try {
      pods = describePods(objs, fields("10.0.0.10"));
      localPods = describePods(objs, fields("127.0.0.1"));
    } catch (e) {
      check(false, `${overlay}: ${e.message}`);
      continue;
    }
    const failedBeforeOverlay = failed;
    const { required, scrapes } = staticChecks(pods, objs, rules, (ok, m) => check(ok, `${overlay}: ${m}`));
    if (failed === failedBeforeOverlay) note(`${overlay}: ports, probes, Services, ServiceMonitor, HPAs, PDBs, volumes agree`);
    // The live run reads the same pods' loopback twins.
    const local = (p) => localPods.find((x) => x.name === p.name);
    await liveChecks({
      overlay, objs, pods: localPods, build, work: join(work, overlay), check, note,
      required,
      scrapes: scrapes.map((s) => ({ ...s, pod: local(s.pod) })),
    });
  }
}

const watchdog = setTimeout(() => {
  check(false, `still running after ${kDeadlineS} s`);
  killAll();
  process.exit(1);
}, kDeadlineS * 1000);
for (const sig of ["SIGINT", "SIGTERM"]) process.on(sig, () => { killAll(); process.exit(1); });
process.on("exit", killAll);

try {
  await main();
} catch (e) {
  check(false, e.stack ?? String(e));
}
clearTimeout(watchdog);
killAll();
console.log(`deploy: ${passed} passed, ${failed} failed`);
process.exitCode = failed ? 1 : 0;
