// preft's tokenizer against @huggingface/tokenizers (Hugging Face's own JavaScript
// implementation, independent of preft) on strings that normalization changes: decomposed
// accents, the Angstrom sign, stacked combining marks, Hangul jamo, compatibility characters,
// already-NFC text, special tokens between them. The tokenizer.json is make-model's tiny-qwen2
// (a generated vocabulary; normalizer, pre-tokenizer and decoder are Qwen2.5's), then the same
// file with the other normalizers preft implements.
// Usage: node --test compare.mjs   (env PREFT: the preft binary, WORK: a scratch folder)
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { Tokenizer } from '@huggingface/tokenizers';

const preft = process.env.PREFT;
const work = process.env.WORK;

const STRINGS = [
  'cafe\u0301', 'caf\u00e9', 'Cafe\u0301 au lait, re\u0301sume\u0301.', '\u212B', '\u00C5ngstr\u00f6m \u212Bngstro\u0308m',
  'a\u0302\u0323', 'a\u0323\u0302', 'e\u0301\u0302\u0303\u0304 stacked', 'o\u0308\u0304',
  '\u1100\u1161\u11A8', '\uAC01', '\u1112\u1161\u11AB\u1100\u1173\u11AF \uD55C\uAE00',
  '\uFB01nance \u2460 \uFF21\uFF22\uFF23 x\u00B2 \u2163 \u3300', 'already NFC: na\u00efve fa\u00e7ade',
  'Hello world 123', '  spaced   out  ', 'MIXED Case \u0130stanbul \u03A3\u039F\u03A6\u039F\u03A3.',
  '<|im_start|>user\nCafe\u0301?<|im_end|>', '<|IM_START|> not special', 'tab\tand\nnewline',
  '\u00e9\u0301', '\u0340\u0341 \u0344', '\u1E9B\u0323', 'emoji \u{1F469}\u200D\u{1F4BB} \u{1F1EB}\u{1F1F7}',
];

const NORMALIZERS = {
  qwen2_nfc: null,  // as make-model writes it: {"type": "NFC"}
  none: { type: 'Sequence', normalizers: [] },
  nfd: { type: 'NFD' },
  nfkc: { type: 'NFKC' },
  nfkd: { type: 'NFKD' },
  sequence: {
    type: 'Sequence',
    normalizers: [
      { type: 'NFKC' }, { type: 'Lowercase' }, { type: 'Strip', strip_left: true, strip_right: true },
      { type: 'Replace', pattern: { Regex: '\\s+' }, content: ' ' },
      { type: 'Replace', pattern: { String: 'caf' }, content: 'KAF' },
      { type: 'Prepend', prepend: '\u2581' },
    ],
  },
};

function model() {
  const dir = path.join(work, 'tiny-qwen2');
  if (!fs.existsSync(path.join(dir, 'tokenizer.json'))) {
    execFileSync(preft, ['make-model', '--preset', 'tiny-qwen2', '--seed', '1', '--out', dir], { stdio: 'ignore' });
  }
  return dir;
}

function preftIds(dir, texts) {
  const input = texts.map((t) => JSON.stringify(t)).join('\n') + '\n';
  const out = execFileSync(preft, ['tokenize', '--model', dir, '--jsonl', '--no-special'], { input, encoding: 'utf8' });
  return out.trim().split('\n').map((l) => JSON.parse(l));
}

for (const [name, normalizer] of Object.entries(NORMALIZERS)) {
  test(`tiny-qwen2 tokenizer.json with normalizer ${name}: preft ids == @huggingface/tokenizers ids`, () => {
    const base = model();
    const json = JSON.parse(fs.readFileSync(path.join(base, 'tokenizer.json'), 'utf8'));
    const config = JSON.parse(fs.readFileSync(path.join(base, 'tokenizer_config.json'), 'utf8'));
    let dir = base;
    if (normalizer === null) {
      assert.deepEqual(json.normalizer, { type: 'NFC' }, "make-model's qwen2 tokenizer normalizes to NFC, as Qwen2.5's");
    } else {
      json.normalizer = normalizer;
      dir = path.join(work, `tokenizer-${name}`);
      fs.mkdirSync(dir, { recursive: true });
      fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(json));
      fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
    }
    const js = new Tokenizer(json, config);
    const got = preftIds(dir, STRINGS);
    const mismatches = [];
    STRINGS.forEach((s, i) => {
      const want = js.encode(s, { add_special_tokens: false }).ids;
      if (JSON.stringify(got[i]) !== JSON.stringify(want)) {
        mismatches.push(`${JSON.stringify(s)}: preft ${JSON.stringify(got[i])}, js ${JSON.stringify(want)}`);
      }
    });
    assert.equal(mismatches.length, 0, mismatches.join('\n'));
  });
}

test('NFC changes the ids of decomposed text, and only of it', () => {
  const texts = ['cafe\u0301', 'caf\u00e9', '\u212B', '\u00C5', 'already NFC: na\u00efve', 'Hello 123'];
  const nfc = preftIds(model(), texts);
  const none = preftIds(path.join(work, 'tokenizer-none'), texts);  // written by the test above
  assert.deepEqual(nfc[0], nfc[1]);
  assert.deepEqual(nfc[2], nfc[3]);
  assert.notDeepEqual(none[0], none[1]);
  assert.notDeepEqual(none[2], none[3]);
  assert.deepEqual(nfc.slice(4), none.slice(4));  // NFC text is left as it is
});
