"""Chat templates render exactly what transformers renders; a model without one says so.

The templates are written in this family's format (tests/templates/qwen_family.jinja follows the structure of
the Qwen3.5 / 3.6 release's template: tools, thinking kept only after the last query unless preserve_thinking,
tool responses in one user turn, the generation prompt opening or closing <think>) and are rendered here and by
transformers (`AutoTokenizer.from_pretrained` on the same directory, no torch needed) on the same messages.
"""

import json
import random
import shutil
from pathlib import Path

import pytest

from qmtp import chat
from qmtp.errors import CheckpointError, UsageError
from qmtp.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "qmtp" / "assets" / "tiny"
QWEN = (Path(__file__).parent / "templates" / "qwen_family.jinja").read_text()

# A template that uses what transformers' environment adds: loop controls, namespace, its tojson options,
# dict(), the {% generation %} tag, the special tokens as variables, raise_exception.
FEATURES = """{%- set ns = namespace(count=0) %}
{%- for m in messages %}
{%- if m.role == 'skip' %}{% continue %}{% endif %}
{%- if m.role == 'stop' %}{% break %}{% endif %}
{%- set ns.count = ns.count + 1 %}
[{{ ns.count }} {{ m.role }}] {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
{% if m.data is defined %}{{ m.data | tojson(indent=2, sort_keys=true) }}{{ m.data | tojson }}{{ dict(a=1, b=[m.role]) | tojson(separators=(',', ':')) }}{% endif %}
{%- endfor %}
{%- if bad is defined %}{{ raise_exception('refused: ' + bad) }}{% endif %}
{{- eos_token }}{% if add_generation_prompt %}<go>{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Wetter für morgen, in °C",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {}}}}]

CONVERSATIONS = {
    "one question": [{"role": "user", "content": "What is 2 + 2?"}],
    "system and turns": [
        {"role": "system", "content": "  You answer briefly.\n"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a fruit."},
    ],
    "thinking in the content": [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "<think>\nold trace\n</think>\n\nOld answer"},
        {"role": "user", "content": "Second question"},
        {"role": "assistant", "content": "<think>\nnew trace\n</think>\n\nNew answer"},
    ],
    "thinking as reasoning_content": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "First"},
        {"role": "assistant", "reasoning_content": "old trace", "content": "Old answer"},
        {"role": "user", "content": "Second"},
        {"role": "assistant", "reasoning_content": "  new trace\n", "content": "New answer", "tool_calls": None},
        {"role": "user", "content": "Third"},
    ],
    "tool calls": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich and Köln?"},
        {"role": "assistant", "reasoning_content": "two cities", "content": "Checking both.",
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich", "days": 2}}},
                        {"type": "function", "function": {"name": "weather",
                                                          "arguments": {"city": "Köln", "opts": {"unit": "°C"}, "tags": ["a", 1]}}}]},
        {"role": "tool", "content": "sunny, 3 °C"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "note", "arguments": {}}]},
        {"role": "tool", "content": "saved"},
    ],
    "content parts": [
        {"role": "system", "content": [{"type": "text", "text": "Parts only."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " ok?"}]},
    ],
}
SETTINGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"preserve_thinking": True},
            {"add_generation_prompt": False}]


def template_dir(tmp_path: Path, template: str, as_file: bool = False) -> Path:
    """The bundled tokenizer with `template` (in tokenizer_config.json, or as chat_template.jinja)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY / "tokenizer.json", tmp_path)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    if as_file:
        (tmp_path / chat.TEMPLATE_FILE).write_text(template)
    else:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return template_dir(tmp_path_factory.mktemp("qwen"), QWEN)


@pytest.fixture(scope="module")
def ours(qwen_dir):
    return Tokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def hf(qwen_dir):
    transformers = pytest.importorskip("transformers")  # the test extra installs it; a base run skips here
    return transformers.AutoTokenizer.from_pretrained(str(qwen_dir))


def hf_render(hf, messages, settings, **kwargs):
    settings = dict(settings)
    add = settings.pop("add_generation_prompt", True)
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **settings, **kwargs)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renders_what_transformers_renders(ours, hf, name, settings):
    messages = CONVERSATIONS[name]
    tools = TOOLS if name == "tool calls" else None
    expected = hf_render(hf, messages, settings, tools=tools)
    assert ours.apply_chat_template(messages, tools=tools, **settings) == expected
    # the same without tools: the system message alone opens the prompt
    assert ours.apply_chat_template(messages, **settings) == hf_render(hf, messages, settings)


