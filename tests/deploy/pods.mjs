// What a rendered Deployment's container would run, worked out as the kubelet does: its
// environment (ConfigMaps, the downward API), its args after $(VAR) expansion, and which of
// its ports the binary binds through a --*listen flag.

// Kubernetes quantities ("500m", "8", "16Gi", "2G") as numbers of cores or bytes.
export function parseQuantity(q) {
  const m = /^([0-9.]+)(m|k|Ki|M|Mi|G|Gi|T|Ti)?$/.exec(String(q));
  if (!m) throw new Error(`not a quantity: ${q}`);
  const scale = { m: 1e-3, k: 1e3, Ki: 2 ** 10, M: 1e6, Mi: 2 ** 20, G: 1e9, Gi: 2 ** 30,
                  T: 1e12, Ti: 2 ** 40 }[m[2]] ?? 1;
  return Number(m[1]) * scale;
}

// $(VAR) expansion of command, args and env values: $$ is a literal $, an undefined
// variable stays as written.
export function expand(s, vars) {
  let out = "";
  for (let i = 0; i < s.length; ) {
    if (s.startsWith("$$", i)) {
      out += "$";
      i += 2;
    } else if (s.startsWith("$(", i) && s.indexOf(")", i) > 0) {
      const end = s.indexOf(")", i);
      const name = s.slice(i + 2, end);
      out += name in vars ? vars[name] : s.slice(i, end + 1);
      i = end + 1;
    } else {
      out += s[i++];
    }
  }
  return out;
}

// The container's environment: envFrom first, then env in order (each may use the ones
// before it). `fields` answers fieldRef paths (status.podIP differs between the cluster and
// this test). Throws on a reference the kubelet would refuse.
export function resolveEnv(container, configMaps, fields) {
  const vars = {};
  const configMap = (name) => {
    const cm = configMaps.find((c) => c.metadata.name === name);
    if (!cm) throw new Error(`container ${container.name}: no ConfigMap ${name}`);
    return cm.data ?? {};
  };
  for (const from of container.envFrom ?? []) {
    if (!from.configMapRef) throw new Error(`container ${container.name}: envFrom other than configMapRef`);
    for (const [k, v] of Object.entries(configMap(from.configMapRef.name))) {
      vars[(from.prefix ?? "") + k] = v;
    }
  }
  for (const e of container.env ?? []) {
    const src = e.valueFrom;
    if (!src) {
      vars[e.name] = expand(e.value ?? "", vars);
    } else if (src.configMapKeyRef) {
      const data = configMap(src.configMapKeyRef.name);
      if (!(src.configMapKeyRef.key in data)) throw new Error(`env ${e.name}: no key ${src.configMapKeyRef.key}`);
      vars[e.name] = data[src.configMapKeyRef.key];
    } else if (src.fieldRef) {
      if (!(src.fieldRef.fieldPath in fields)) throw new Error(`env ${e.name}: fieldRef ${src.fieldRef.fieldPath} not handled here`);
      vars[e.name] = fields[src.fieldRef.fieldPath];
    } else if (src.resourceFieldRef) {
      const [kind, res] = src.resourceFieldRef.resource.split(".");
      const q = container.resources?.[kind]?.[res];
      // Without it the kubelet answers the node's allocatable: never what a pod was sized for.
      if (q === undefined) throw new Error(`env ${e.name}: ${src.resourceFieldRef.resource} is not set`);
      const divisor = parseQuantity(src.resourceFieldRef.divisor ?? "1");
      vars[e.name] = String(Math.ceil(parseQuantity(q) / divisor));
    } else {
      throw new Error(`env ${e.name}: valueFrom not handled here`);
    }
  }
  return vars;
}

// Args as [{name, value}]: "--flag=value", "--flag value", or a lone "--flag".
export function parseFlags(args) {
  const flags = [];
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (!a.startsWith("--")) throw new Error(`argument '${a}' is not a --flag`);
    const eq = a.indexOf("=");
    if (eq > 0) {
      flags.push({ name: a.slice(0, eq), value: a.slice(eq + 1) });
    } else if (i + 1 < args.length && !args[i + 1].startsWith("--")) {
      flags.push({ name: a, value: args[++i] });
    } else {
      flags.push({ name: a, value: undefined });
    }
  }
  return flags;
}

export const flagValue = (flags, name) => flags.find((f) => f.name === name)?.value;

// host:port -> port (a number), or undefined.
export function addressPort(value) {
  const m = /^(\[[^\]]*\]|[^:]+):(\d+)$/.exec(value ?? "");
  return m ? Number(m[2]) : undefined;
}

// A container port named or numbered by `ref` (probes, Service targetPort), or undefined.
export function containerPort(container, ref) {
  const p = (container.ports ?? []).find((x) => x.name === ref || x.containerPort === ref);
  return p?.containerPort;
}

export function labelsMatch(selector, labels) {
  return Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);
}

// One entry per Deployment (its first container is the binary), with everything the checks
// need. `fields` answers the downward API's fieldRefs.
export function describePods(objs, fields) {
  const configMaps = objs.filter((o) => o.kind === "ConfigMap");
  return objs.filter((o) => o.kind === "Deployment").map((d) => {
    const spec = d.spec.template.spec;
    const c = spec.containers[0];
    const vars = resolveEnv(c, configMaps, fields);
    const args = (c.args ?? []).map((a) => expand(a, vars));
    const flags = parseFlags(args);
    const listens = new Map();  // port -> the flag binding it
    for (const f of flags) {
      if (f.name.endsWith("listen") && addressPort(f.value) !== undefined) listens.set(addressPort(f.value), f.name);
    }
    return {
      name: d.metadata.name,
      deployment: d,
      spec,
      container: c,
      image: c.image.replace(/@.*$/, "").replace(/:[^/]*$/, ""),  // without tag or digest
      vars,
      args,
      flags,
      listens,
      labels: d.spec.template.metadata?.labels ?? {},
    };
  });
}
