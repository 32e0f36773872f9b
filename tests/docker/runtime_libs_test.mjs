// `scripts/install-deps.sh --runtime` (the images' runtime stage) against what the built binaries
// really load: ldd on each binary, each resolved library mapped to its Debian package with
// dpkg -S, and each package must be in the --runtime list, unless debian:12-slim always has it.
// Binaries: PREFT_BINARIES, colon-separated (tests/docker/CMakeLists.txt passes the four).
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import test from 'node:test';

import { InstallDepsPackages } from './stages.mjs';

// In every debian:12-slim image (checked below against the Essential closure), so not listed.
const IN_DEBIAN_SLIM = ['libc6', 'libstdc++6', 'libgcc-s1', 'zlib1g', 'libpcre2-8-0'];
// CUDA libraries from NVIDIA's repository (no Debian package owns the local toolkit's files).
const CUDA_LIBRARY_PACKAGES = [
  [/^libcudart\.so/, 'cuda-cudart-13-0'],
  [/^libcublas(Lt)?\.so/, 'libcublas-13-0'],
];

const binaries = (process.env.PREFT_BINARIES || '').split(':').filter(Boolean);
// The images build without the trainer (PREFT_SKIP_TORCH=1), so what only libtorch pulls into
// a local `preft` (libtorch's own closure) is not theirs to ship. Libraries both need are still
// checked through the service binaries, which never link torch.
const trainerLibs = (process.env.PREFT_TRAINER_LIBS || '').split(':').filter(Boolean);
function TrainerClosure() {
  const sonames = new Set();
  for (const lib of trainerLibs) {
    sonames.add(path.basename(lib));
    sonames.add(path.basename(fs.realpathSync(lib)));
    for (const line of execFileSync('ldd', [lib], { encoding: 'utf8' }).split('\n')) {
      const m = /^\s*(\S+) => \//.exec(line);
      if (m) sonames.add(path.basename(m[1]));
    }
  }
  return sonames;
}