def random_conversation(rng: random.Random) -> list[dict]:
    words = ["alpha", "Straße", "x < y", "{\"k\": 1}", "line\nbreak", "  padded  ", "<b>", "été", ""]
    text = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))  # noqa: E731
    messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": text()})
        reply = {"role": "assistant", "content": text()}
        kind = rng.randrange(4)
        if kind == 1:
            reply["reasoning_content"] = text()
        elif kind == 2:
            reply["content"] = f"<think>\n{text()}\n</think>\n\n{text()}"
        elif kind == 3:
            reply["tool_calls"] = [{"type": "function", "function": {"name": rng.choice(["f", "g"]), "arguments": {
                "a": text(), "n": rng.randint(-5, 5), "l": [text(), 1.5, None, True]}}} for _ in range(rng.randint(1, 2))]
            messages.append(reply)
            messages += [{"role": "tool", "content": text()} for _ in range(rng.randint(1, 2))]
            reply = {"role": "assistant", "content": text()}
        messages.append(reply)
    if rng.random() < 0.7:
        messages.append({"role": "user", "content": text()})
    return messages


def test_random_conversations_render_as_transformers_renders(ours, hf):
    rng = random.Random(0)
    for i in range(60):
        messages = random_conversation(rng)
        settings = rng.choice(SETTINGS)
        tools = TOOLS if rng.random() < 0.3 else None
        assert ours.apply_chat_template(messages, tools=tools, **settings) == hf_render(hf, messages, settings,
                                                                                       tools=tools), (i, messages)


def test_the_family_format(ours):
    """What the format promises, checked directly (so a template bug shared with transformers would show)."""
    messages = CONVERSATIONS["thinking in the content"][:3]
    on = ours.apply_chat_template(messages)
    off = ours.apply_chat_template(messages, enable_thinking=False)
    assert on.endswith("<|im_start|>user\nSecond question<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "old trace" not in on and "<|im_start|>assistant\nOld answer<|im_end|>" in on  # earlier thinking dropped
    kept = ours.apply_chat_template(messages, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nold trace\n</think>\n\nOld answer<|im_end|>" in kept
    assert chat.opens_thinking(on) and not chat.opens_thinking(off)
    # the reasoning passed under another name reaches the template (as transformers 5 aliases it)
    alias = [messages[0], {"role": "assistant", "reasoning": "old trace", "content": "Old answer"}]
    assert ours.apply_chat_template(alias, preserve_thinking=True) == ours.apply_chat_template(
        [messages[0], {"role": "assistant", "reasoning_content": "old trace", "content": "Old answer"}],
        preserve_thinking=True)


def test_tokenize_gives_the_ids_transformers_gives(ours, hf):
    messages = CONVERSATIONS["system and turns"]
    ids = ours.apply_chat_template(messages, tokenize=True)
    assert ids == ours.encode(ours.apply_chat_template(messages))
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == list(expected)


def test_environment_features_render_as_transformers_renders(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = template_dir(tmp_path / "features", FEATURES)
    ours = Tokenizer.from_dir(directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [{"role": "user", "content": "a", "data": None}, {"role": "skip", "content": "hidden"},
                {"role": "assistant", "content": "b", "data": {"z": "ü", "a": [1, 2.5, None], "html": "<&>"}},
                {"role": "stop", "content": "x"}, {"role": "user", "content": "never"}]
    for add in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
    assert "hidden" not in expected and "never" not in expected and '"z": "ü"' in expected
    assert expected.startswith("[1 user] a[2 assistant] b")  # a None value is dropped: `data is defined` is false
    assert expected.endswith("<|im_end|>")  # the tokenizer's eos_token (the bundled one's, as Qwen3.6's) is a variable
    # a keyword argument overrides a special token, as in transformers
    assert ours.apply_chat_template(messages, eos_token="END").endswith("END<go>")
    with pytest.raises(UsageError, match="refuses these messages: refused: why"):
        ours.apply_chat_template(messages, bad="why")


def test_the_sandbox_holds(tmp_path):
    for template, fragment in [("{{ messages.append(1) }}", "refuses"),
                               ("{% set ns = namespace(_x=1) %}", "underscore"),
                               ("{{ ''.__class__.__mro__ }}", "refuses")]:
        ours = Tokenizer.from_dir(template_dir(tmp_path / str(len(fragment)) / str(hash(template) % 1000), template))
        try:
            text = ours.apply_chat_template([{"role": "user", "content": "a"}])
        except UsageError as err:
            assert fragment in str(err) and "\n" not in str(err)
        else:  # the immutable sandbox may render an unsafe attribute as undefined instead
            assert "class" not in text and text == ""


def test_chat_template_jinja_wins_over_the_config(tmp_path):
    directory = template_dir(tmp_path, "{{ 'from the config' }}")
    (directory / chat.TEMPLATE_FILE).write_text("{{ 'from the file' }}")
    assert Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "a"}]) == "from the file"
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert hf.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False) == "from the file"


