// docker/Dockerfile and docker/Dockerfile.cuda, parsed and linted (no Docker engine needed):
// pinned bases, the build and runtime stages built from scripts/install-deps.sh, one non-root
// exec-form target per service naming a binary CMake builds, COPY sources that exist, the ports.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import test from 'node:test';

import {
  Chain, DOCKERFILES, Inherited, InstallDepsCalls, Lint, ParseStages, ReadSource, SOURCE_DIR,
  Words,
} from './stages.mjs';

// The Kubernetes manifests and docker/README.md use these names and ports.
const TARGETS = {
  router: { binary: 'preft-router', dir: 'services/router', ports: ['50051', '9400'] },
  prefill: { binary: 'preft-prefill', dir: 'services/prefill', ports: ['50061', '9400'] },
  decode: { binary: 'preft-decode', dir: 'services/decode', ports: ['50071', '9400'] },
  tools: { binary: 'preft', dir: 'tools', ports: [] },
};
const OCI_LABELS = ['org.opencontainers.image.title', 'org.opencontainers.image.description',
                    'org.opencontainers.image.version', 'org.opencontainers.image.revision'];

function Stage(stages, name, file) {
  const stage = stages.find((s) => s.name === name);
  assert.ok(stage, `${file}: no stage named '${name}'`);
  return stage;
}

function Where(file, ins) {
  return `${file}:${ins.getRange().start.line + 1}`;
}

// The build tree the build stage's `cmake -S . -B DIR` writes, as an absolute path.
function BuildTree(build, file) {
  const workdirs = build.instructions.filter((i) => i.getKeyword() === 'WORKDIR');
  assert.ok(workdirs.length > 0, `${file}: the build stage sets no WORKDIR`);
  const workdir = Words(workdirs[workdirs.length - 1])[0];
  for (const run of build.instructions.filter((i) => i.getKeyword() === 'RUN')) {
    const words = Words(run);
    const b = words.indexOf('-B');
    if (words[0] === 'cmake' && b >= 0) return path.posix.join(workdir, words[b + 1]);
  }
  assert.fail(`${file}: the build stage never runs 'cmake -S . -B DIR'`);
}

