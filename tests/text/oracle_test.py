#!/usr/bin/env python3
"""Our Jinja renderer against Python's jinja2 configured as transformers' apply_chat_template
configures it (trim_blocks, lstrip_blocks, loopcontrols, its tojson, raise_exception): real
chat templates (Llama 3.1, Qwen2.5, Mistral) and a template that uses every supported construct,
over many conversations, must render byte for byte the same; raise_exception must fail both.

The real templates are the ones `preft make-model` writes for its Llama, Qwen2 and Mistral
presets (common/text/chat_template_builtin.cc).

Usage: oracle_test.py JINJA_RENDER PREFT TEMPLATES_DIR WORK_DIR
"""
import json
import os
import subprocess
import sys

try:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("python3-jinja2 is not installed (scripts/install-deps.sh installs it); skipping")
    sys.exit(77)


def hf_environment():
    # transformers.utils.chat_template_utils._compile_jinja_template, minus AssistantTracker.
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c\nwith newline and \"quotes\" and 'apostrophes'"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2 ünïcödé ✓"},
     {"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "content": "{\"temp\": 3}"}, {"role": "user", "content": "thanks"}],
]
EXTRAS = [{"add_generation_prompt": True}, {"add_generation_prompt": False},
          {"add_generation_prompt": True, "tools": [TOOL]},
          {"add_generation_prompt": True, "tools": [TOOL], "tools_in_user_message": False}]


def main():
    render, preft, templates, work = sys.argv[1:5]
    os.makedirs(work, exist_ok=True)
    paths = [os.path.join(templates, n) for n in sorted(os.listdir(templates))]
    for preset in ("tiny", "tiny-qwen2", "tiny-mistral"):
        model = os.path.join(work, preset)
        subprocess.run([preft, "make-model", "--preset", preset, "--seed", "1", "--out", model],
                       check=True, capture_output=True)
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            chat_template = json.load(f).get("chat_template")
        if not chat_template:
            print(f"FAIL: make-model --preset {preset} wrote no chat_template")
            return 1
        paths.append(os.path.join(work, f"{preset}.jinja"))
        with open(paths[-1], "w") as f:
            f.write(chat_template)
    env = hf_environment()
    failures = cases = 0
    for path in paths:
        name = os.path.basename(path)
        with open(path) as f:
            source = f.read()
        template = env.from_string(source)
        for ci, messages in enumerate(CONVERSATIONS):
            for ei, extra in enumerate(EXTRAS):
                context = {"messages": messages, "bos_token": "<s>", "eos_token": "</s>", **extra}
                try:
                    want = template.render(**context)
                except jinja2.exceptions.TemplateError as e:
                    want = f"ERROR: {e}"
                ctx_path = os.path.join(work, f"{name}.{ci}.{ei}.json")
                with open(ctx_path, "w") as f:
                    json.dump(context, f, ensure_ascii=False)
                got = subprocess.run([render, path, ctx_path], capture_output=True).stdout.decode()
                cases += 1
                # Errors must agree that there is one, and on raise_exception's message.
                same = got == want or (got.startswith("ERROR: ") and want.startswith("ERROR: ")
                                        and (got == want or "raise" not in source))
                if not same:
                    failures += 1
                    print(f"FAIL: {name} conversation {ci} {extra}:\n--- jinja2\n{want!r}\n"
                          f"--- preft\n{got!r}")
    print(f"jinja oracle: {cases} renders, {failures} differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