def test_a_model_without_a_template_says_so(tmp_path):
    bare = model_dir(tmp_path, template=None)
    tok = Tokenizer.from_dir(bare)
    assert tok.chat_template is None
    with pytest.raises(UsageError, match="has no chat template") as err:
        tok.apply_chat_template([{"role": "user", "content": "a"}])
    assert str(bare) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("messages, fragment", [
    ("hello", "list of"),
    ([], "empty"),
    ([{"content": "no role"}], "needs a 'role'"),
    (["text"], "messages[0]: give a dict"),
    ([{"role": "user", "content": 3}], "'content' must be text"),
    ([{"role": "user", "content": object()}], "'content' must be text"),
    ([{"role": "user", "content": "a", "meta": object()}], "not object"),
    ([{"role": "assistant", "content": "no user query"}], "There is no user query"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "Only the first message"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "Unknown content part"),
])
def test_bad_messages_are_one_line_usage_errors(ours, messages, fragment):
    with pytest.raises(UsageError) as err:
        ours.apply_chat_template(messages)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_bad_arguments_are_usage_errors(ours):
    messages = CONVERSATIONS["one question"]
    for kwargs, fragment in [({"enable_thinking": "no"}, "enable_thinking"), ({"tokenize": 1}, "tokenize"),
                             ({"tools": {"name": "f"}}, "tools"), ({"tools": ["f"]}, "JSON schema"),
                             ({"chat_template": 5}, "chat_template")]:
        with pytest.raises(UsageError, match=fragment):
            ours.apply_chat_template(messages, **kwargs)


