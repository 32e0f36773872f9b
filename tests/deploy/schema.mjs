// Offline validation of rendered objects against the Kubernetes API. kubernetes-models holds
// the API's OpenAPI schemas compiled to validators (prometheus-operator's CRDs in its own
// package); they check types, required fields and enums but let unknown fields through, which
// the API server would refuse (kubectl apply validates strictly) or drop: a misspelt
// `readinesProbe` would pass unnoticed. So each object is also type-checked by TypeScript
// against the same packages' types, whose excess-property check refuses unknown fields.

import { execFile } from "node:child_process";
import { mkdirSync, symlinkSync, writeFileSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const here = dirname(fileURLToPath(import.meta.url));

// The module of an apiVersion/kind: kubernetes-models/<group>/<version>/<Kind>, or the
// package of a custom resource's operator.
function modulePath({ apiVersion, kind }) {
  const crds = { "monitoring.coreos.com": "@kubernetes-models/prometheus-operator" };
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (crds[group]) return `${crds[group]}/${group}/${version}/${kind}`;
  return `kubernetes-models/${group ? group + "/" : ""}${version}/${kind}`;
}

const label = (o) => `${o.kind}/${o.metadata?.name}`;

// Returns one message per invalid object (empty: all valid).
export async function validateSchemas(objs) {
  const problems = [];
  for (const o of objs) {
    let model;
    try {
      model = (await import(modulePath(o)))[o.kind];
    } catch {
      problems.push(`${label(o)}: no schema for ${o.apiVersion} ${o.kind}`);
      continue;
    }
    try {
      new model(o).validate();
    } catch (e) {
      problems.push(`${label(o)}: ${e.message}`);
    }
  }
  return problems;
}

// Type-checks every object in one tsc run (a few seconds). `objs` are {name, obj} with a
// name for messages; returns messages naming the object and the offending line.
export async function checkFields(objs, workDir) {
  mkdirSync(workDir, { recursive: true });
  // tsc resolves the packages from the file's folder upwards.
  if (!existsSync(join(workDir, "node_modules"))) symlinkSync(join(here, "node_modules"), join(workDir, "node_modules"));
  const lines = [];
  const starts = [];  // [first line, name] per object
  objs.forEach(({ obj }, i) => lines.push(`import type { I${obj.kind} as T${i} } from "${modulePath(obj)}";`));
  objs.forEach(({ name, obj }, i) => {
    starts.push([lines.length + 1, name]);
    lines.push(...`export const o${i}: T${i} = ${JSON.stringify(obj, null, 2)};`.split("\n"));
  });
  const file = join(workDir, "objects.mts");
  writeFileSync(file, lines.join("\n") + "\n");
  const tsc = join(here, "node_modules", "typescript", "bin", "tsc");
  try {
    await promisify(execFile)(process.execPath, [tsc, "--noEmit", "--strict", "--skipLibCheck",
      "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2022", file],
      { timeout: 120000 });
    return [];
  } catch (e) {
    const out = `${e.stdout ?? ""}${e.stderr ?? ""}`;
    const problems = [];
    for (const m of out.matchAll(/objects\.mts\((\d+),\d+\): error (TS\d+: .*)/g)) {
      const line = Number(m[1]);
      const owner = starts.filter(([start]) => start <= line).pop();
      problems.push(`${owner ? owner[1] : "?"}: ${m[2]} (at: ${lines[line - 1].trim()})`);
    }
    return problems.length ? problems : [`tsc failed: ${out || e.message}`];
  }
}