function CmakeExecutables(dir) {
  const text = ReadSource(path.join(dir, 'CMakeLists.txt'));
  return [...text.matchAll(/add_executable\(\s*([\w.+-]+)/g)].map((m) => m[1]);
}

// .dockerignore as Docker reads it: patterns relative to the context root, `*` within a path
// element, `**` across them, `!` re-includes; a folder's exclusion covers what is under it.
function DockerIgnored(rel) {
  const rules = ReadSource('.dockerignore').split('\n').map((l) => l.trim())
      .filter((l) => l && !l.startsWith('#'));
  let ignored = false;
  for (const rule of rules) {
    const negate = rule.startsWith('!');
    const pattern = path.posix.normalize((negate ? rule.slice(1) : rule).replace(/^\/+/, ''));
    const re = new RegExp('^' + pattern.split('/').map((part) => part === '**' ? '.*' :
        part.replace(/[.+^${}()|[\]\\]/g, '\\$&').replace(/\*/g, '[^/]*').replace(/\?/g, '[^/]'))
        .join('/').replace(/\.\*\//g, '(.*/)?') + '(/.*)?$');
    if (re.test(rel)) ignored = !negate;
  }
  return ignored;
}

test('the linter finds errors at all (so a clean result means something)', () => {
  const diagnostics = Lint('FROM\nEXPOSE port\nENTRYPOINT [\'x\']\nCOPY --frm=a b c\n');
  assert.ok(diagnostics.length >= 3, JSON.stringify(diagnostics));
  assert.ok(DockerIgnored('build/services/x') && DockerIgnored('models/a') &&
            DockerIgnored('tests/docker/node_modules/x') && DockerIgnored('.git'));
  assert.ok(!DockerIgnored('services/router/main.cc') && !DockerIgnored('scripts/install-deps.sh'));
});

test('.dockerignore leaves out build trees, models, node_modules and .git', () => {
  for (const rel of ['build', 'build-fuzz', 'models', 'node_modules', 'tests/x/node_modules', '.git']) {
    assert.ok(DockerIgnored(rel), `.dockerignore does not exclude ${rel}`);
  }
});

for (const { file, cuda } of DOCKERFILES) {
  const text = ReadSource(file);
  const stages = ParseStages(text);

  test(`${file}: no parser or linter diagnostics`, () => {
    const diagnostics = Lint(text).map((d) => `${file}:${d.range.start.line + 1}: ${d.message}`);
    assert.deepEqual(diagnostics, []);
  });

  test(`${file}: every base image is pinned Debian 12 (no latest, no floating tag)`, () => {
    for (const s of stages.filter((x) => !x.parent)) {
      const where = `${file}:${s.line}`;
      assert.ok(s.digest || s.tag, `${where}: FROM ${s.image} has no tag (latest)`);
      if (s.tag) {
        assert.notEqual(s.tag, 'latest', `${where}: FROM ${s.image}:latest`);
        // debian:12.11-slim, not debian:12-slim or bookworm: a point release.
        assert.match(s.tag, /^12\.\d+(-slim)?$/, `${where}: ${s.image}:${s.tag} is not a pinned Debian 12 point release`);
      }
      assert.equal(s.image, 'debian', `${where}: the install script's package names are Debian 12's`);
    }
  });

  test(`${file}: ENTRYPOINT and CMD are exec form`, () => {
    for (const s of stages) {
      for (const ins of s.instructions.filter((i) => ['ENTRYPOINT', 'CMD'].includes(i.getKeyword()))) {
        assert.ok(ins.getOpeningBracket() && ins.getJSONStrings().length > 0,
                  `${Where(file, ins)}: ${ins.getKeyword()} is shell form`);
      }
    }
  });

  test(`${file}: the build stage runs install-deps.sh, then a Release Ninja build without tests`, () => {
    const build = Stage(stages, 'build', file);
    const calls = InstallDepsCalls(build);
    assert.equal(calls.length, 1, `${file}: the build stage should run scripts/install-deps.sh once`);
    assert.equal(calls[0].script, 'scripts/install-deps.sh');
    assert.deepEqual(calls[0].options, cuda ? ['--cuda'] : [], `${file}: build stage install-deps.sh options`);
    assert.ok(calls[0].env.includes('PREFT_SKIP_TORCH=1'), `${file}: the build stage should set PREFT_SKIP_TORCH=1`);
    const runs = build.instructions.filter((i) => i.getKeyword() === 'RUN').map(Words);
    const configure = runs.find((w) => w[0] === 'cmake' && w.includes('-S'));
    assert.ok(configure, `${file}: the build stage never configures with cmake`);
    for (const flag of ['-DCMAKE_BUILD_TYPE=Release', '-DPREFT_BUILD_TESTS=OFF',
                        `-DPREFT_ENABLE_CUDA=${cuda ? 'ON' : 'OFF'}`]) {
      assert.ok(configure.includes(flag), `${file}: cmake configure lacks ${flag}`);
    }
    assert.equal(configure[configure.indexOf('-G') + 1], 'Ninja', `${file}: configure is not -G Ninja`);
    assert.ok(configure.includes('--build'), `${file}: the build stage never runs cmake --build`);
  });

  test(`${file}: the build stage copies every folder the top CMakeLists.txt adds`, () => {
    const build = Stage(stages, 'build', file);
    const copied = build.instructions.filter((i) => i.getKeyword() === 'COPY').flatMap((i) => Words(i).slice(0, -1));
    const dirs = [...ReadSource('CMakeLists.txt').matchAll(/add_subdirectory\((\w+)\)/g)].map((m) => m[1])
        .filter((d) => d !== 'tests');
    for (const need of ['CMakeLists.txt', ...dirs]) {
      assert.ok(copied.includes(need), `${file}: the build stage does not COPY ${need}, which CMake configures`);
    }
  });

  test(`${file}: the runtime stage installs with install-deps.sh --runtime and a non-root user`, () => {
    const runtime = Stage(stages, 'runtime', file);
    const calls = InstallDepsCalls(runtime);
    assert.equal(calls.length, 1, `${file}: the runtime stage should run install-deps.sh once`);
    assert.deepEqual([...calls[0].options].sort(), cuda ? ['--cuda', '--runtime'] : ['--runtime'],
                     `${file}: runtime stage install-deps.sh options`);
    assert.ok(Inherited(runtime, 'USER').length > 0, `${file}: the runtime stage sets no USER`);
  });

  test(`${file}: packages come only from install-deps.sh`, () => {
    for (const s of stages) {
      for (const run of s.instructions.filter((i) => i.getKeyword() === 'RUN')) {
        const words = Words(run);
        const install = words.findIndex((w, i) => ['apt-get', 'apt'].includes(w) && words[i + 1] === 'install');
        if (install < 0) continue;
        let end = install + 2;
        while (end < words.length && !['&&', ';'].includes(words[end])) end++;
        const packages = words.slice(install + 2, end).filter((w) => !w.startsWith('-'));
        // The one exception: apt needs CA certificates before NVIDIA's https repository is added.
        assert.deepEqual(packages, ['ca-certificates'], `${Where(file, run)}: apt-get install outside install-deps.sh`);
      }
    }
  });

  test(`${file}: every COPY source exists in the repository or comes from a named stage`, () => {
    const build = Stage(stages, 'build', file);
    const tree = BuildTree(build, file);
    // `cmake --build DIR --target a b c`: the words after --target up to the next option.
    const buildTargets = [];
    for (const w of build.instructions.filter((i) => i.getKeyword() === 'RUN').map(Words)) {
      for (let i = w.indexOf('--target') + 1; i > 0 && i < w.length && !/^(-|&&|;)/.test(w[i]); i++) {
        buildTargets.push(w[i]);
      }
    }
    stages.forEach((s, index) => {
      for (const copy of s.instructions.filter((i) => i.getKeyword() === 'COPY')) {
        const from = copy.getFromFlag();
        const sources = Words(copy).slice(0, -1);
        assert.ok(sources.length > 0, `${Where(file, copy)}: COPY without a source`);
        if (!from) {
          for (const src of sources) {
            assert.ok(fs.existsSync(path.join(SOURCE_DIR, src)), `${Where(file, copy)}: COPY ${src}: no such file in the repository`);
            assert.ok(!DockerIgnored(path.posix.normalize(src)), `${Where(file, copy)}: COPY ${src}: .dockerignore excludes it`);
          }
          continue;
        }
        const stage = stages.slice(0, index).find((x) => x.name === from.getValue());
        assert.ok(stage, `${Where(file, copy)}: COPY --from=${from.getValue()} names no earlier stage`);
        if (stage.name !== 'build') continue;
        for (const src of sources) {
          assert.ok(src.startsWith(`${tree}/`), `${Where(file, copy)}: ${src} is not in the build tree ${tree}`);
          const rel = src.slice(tree.length + 1);
          const [dir, name] = [path.posix.dirname(rel), path.posix.basename(rel)];
          assert.ok(fs.existsSync(path.join(SOURCE_DIR, dir, 'CMakeLists.txt')) && CmakeExecutables(dir).includes(name),
                    `${Where(file, copy)}: ${dir}/CMakeLists.txt builds no executable ${name}`);
          assert.ok(buildTargets.includes(name), `${Where(file, copy)}: the build stage does not build --target ${name}`);
        }
      }
    });
  });

  for (const [target, want] of Object.entries(TARGETS)) {
    test(`${file}: target ${target} runs ${want.binary} as non-root, exposes ${want.ports.join(', ') || 'nothing'}`, () => {
      const stage = Stage(stages, target, file);
      const chain = Chain(stage).map((s) => s.name);
      assert.ok(chain.includes('runtime'), `${file}: target ${target} is not built on the runtime stage`);

      const users = Inherited(stage, 'USER');
      assert.ok(users.length > 0, `${file}: target ${target} runs as root (no USER)`);
      const user = Words(users[users.length - 1]).join(' ');
      // Numeric, so Kubernetes' runAsNonRoot can verify it.
      const m = /^(\d+):(\d+)$/.exec(user);
      assert.ok(m && Number(m[1]) !== 0 && Number(m[2]) !== 0, `${file}: target ${target}: USER ${user} is not a numeric non-root uid:gid`);
      const runs = Inherited(stage, 'RUN').map((r) => Words(r).join(' '));
      assert.ok(runs.some((r) => r.includes(`useradd`) && r.includes(`--uid ${m[1]}`) && r.includes(`--gid ${m[2]}`)),
                `${file}: no useradd --uid ${m[1]} --gid ${m[2]} before target ${target}`);

      const entrypoints = Inherited(stage, 'ENTRYPOINT');
      assert.ok(entrypoints.length > 0, `${file}: target ${target} has no ENTRYPOINT`);
      const argv = entrypoints[entrypoints.length - 1].getJSONStrings().map((j) => j.getJSONValue());
      assert.equal(path.posix.basename(argv[0] || ''), want.binary, `${file}: target ${target}'s ENTRYPOINT`);
      assert.ok(CmakeExecutables(want.dir).includes(want.binary), `${want.dir}/CMakeLists.txt builds no ${want.binary}`);
      const copied = stage.instructions.filter((i) => i.getKeyword() === 'COPY' && i.getFromFlag()?.getValue() === 'build')
          .some((i) => Words(i).at(-1) === argv[0] && Words(i)[0].endsWith(`/${want.dir}/${want.binary}`));
      assert.ok(copied, `${file}: target ${target} does not COPY --from=build ${want.dir}/${want.binary} to ${argv[0]}`);

      const ports = Inherited(stage, 'EXPOSE').flatMap(Words).map((p) => p.replace(/\/tcp$/, ''));
      assert.deepEqual([...ports].sort(), [...want.ports].sort(), `${file}: target ${target}'s EXPOSE`);

      const labels = new Map(Inherited(stage, 'LABEL').flatMap((l) => l.getProperties())
          .map((p) => [p.getName(), p.getValue()]));
      for (const label of OCI_LABELS) assert.ok(labels.get(label), `${file}: target ${target} lacks label ${label}`);
      assert.equal(labels.get('org.opencontainers.image.title'), want.binary, `${file}: target ${target}'s title label`);
    });
  }
}