def test_a_template_that_does_not_compile_names_its_line(tmp_path):
    tok = Tokenizer.from_dir(template_dir(tmp_path, "{% for m in messages %}\n{{ m.content }\n"))
    with pytest.raises(CheckpointError, match=r"does not compile: .*\(line 2\)"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


def test_split_thinking():
    assert chat.split_thinking("plan\nmore\n</think>\n\nThe answer.", opened=True) == ("plan\nmore", "The answer.")
    assert chat.split_thinking("<think>\nplan\n</think>\n\nAnswer", opened=False) == ("plan", "Answer")
    assert chat.split_thinking("still thinking", opened=True) == ("still thinking", "")
    assert chat.split_thinking("<think>\nstill", opened=False) == ("still", "")
    assert chat.split_thinking("Just an answer", opened=False) == ("", "Just an answer")


# ---- generate: messages, end ids, stop strings ----------------------------------------------------------------
def model_dir(tmp_path: Path, template: str | None = QWEN, generation_config: dict | None = None,
              eos_token: str | None = None) -> Path:
    """The bundled model's files (linked) with a chat template, a generation_config.json, another eos_token: only
    those given (the bundled model's own template and generation config are left out)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        if f.is_file() and f.name not in ("tokenizer_config.json", chat.TEMPLATE_FILE, chat.GENERATION_CONFIG):
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    if eos_token is not None:
        config["eos_token"] = eos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (tmp_path / chat.GENERATION_CONFIG).write_text(json.dumps(generation_config))
    return tmp_path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import qmtp

    return qmtp.load(model_dir(tmp_path_factory.mktemp("templated")))


@pytest.fixture(scope="module")
def free_run(model):
    """What the bundled model writes after a prompt when nothing stops it: (prompt, tokens, text)."""
    import qmtp

    g = qmtp.generate(model, "Once upon a time", max_tokens=48, stop_at_eos=False)
    return "Once upon a time", g.tokens, g.text


MESSAGES = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A story about a fox."}]


@pytest.mark.parametrize("enable_thinking", [None, False])
def test_generate_takes_messages(model, enable_thinking):
    import qmtp

    ids = model.tokenizer.apply_chat_template(MESSAGES, enable_thinking=enable_thinking, tokenize=True)
    g = qmtp.generate(model, messages=MESSAGES, enable_thinking=enable_thinking, max_tokens=12)
    assert g.prompt_tokens == ids
    assert model.tokenizer.decode(g.prompt_tokens).endswith("<think>\n" if enable_thinking is None else "</think>\n\n")
    assert g.tokens == qmtp.generate(model, ids, max_tokens=12).tokens
    assert g.tokens == qmtp.generate(model, messages=MESSAGES, enable_thinking=enable_thinking, max_tokens=12,
                                     n_draft=3).tokens
    kept = qmtp.generate(model, messages=MESSAGES + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
                         chat_template_kwargs={"preserve_thinking": True}, max_tokens=1)
    assert "<think>\n\n</think>\n\nx<|im_end|>" in model.tokenizer.decode(kept.prompt_tokens)


def test_generation_stops_at_every_end_id(tmp_path, free_run):
    import qmtp

    prompt, tokens, _ = free_run
    # two ids the model writes, first seen at different places: generation_config.json declares both
    firsts = {}
    for i, t in enumerate(tokens):
        firsts.setdefault(t, i)
    late = sorted((i, t) for t, i in firsts.items() if i >= 6)
    (i1, t1), (i2, t2) = late[0], late[-1]
    for n, declared in enumerate(([t2, t1], t1, [t2])):
        model = qmtp.load(model_dir(tmp_path / str(n), generation_config={"eos_token_id": declared}))
        end = min(firsts[t] for t in ([declared] if isinstance(declared, int) else declared))
        for n_draft in (1, 3):
            g = qmtp.generate(model, prompt, max_tokens=48, n_draft=n_draft)
            assert g.tokens == tokens[:end + 1] and g.finish_reason == "end", (declared, n_draft)
            assert g.text == model.tokenizer.decode(tokens[:end])
        assert qmtp.generate(model, prompt, max_tokens=48, stop_at_eos=False).tokens == tokens
    # the tokenizer's eos_token is an end id too (Qwen3.6's is <|im_end|>, beside <|endoftext|>)
    named = model.tokenizer.id_to_token(t1)
    model = qmtp.load(model_dir(tmp_path / "named", eos_token=named))
    assert chat.end_ids(model) == {0, t1}
    assert qmtp.generate(model, prompt, max_tokens=48).tokens == tokens[:i1 + 1]


@pytest.mark.parametrize("n_draft", [1, 3])
def test_generation_stops_at_a_stop_string(model, free_run, n_draft):
    import qmtp

    prompt, tokens, text = free_run
    for start in (5, len(text) // 2, len(text) - 6):
        stop = text[start:start + 5]
        cut = text.find(stop)
        streamed = []
        g = qmtp.generate(model, prompt, max_tokens=48, n_draft=n_draft, stop=["never there", stop],
                          stop_at_eos=False, on_tokens=streamed.extend)
        assert g.text == text[:cut] and g.finish_reason == "stop"
        assert g.tokens == tokens[:len(g.tokens)] and streamed == g.tokens
        assert stop in model.tokenizer.decode(g.tokens) and stop not in model.tokenizer.decode(g.tokens[:-1])
    g = qmtp.generate(model, prompt, max_tokens=48, n_draft=n_draft, stop="never there", stop_at_eos=False)
    assert g.tokens == tokens and g.finish_reason == "length"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"prompt": "a", "messages": MESSAGES}, "not both"),
    ({}, "give a prompt"),
    ({"prompt": "a", "enable_thinking": False}, "give messages"),
    ({"prompt": "a", "chat_template_kwargs": {"x": 1}}, "give messages"),
    ({"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"messages": MESSAGES, "enable_thinking": "off"}, "enable_thinking"),
    ({"messages": "hello"}, "list of"),
    ({"prompt": "a", "stop": 5}, "stop=5"),
    ({"prompt": "a", "stop": ["ok", ""]}, "non-empty"),
])
def test_generate_refuses_bad_chat_input(model, kwargs, fragment):
    import qmtp

    with pytest.raises(UsageError, match=fragment):
        qmtp.generate(model, max_tokens=2, **kwargs)


def test_generate_with_messages_needs_a_template_and_a_sane_generation_config(tmp_path):
    import qmtp

    bare = qmtp.load(model_dir(tmp_path / "bare", template=None))
    with pytest.raises(UsageError, match="has no chat template"):
        qmtp.generate(bare, messages=MESSAGES, max_tokens=2)
    broken = qmtp.load(model_dir(tmp_path / "broken", generation_config={"eos_token_id": [1, "two"]}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id"):
        qmtp.generate(broken, "a", max_tokens=2)


# ---- python -m qmtp chat ------------------------------------------------------------------------------------
def run_chat(*argv, input=None):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("QMTP_MODEL", None)
    return subprocess.run([sys.executable, "-m", "qmtp", "chat", *map(str, argv)], capture_output=True, text=True,
                          env=env, input=input, timeout=300)


def stats_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[") and "tok/s" in line]


def test_chat_without_a_template_continues_raw(tmp_path):
    # as mlx-lm does: the text continued, said once on stderr (tests/test_cli_reliability.py checks the rest)
    bare = model_dir(tmp_path, template=None)
    result = run_chat(bare, "--prompt", "Once upon a time", "--max-tokens", "3")
    assert result.returncode == 0 and result.stdout.startswith("Once upon a time"), result.stderr
    assert "has no chat template" in result.stderr
    raw = run_chat(bare, "--raw", "--prompt", "Once upon a time", "--max-tokens", "3")
    assert raw.returncode == 0 and raw.stdout.startswith("Once upon a time"), raw.stderr


@pytest.mark.parametrize("argv, fragment", [
    (("--raw", "--system", "x"), "--system"),
    (("--raw", "--thinking=false"), "--thinking"),
    (("--raw", "--hide-thinking"), "--hide-thinking"),
    (("--stop", ""), "--stop"),
    (("--thinking=maybe",), "expected true or false"),
])
def test_chat_refuses_flags_that_do_not_fit(argv, fragment):
    from helpers import one_line_error

    result = run_chat(*argv, "--prompt", "hi")
    assert result.returncode == 2
    one_line_error(result.stderr, fragment)


def test_chat_applies_the_template_and_keeps_the_conversation(model):
    """Each stdin line is a turn: the second turn's prompt holds the first answer (what generate gives for the
    same messages); thinking off prints the answer alone on stdout."""
    import qmtp

    path, turns = model.path, ["Tell me about foxes.", "And rabbits?"]
    result = run_chat(path, "--thinking=false", "--system", "Be brief.", "--max-tokens", "8", "--use-mtp",
                      input="".join(t + "\n" for t in turns))
    assert result.returncode == 0, result.stderr
    messages, expected, prompts = [{"role": "system", "content": "Be brief."}], [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        g = qmtp.generate(model, messages=messages, enable_thinking=False, max_tokens=8)
        expected.append(g.text)
        prompts.append(len(g.prompt_tokens))
        messages.append({"role": "assistant", "content": g.text})
    assert result.stdout == "".join(a + "\n" for a in expected)
    # the tiny model answers every question alike, so the prompts' lengths show that the history was read
    alone = len(model.tokenizer.apply_chat_template(messages[:1] + messages[-2:-1], enable_thinking=False,
                                                    tokenize=True))
    assert prompts[1] > alone
    assert [f"after a prompt of {n}" in line for n, line in zip(prompts, stats_lines(result.stderr))] == [True, True]
    assert "[thinking]" not in result.stderr
    # /reset starts again from the system message: the third turn's prompt is the first's
    again = run_chat(path, "--thinking=false", "--system", "Be brief.", "--max-tokens", "8",
                     input=f"{turns[0]}\n{turns[1]}\n/reset\n{turns[0]}\n")
    assert [line.split("after a prompt of ")[1].split("]")[0] for line in stats_lines(again.stderr)] == [
        str(prompts[0]), str(prompts[1]), str(prompts[0])]


def test_chat_shows_thinking_apart_or_hides_it(model):
    import qmtp

    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    text = qmtp.generate(model, messages=messages, max_tokens=10).text  # thinking on: all of it is thinking
    shown = run_chat(model.path, "--prompt", messages[0]["content"], "--max-tokens", "10")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == "\n"  # no answer yet: the tiny model never closes its think block
    assert f"[thinking]\n{text.strip(chr(10))}\n[/thinking]\n" in shown.stderr
    hidden = run_chat(model.path, "--prompt", messages[0]["content"], "--max-tokens", "10", "--hide-thinking")
    assert hidden.returncode == 0 and hidden.stdout == "\n" and "thinking]" not in hidden.stderr


def test_chat_stops_at_a_stop_string(model, free_run):
    prompt, _, text = free_run
    stop = text[10:14]
    # greedy, as free_run: chat would otherwise sample as the bundled model's generation_config.json says
    result = run_chat("--raw", "--prompt", prompt, "--max-tokens", "48", "--stop", "never", "--stop", stop,
                      "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == prompt + text[:text.find(stop)] + "\n"


def stream_of(model, capsys, text: str, opened: bool, **kwargs):
    """Feed `text`'s tokens to a ChatStream one at a time; (stdout, stderr, what finish returned)."""
    from qmtp.cli import ChatStream

    tok = model.tokenizer
    ids = tok.encode(text)
    stream = ChatStream(tok, chat.end_ids(model), kwargs.pop("stops", ()), opened, **kwargs)
    for t in ids + [0]:  # the end id is never printed
        stream.add([t])
    parts = stream.finish(kwargs.pop("final", text))
    out, err = capsys.readouterr()
    return out, err, parts


