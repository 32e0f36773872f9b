// The official `openai` npm client (not ours) against `preft serve --http-listen`: models, a
// streamed and a plain completion and a streamed chat completion with an adapter picked by
// `model` (PreFT positions), equal token for token to `preft generate` (--chat), chat logprobs,
// and errors as the SDK's typed exceptions.
// Usage: node openai_client_test.mjs BUILD_DIR WORK_DIR
import { spawn, execFileSync } from 'node:child_process';
import { mkdirSync, rmSync } from 'node:fs';
import OpenAI from 'openai';

const [build, work] = process.argv.slice(2);
const preft = `${build}/tools/preft`;
let failures = 0;
const expect = (ok, what) => {
  console.log(`${ok ? 'ok' : 'FAIL'}: ${what}`);
  if (!ok) failures++;
};

rmSync(work, { recursive: true, force: true });
mkdirSync(`${work}/adapters`, { recursive: true });
const run = (...args) => execFileSync(preft, args, { encoding: 'utf8' });
run('make-model', '--preset', 'tiny', '--seed', '9', '--out', `${work}/model`);
run('make-adapter', '--model', `${work}/model`, '--kind', 'direft', '--rank', '4', '--seed', '5',
    '--out', `${work}/adapters/u1`);

const server = spawn(preft, ['serve', '--model', `${work}/model`, '--listen', '127.0.0.1:0',
  '--http-listen', '127.0.0.1:0', '--adapter-root', `${work}/adapters`, '--threads', '1'],
  { stdio: ['ignore', 'pipe', 'inherit'] });
const watchdog = setTimeout(() => { console.log('FAIL: timed out'); server.kill('SIGKILL'); process.exit(1); }, 120000);
const baseURL = await new Promise((resolve, reject) => {
  let out = '';
  server.stdout.on('data', (d) => {
    out += d;
    const m = out.match(/OpenAI-compatible HTTP on (http:\/\/\S+)/);
    if (m) resolve(m[1]);
  });
  server.on('exit', (code) => reject(new Error(`preft serve exited with ${code}`)));
});

try {
  const client = new OpenAI({ baseURL, apiKey: 'not-needed', maxRetries: 0 });
  const load = await fetch(`${baseURL}/load_lora_adapter`, {
    method: 'POST', body: JSON.stringify({ lora_name: 'u1', lora_path: 'u1' }) });
  expect(load.status === 200, `load_lora_adapter: ${load.status} ${await load.text()}`);

  const models = await client.models.list();
  const ids = models.data.map((m) => m.id);
  expect(ids.length === 2 && ids[0] === 'model' && ids[1] === 'u1', `models: ${ids}`);

  const prompt = 'the personalised prompt';
  const reference = JSON.parse(run('generate', '--model', `${work}/model`, '--adapter',
    `${work}/adapters/u1`, '--adapter-positions', 'prompt', '--prompt', prompt,
    '--max-tokens', '12', '--ignore-eos', '--json'));
  const params = { model: 'u1', prompt, max_tokens: 12, temperature: 0, ignore_eos: true,
                   adapter_positions: 'prompt' };

  const stream = await client.completions.create({ ...params, stream: true,
                                                   stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  expect(text === reference.text, `streamed text equals preft generate (${JSON.stringify(text)})`);
  expect(chunks > 2 && finish === 'length', `${chunks} chunks, finish_reason ${finish}`);
  expect(usage && usage.completion_tokens === 12 &&
         usage.prompt_tokens === reference.prompt_ids.length, `usage ${JSON.stringify(usage)}`);

  const plain = await client.completions.create(params);
  expect(plain.choices[0].text === reference.text && plain.object === 'text_completion',
         'non-streamed text equals preft generate');

  // Chat: the model's chat template (written by make-model) builds the prompt.
  const chatReference = JSON.parse(run('generate', '--model', `${work}/model`, '--adapter',
    `${work}/adapters/u1`, '--adapter-positions', 'prompt', '--chat', '--prompt', 'hello chat',
    '--max-tokens', '10', '--ignore-eos', '--json'));
  const chatStream = await client.chat.completions.create({
    model: 'u1', messages: [{ role: 'user', content: 'hello chat' }], max_tokens: 10,
    temperature: 0, ignore_eos: true, adapter_positions: 'prompt', stream: true });
  let chatText = '', role = null, chatFinish = null;
  for await (const chunk of chatStream) {
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      chatText += c.delta.content ?? '';
      if (c.finish_reason) chatFinish = c.finish_reason;
    }
  }
  expect(chatText === chatReference.text && role === 'assistant' && chatFinish === 'length',
         `streamed chat equals preft generate --chat (${JSON.stringify(chatText)})`);
  const chat = await client.chat.completions.create({
    model: 'u1', messages: [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'hi' }],
    max_tokens: 5, temperature: 0, adapter_positions: 'prompt', logprobs: true, top_logprobs: 2 });
  const lp = chat.choices[0].logprobs?.content ?? [];
  expect(chat.object === 'chat.completion' && chat.choices[0].message.role === 'assistant' &&
         lp.length === chat.usage.completion_tokens && lp.every((t) => t.top_logprobs.length === 2),
         `chat completion with logprobs (${lp.length} tokens)`);

  const base = await client.completions.create({ ...params, model: 'model' });
  expect(base.choices[0].text !== reference.text, 'the base model answers differently');

  for (const [what, body, Type, status] of [
    ['unknown model', { ...params, model: 'nobody' }, OpenAI.NotFoundError, 404],
    ['bad temperature', { ...params, temperature: 9 }, OpenAI.BadRequestError, 400],
  ]) {
    try {
      await client.completions.create(body);
      expect(false, `${what} was served`);
    } catch (e) {
      expect(e instanceof Type && e.status === status, `${what}: ${e.status} ${e.message}`);
    }
  }
} catch (e) {
  expect(false, `unexpected: ${e.stack}`);
} finally {
  clearTimeout(watchdog);
  server.kill('SIGTERM');
}
console.log(`openai client: ${failures} failures`);
process.exit(failures ? 1 : 0);