// {binary, soname, file} for each library ldd resolves; a library it cannot find fails.
function Loaded() {
  const loaded = [];
  const trainerOnly = TrainerClosure();
  const core = new Set();  // sonames the binaries without torch load
  for (const binary of binaries) {
    if (path.basename(binary) === 'preft') continue;
    for (const line of execFileSync('ldd', [binary], { encoding: 'utf8' }).split('\n')) {
      const m = /^\s*(\S+) => \//.exec(line);
      if (m) core.add(path.basename(m[1]));
    }
  }
  for (const binary of binaries) {
    const out = execFileSync('ldd', [binary], { encoding: 'utf8' });
    for (const line of out.split('\n')) {
      const missing = /^\s*(\S+) => not found/.exec(line);
      assert.ok(!missing, `${binary} needs ${missing?.[1]}, which ldd cannot find`);
      const m = /^\s*(\S+) => (\/\S+) \(/.exec(line) || /^\s*(\/\S+) \(/.exec(line);
      if (!m) continue;
      const soname = path.basename(m[1]);
      if (path.basename(binary) === 'preft' && trainerOnly.has(soname) && !core.has(soname)) continue;
      loaded.push({ binary: path.basename(binary), soname, file: m[2] || m[1] });
    }
  }
  return loaded;
}

// The paths dpkg may know a library by: as ldd gave it, resolved, each with and without /usr
// (Debian 12 merges /lib into /usr/lib; dpkg records the path the package shipped).
function Candidates(file) {
  const paths = new Set([file, fs.realpathSync(file)]);
  for (const p of [...paths]) paths.add(p.startsWith('/usr/') ? p.slice(4) : `/usr${p}`);
  return [...paths];
}

// One dpkg -S for all paths: Map path -> package (architecture qualifier dropped).
function Owners(paths) {
  const out = spawnSync('dpkg', ['-S', ...paths], { encoding: 'utf8' }).stdout;
  const owners = new Map();
  for (const line of out.split('\n')) {
    // "libc6:amd64: /lib/x86_64-linux-gnu/libc.so.6" (several packages: "a:amd64, a:i386: /p")
    const at = line.indexOf(': /');
    if (at < 0 || line.startsWith('diversion by')) continue;
    owners.set(line.slice(at + 2), line.slice(0, at).split(',')[0].trim().replace(/:\w+$/, ''));
  }
  return owners;
}

// Packages every Debian 12 system has: the Essential ones, apt, and what they depend on
// without alternatives (debian:12-slim is exactly a minimal base of these).
function AlwaysInstalled() {
  const out = execFileSync('dpkg-query', ['-W', '-f=${Package}\t${Essential}\t${Pre-Depends}\t${Depends}\n'],
                           { encoding: 'utf8' });
  const deps = new Map();
  const todo = ['apt'];
  for (const line of out.trim().split('\n')) {
    const [pkg, essential, pre, dep] = line.split('\t');
    deps.set(pkg, `${pre},${dep}`.split(',').map((d) => d.trim()).filter((d) => d && !d.includes('|'))
        .map((d) => d.replace(/\(.*\)/, '').replace(/:\w+/, '').trim()));
    if (essential === 'yes') todo.push(pkg);
  }
  const seen = new Set();
  while (todo.length > 0) {
    const p = todo.pop();
    if (seen.has(p)) continue;
    seen.add(p);
    todo.push(...(deps.get(p) || []));
  }
  return seen;
}

test('the binaries are given and exist', () => {
  assert.ok(binaries.length >= 4, 'PREFT_BINARIES should name preft-router, preft-prefill, preft-decode and preft');
  for (const b of binaries) assert.ok(fs.existsSync(b), `${b} is not built`);
});

test('install-deps.sh --runtime names every package whose libraries the binaries load', () => {
  const runtime = new Set(InstallDepsPackages('--runtime'));
  const cuda = new Set(InstallDepsPackages('--runtime', '--cuda'));
  const loaded = Loaded();
  const owners = Owners([...new Set(loaded.flatMap((l) => Candidates(l.file)))]);
  const needed = new Map();  // package -> {libs, binaries}
  const unowned = [];
  for (const l of loaded) {
    let owner = Candidates(l.file).map((p) => owners.get(p)).find(Boolean);
    if (!owner && /\/cuda[-\d.]*\//.test(fs.realpathSync(l.file))) {
      owner = CUDA_LIBRARY_PACKAGES.find(([re]) => re.test(l.soname))?.[1];
    }
    if (!owner) {
      unowned.push(`${l.binary} loads ${l.file}, which no Debian package (nor a known CUDA package) ships`);
      continue;
    }
    if (!needed.has(owner)) needed.set(owner, { libs: new Set(), binaries: new Set() });
    needed.get(owner).libs.add(l.soname);
    needed.get(owner).binaries.add(l.binary);
  }
  assert.equal(unowned.length, 0, unowned.join('\n'));
  const nvidia = new Set(CUDA_LIBRARY_PACKAGES.map(([, p]) => p));
  const missing = [];
  for (const [p, why] of needed) {
    if (IN_DEBIAN_SLIM.includes(p)) continue;
    const [list, options] = nvidia.has(p) ? [cuda, '--runtime --cuda'] : [runtime, '--runtime'];
    if (!list.has(p)) {
      missing.push(`scripts/install-deps.sh ${options} lacks ${p} (${[...why.libs].join(', ')}; ` +
                   `loaded by ${[...why.binaries].join(', ')})`);
    }
  }
  assert.equal(missing.length, 0, missing.join('\n'));
  // And nothing listed that no binary loads: the list is measured, not guessed.
  const unused = [...runtime].filter((p) => !needed.has(p));
  assert.equal(unused.length, 0, `scripts/install-deps.sh --runtime lists ${unused.join(', ')}, which no binary loads`);
});

test(`${IN_DEBIAN_SLIM.join(', ')} are in every Debian 12 image`, () => {
  const always = AlwaysInstalled();
  for (const p of IN_DEBIAN_SLIM) assert.ok(always.has(p), `${p} is not in the Essential closure: list it in install-deps.sh --runtime`);
});

test('install-deps.sh --runtime lists no -dev package and no compiler', () => {
  for (const options of [['--runtime'], ['--runtime', '--cuda']]) {
    for (const p of InstallDepsPackages(...options)) {
      assert.doesNotMatch(p, /-dev($|-)|^(build-essential|gcc|g\+\+|clang|cmake|ninja-build|cuda-nvcc)/,
                          `install-deps.sh ${options.join(' ')} lists ${p}`);
    }
  }
});