def test_chat_stream_separates_thinking_token_by_token(model, capsys):
    reply = "First, foxes.\nThen rabbits.\n</think>\n\nFoxes eat rabbits."
    out, err, parts = stream_of(model, capsys, reply, opened=True)
    assert out == "Foxes eat rabbits.\n"
    assert err == "[thinking]\nFirst, foxes.\nThen rabbits.\n[/thinking]\n"
    assert parts == ("First, foxes.\nThen rabbits.", "Foxes eat rabbits.")
    out, err, _ = stream_of(model, capsys, reply, opened=True, hide=True)
    assert out == "Foxes eat rabbits.\n" and err == ""
    out, err, _ = stream_of(model, capsys, "<think>\nhm\n</think>\n\nYes.", opened=False)  # a reply opening one
    assert out == "Yes.\n" and err == "[thinking]\nhm\n[/thinking]\n"
    out, err, _ = stream_of(model, capsys, "Plain answer.", opened=False)
    assert out == "Plain answer.\n" and err == ""


def test_chat_stream_never_shows_part_of_a_stop_string(model, capsys):
    from qmtp.cli import ChatStream

    tok = model.tokenizer
    stream = ChatStream(tok, {0}, ("rabbit",), opened=False)
    shown = []
    for t in tok.encode("Foxes eat rab"):
        stream.add([t])
        shown.append(capsys.readouterr().out)
    assert "".join(shown) == "Foxes eat "  # "rab" may begin the stop string: held back
    stream.finish("Foxes eat ")
    assert capsys.readouterr().out == "\n"


