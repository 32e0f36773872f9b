// A Dockerfile as its build stages, from dockerfile-ast's parse (a real Dockerfile parser, the
// one behind the Docker language server). Shared by dockerfile_test.mjs and
// runtime_libs_test.mjs.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

let ast, utils;
try {
  ast = await import('dockerfile-ast');
  utils = await import('dockerfile-utils');
} catch (e) {
  throw new Error(`tests/docker needs its npm packages: run scripts/install-deps.sh ` +
                  `(npm ci in tests/docker). ${e.message}`);
}

export const SOURCE_DIR = process.env.PREFT_SOURCE_DIR ||
    path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');

export function ReadSource(rel) {
  return fs.readFileSync(path.join(SOURCE_DIR, rel), 'utf8');
}

// dockerfile-utils' validator: Diagnostic[] (severity 1 error, 2 warning).
export function Lint(text) {
  return utils.validate(text);
}

// Stages in order: {name, from, image, tag, digest, parent, instructions}. `parent` is the
// earlier stage a FROM names, or null for an image from a registry.
export function ParseStages(text) {
  const dockerfile = ast.DockerfileParser.parse(text);
  const stages = [];
  for (const ins of dockerfile.getInstructions()) {
    if (ins.getKeyword() === 'FROM') {
      const image = ins.getImageName();
      const parent = stages.find((s) => s.name === (image || '').toLowerCase()) || null;
      stages.push({
        name: (ins.getBuildStage() || '').toLowerCase(),
        from: ins,
        line: ins.getRange().start.line + 1,
        image,
        tag: ins.getImageTag(),
        digest: ins.getImageDigest(),
        parent,
        instructions: [],
      });
    } else if (stages.length > 0) {
      stages[stages.length - 1].instructions.push(ins);
    }
  }
  return stages;
}

// The stage and its ancestors, root first: what a target inherits.
export function Chain(stage) {
  const chain = [];
  for (let s = stage; s; s = s.parent) chain.unshift(s);
  return chain;
}

export function Inherited(stage, keyword) {
  return Chain(stage).flatMap((s) => s.instructions.filter((i) => i.getKeyword() === keyword));
}

export function Words(ins) {
  return ins.getArguments().map((a) => a.getValue());
}

// Every call of scripts/install-deps.sh in a stage's RUN lines: {env, options} where env holds
// the NAME=value words before it and options the words after it up to the next && or ;.
export function InstallDepsCalls(stage) {
  const calls = [];
  for (const run of stage.instructions.filter((i) => i.getKeyword() === 'RUN')) {
    const words = Words(run);
    words.forEach((w, i) => {
      if (!/(^|\/)install-deps\.sh$/.test(w)) return;
      let start = i;
      while (start > 0 && !['&&', ';', '||'].includes(words[start - 1])) start--;
      // Run, not named: only NAME=value words and bash/sh may come before it (`rm x.sh` is no call).
      const before = words.slice(start, i);
      if (!before.every((x) => /^[A-Z_]+=/.test(x) || x === 'bash' || x === 'sh')) return;
      let end = i + 1;
      while (end < words.length && !['&&', ';', '||'].includes(words[end])) end++;
      calls.push({
        script: w,
        env: before.filter((x) => /^[A-Z_]+=/.test(x)),
        options: words.slice(i + 1, end),
      });
    });
  }
  return calls;
}

// `scripts/install-deps.sh OPTIONS --print`: the package names it would install.
export function InstallDepsPackages(...options) {
  const out = execFileSync('bash', [path.join(SOURCE_DIR, 'scripts/install-deps.sh'), ...options,
                                    '--print'],
                           { encoding: 'utf8', env: { ...process.env, PREFT_SKIP_TORCH: '1' } });
  return out.split('\n').map((s) => s.trim()).filter(Boolean);
}

export const DOCKERFILES = [
  { file: 'docker/Dockerfile', cuda: false },
  { file: 'docker/Dockerfile.cuda', cuda: true },
];