def test_doctor_reports_the_chat_template(tmp_path, capsys):
    from qmtp import cli

    assert cli.main(["doctor", str(model_dir(tmp_path / "bare", template=None))]) == 0
    assert "chat template: none (chat continues the text raw" in capsys.readouterr().out
    bundled = (TINY / chat.TEMPLATE_FILE).read_text()
    assert cli.main(["doctor", str(TINY)]) == 0
    assert f"chat template: {len(bundled)} characters, compiles" in capsys.readouterr().out
    assert cli.main(["doctor", str(model_dir(tmp_path / "good"))]) == 0
    assert f"chat template: {len(QWEN)} characters, compiles" in capsys.readouterr().out
    assert cli.main(["doctor", str(model_dir(tmp_path / "bad", template="{% if %}"))]) == 2
    out, err = capsys.readouterr()
    assert "chat template: BROKEN (the chat template does not compile" in out and "does not compile" in err


@pytest.mark.parametrize("opener", ["<|im_start|>", "### "])
def test_the_turn_mark_is_where_the_generation_prompt_starts(tmp_path, opener):
    """The mark a chat's prompt holds its state at comes from the template's own renders: with another template's
    spelling of a turn's start, it is still where the generation prompt starts."""
    template = ("{% for m in messages %}" + opener + "{{ m.role }}\n{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}" + opener + "assistant\n{% endif %}")
    tokenizer = Tokenizer.from_dir(template_dir(tmp_path, template))
    messages = [{"role": "user", "content": "Hello there"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=True)
    mark = chat.generation_prompt_start(tokenizer, messages, prompt)
    assert 0 < mark < len(prompt)
    assert tokenizer.decode(prompt[mark:]).startswith(opener.strip())
    assert tokenizer.decode(prompt[:mark]).endswith("Hello there\n")
