"""A chat template is data from a downloaded checkpoint: compiling and rendering it ends in bounded time and
size with text or one qmtp error (never a hang, never a traceback), in any thread; and the text around it
(messages, prompts, the template's output, chat_template_kwargs, named templates) fails as one clear line.

The bounds are shrunk here (`template_bounds.LIMITS`) so that the tests stay fast.
"""

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qmtp import chat, template_bounds
from qmtp.errors import QmtpError, TemplateError, UsageError
from qmtp.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "qmtp" / "assets" / "tiny"
QWEN = (Path(__file__).parent / "templates" / "qwen_family.jinja").read_text()
HELLO = [{"role": "user", "content": "Hello"}]
SECONDS = 0.5
SMALL = template_bounds.TemplateLimits(seconds=SECONDS, chars=100_000, depth=50)


@pytest.fixture(autouse=True)
def small_limits(monkeypatch):
    monkeypatch.setattr(template_bounds, "LIMITS", SMALL)


def in_thread(work):
    """`work()` run in a new thread (where signal.alarm cannot reach): (its result or exception, seconds)."""
    box = {}

    def run():
        started = time.perf_counter()
        try:
            box["result"] = work()
        except BaseException as err:  # noqa: BLE001 (the test looks at what came out)
            box["result"] = err
        box["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the render did not end"
    return box["result"], box["seconds"]


HOSTILE = {
    # arithmetic past any size, and arithmetic that raises
    "huge power": "{{ 2 ** (2 ** 40) }}",
    "power in a loop": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x ** 2 %}{% endfor %}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ns.x}}",
    "number past printing": "{{ 10 ** 5000 }}",
    "repeated text": "{{ 'a' * 10 ** 10 }}",
    "repeated list": "{{ [0] * 10 ** 10 }}",
    "doubled with +": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}",
    "doubled with ~": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                      "{% endfor %}",
    "division by zero": "{{ 1 / 0 }}",
    "floor division by zero": "{{ 1 // 0 }}",
    "modulo by zero": "{{ 1 % 0 }}",
    "float overflow": "{{ 10.0 ** 400 }}",
    # calls and filters whose size is their argument, or a product of their inputs
    "center method": "{{ 'a'.center(10 ** 10) }}",
    "center filter": "{{ 'a' | center(10 ** 10) }}",
    "format width": "{{ '{:>9999999999}'.format(1) }}",
    "format width from an argument": "{{ '{:>{}}'.format(1, 10 ** 10) }}",
    "format width from a text argument": "{{ '{:>{w}}'.format_map({'w': '9999999999'}) }}",
    "printf width": "{{ '%09999999999d' % 1 }}",
    "format filter": "{{ '%9999999999s' | format('x') }}",
    "replace product": "{{ ('a' * 50000) | replace('', 'b' * 50000) }}",
    "join product": "{{ ('b' * 50000).join('a' * 50000) }}",
    "join filter": "{{ ('a' * 50000) | join('b' * 50000) }}",
    "indent product": "{{ ('\\n' * 50000) | indent(50000) }}",
    "expandtabs": "{{ ('\\t' * 50000).expandtabs(50000) }}",
    "to_bytes": "{{ (1).to_bytes(10 ** 10, 'big') }}",
    "sum of lists": "{{ ([[0] * 10] * 10000) | sum(start=[]) }}",
    "round far": "{{ 5 | round(-10000000) }}",
    # loops, recursion, nesting, output
    "range too big": "{% for i in range(10 ** 9) %}{% endfor %}",
    "silent nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(10 ** 9) }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive loop": "{% for m in [[1]] recursive %}{{ loop([m]) }}{% endfor %}",
    "nested ifs": "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000,
    "nested fors": "{% for i in [1] %}" * 300 + "x" + "{% endfor %}" * 300,
    "shared list doubled": "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}"
                           "{% endfor %}{{ ns.l }}",
    "shared list repeated": "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l] * 2 %}"
                            "{% endfor %}{{ ns.l | tojson }}",
    "shared lists compared": "{% macro f(a, b, n) %}{% if n %}{{ f((a, a), (b, b), n - 1) }}{% else %}{{ a == b }}"
                             "{% endif %}{% endmacro %}{{ f([1], [1], 45) }}",
    "shared dict doubled": "{% set ns = namespace(d={}) %}{% for i in range(80) %}"
                           "{% set ns.d = {'a': ns.d, 'b': ns.d} %}{% endfor %}{{ ns.d | string | length }}",
    "wide JSON indent": "{{ [[[[1]]]] | tojson(indent=10 ** 7) }}",
    "huge output": "{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}",
    "lone surrogate written": "{{ '\\ud800' }}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_ends_in_one_error_in_any_thread(source):
    error, seconds = in_thread(lambda: chat.render(source, HELLO))
    assert isinstance(error, QmtpError), f"{type(error).__name__}: {error}"
    assert "\n" not in str(error) and "chat template" in str(error)
    assert seconds < 4 * SECONDS + 2


@pytest.mark.parametrize("source", ["{{ 2 ** (2 ** 40) }}", "{{ 'a' | center(10 ** 11) }}",
                                   "{% autoescape 'a' | center(10 ** 11) %}x{% endautoescape %}"])
def test_compiling_folds_no_constant(source):
    """Jinja evaluates constant expressions while compiling: `{{ 2 ** 2 ** 40 }}` hung `doctor`. A child process,
    so that a hang is a timeout here, not a stuck test run."""
    code = (f"import time; from qmtp import chat; t = time.perf_counter(); chat._compile({source!r}); "
            f"print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 5


def test_the_time_limit_is_a_setting(monkeypatch):
    source = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    monkeypatch.setattr(template_bounds, "LIMITS", template_bounds.TemplateLimits(seconds=0.2))
    error, seconds = in_thread(lambda: chat.render(source, HELLO))
    assert isinstance(error, TemplateError) and "time limit of 0.2 s" in str(error)
    assert seconds < 2


def test_limits_must_be_positive():
    for bad in (dict(seconds=0), dict(chars=-1), dict(depth=float("nan")), dict(int_bits=True)):
        with pytest.raises(TemplateError, match="must be a positive number"):
            template_bounds.TemplateLimits(**bad)


def test_ordinary_templates_render_as_before():
    """The bounds leave a real family template, arithmetic and filters alone (test_chat.py compares whole
    renderings with transformers')."""
    text = chat.render(QWEN, HELLO, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    small = ("{{ 2 ** 10 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ 'a' ~ 1 }} {{ '%5d' % 42 }} "
             "{{ '{:>4}'.format('x') }} {{ 'x' | center(5) }} {{ [1, 2] | sum }} {{ 3.14159 | round(2) }} "
             "{{ 'a-b' | replace('-', '+') }} {{ ['a', 'b'] | join(', ') }}")
    assert chat.render(small, HELLO) == "1024 3 1 ababab [1, 2] a1    42    x   x   3 3.14 a+b a, b"


def test_the_error_names_the_template(tmp_path):
    directory = tokenizer_dir(tmp_path)
    (directory / chat.TEMPLATE_FILE).write_text("{{ 1 / 0 }}")
    tokenizer = Tokenizer.from_dir(directory)
    with pytest.raises(TemplateError, match=r"chat_template\.jinja: the chat template fails: ZeroDivisionError"):
        tokenizer.apply_chat_template(HELLO)
    assert tokenizer.encode("raw text is fine")


# ---- the text around a template --------------------------------------------------------------------------------
def tokenizer_dir(tmp_path: Path, config_changes: dict | None = None) -> Path:
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    shutil.copy(TINY / "tokenizer.json", directory)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    config.update(config_changes or {})
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tiny_model():
    import qmtp

    return qmtp.load(TINY)


@pytest.mark.parametrize("where", ["message", "system", "tool", "template variable"])
def test_a_lone_surrogate_in_the_messages_is_one_error(tiny_model, where):
    messages = [{"role": "user", "content": "hi"}]
    options = {}
    if where == "message":
        messages = [{"role": "user", "content": "bad \ud800 text"}]
    elif where == "system":
        messages = [{"role": "system", "content": "\udfff"}] + messages
    elif where == "tool":
        options["tools"] = [{"type": "function", "function": {"name": "f\ud83d"}}]
    else:
        options["chat_template_kwargs"] = {"note": "\ud800"}
    import qmtp

    with pytest.raises(UsageError, match="lone surrogate"):
        if "tools" in options:
            tiny_model.tokenizer.apply_chat_template(messages, **options)
        else:
            qmtp.generate(tiny_model, messages=messages, max_tokens=1, **options)


def test_a_lone_surrogate_in_a_prompt_or_a_template_output_is_one_error(tiny_model):
    import qmtp

    with pytest.raises(UsageError, match="prompt: holds a lone surrogate"):
        qmtp.generate(tiny_model, "story \ud800", max_tokens=1)
    with pytest.raises(UsageError, match="lone surrogate"):
        tiny_model.tokenizer.encode("\udc80")
    with pytest.raises(UsageError, match="lone surrogate"):
        tiny_model.tokenizer.encode_batch(["fine", "\udc80"])
    with pytest.raises(UsageError, match="chat template's output: holds a lone surrogate"):
        tiny_model.tokenizer.apply_chat_template(HELLO, chat_template="{{ '\\udc80' }}")


def test_chat_template_kwargs_may_name_the_generation_arguments(tiny_model):
    import qmtp

    plain = qmtp.generate(tiny_model, messages=HELLO, enable_thinking=False, max_tokens=1)
    named = qmtp.generate(tiny_model, messages=HELLO, max_tokens=1,
                          chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": True,
                                                "tokenize": True})
    assert named.prompt_tokens == plain.prompt_tokens
    same = qmtp.generate(tiny_model, messages=HELLO, enable_thinking=False, max_tokens=1,
                         chat_template_kwargs={"enable_thinking": False})
    assert same.prompt_tokens == plain.prompt_tokens
    refused = {"given twice": dict(enable_thinking=True, chat_template_kwargs={"enable_thinking": False}),
               "add_generation_prompt must be True": dict(chat_template_kwargs={"add_generation_prompt": False}),
               "tokenize must be True": dict(chat_template_kwargs={"tokenize": False}),
               "not a variable name": dict(chat_template_kwargs={1: 2}),
               "apply_chat_template sets it": dict(chat_template_kwargs={"special_tokens": {}})}
    for message, options in refused.items():
        with pytest.raises(UsageError, match=message):
            qmtp.generate(tiny_model, messages=HELLO, max_tokens=1, **options)


def test_a_conversation_takes_enable_thinking_in_its_kwargs(tiny_model):
    from qmtp import Conversation

    conversation = Conversation(tiny_model, chat_template_kwargs={"enable_thinking": False}, max_tokens=1)
    assert conversation.next_prompt("hi").endswith("</think>\n\n")


def test_a_message_that_contains_itself_is_one_error(tiny_model):
    message = {"role": "user", "content": "hi"}
    message["self"] = message
    parts = [{"type": "text", "text": "x"}]
    parts.append(parts)
    deep = current = []
    for _ in range(10_000):
        current.append([])
        current = current[0]
    for messages, error in (([message], "contains itself"), ([{"role": "user", "content": parts}], "contains itself"),
                            ([{"role": "user", "content": "x", "data": deep}], "nested more than")):
        with pytest.raises(UsageError, match=error):
            tiny_model.tokenizer.apply_chat_template(messages)


def test_named_templates_without_a_default_load(tmp_path):
    named = [{"name": "tool_use", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
             {"name": "rag", "template": "R"}]
    tokenizer = Tokenizer.from_dir(tokenizer_dir(tmp_path, {"chat_template": named}))
    assert tokenizer.chat_template is None
    assert tokenizer.decode(tokenizer.encode("raw text")) == "raw text"
    with pytest.raises(UsageError, match="names its chat templates 'tool_use', 'rag' but none 'default'"):
        tokenizer.apply_chat_template(HELLO)
    assert tokenizer.apply_chat_template(HELLO, chat_template="tool_use") == "[Hello]"


def test_named_templates_with_a_default_use_it(tmp_path):
    named = [{"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]
    tokenizer = Tokenizer.from_dir(tokenizer_dir(tmp_path, {"chat_template": named}))
    assert tokenizer.apply_chat_template(HELLO) == "D"
    assert tokenizer.apply_chat_template(HELLO, chat_template="rag") == "R"


def test_a_damaged_template_list_is_refused(tmp_path):
    from qmtp.errors import CheckpointError

    with pytest.raises(CheckpointError, match="list of"):
        Tokenizer.from_dir(tokenizer_dir(tmp_path, {"chat_template": [{"name": "default"}]}))


# ---- the command line --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["{{ 2 ** (2 ** 40) }}", "{{ 1 / 0 }}", "{% if true %}" * 3000])
@pytest.mark.parametrize("command", ["doctor", "chat"])
def test_doctor_and_chat_say_one_line_and_exit_2(tmp_path, source, command):
    directory = tmp_path / "model"
    shutil.copytree(TINY, directory, ignore=shutil.ignore_patterns("previous_head", "*.png", "*curve*"))
    (directory / chat.TEMPLATE_FILE).write_text(source)
    argv = [str(directory)] + (["--prompt", "hi", "--max-tokens", "2"] if command == "chat" else [])
    done = subprocess.run([sys.executable, "-m", "qmtp", command, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("qmtp: error:") and "chat template" in errors[0], done.stderr


def test_a_deadline_never_strikes_after_its_render(monkeypatch):
    """The watchdog raises in the rendering thread at the deadline: a render that ends just then must withdraw
    it, so that no stray exception strikes the code that runs next. Deadlines around a render's length, and a
    short switch interval so that the watchdog gets the interpreter when its deadline comes."""
    source = "{% for i in range(3000) %}{{ i }}{% endfor %}"
    chat.render(source, HELLO)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.00005)

    def many():
        outcomes = set()
        for seconds in (0.0002, 0.0004, 0.0008, 0.0016):
            monkeypatch.setattr(template_bounds, "LIMITS", template_bounds.TemplateLimits(seconds=seconds))
            for _ in range(150):
                try:
                    chat.render(source, HELLO)
                    outcomes.add("rendered")
                except TemplateError:
                    outcomes.add("stopped")
                sum(range(20_000))  # Python code after the render, where a stray exception would land
        return outcomes

    try:
        outcomes, _ = in_thread(many)
    finally:
        sys.setswitchinterval(interval)
    assert isinstance(outcomes, set), f"{type(outcomes).__name__}: {outcomes}"


def test_deadlines_striking_in_several_threads_never_leave_the_watchdog_locked(monkeypatch):
    """Four threads render at deadlines around a render's length at once (as the server's engine thread and a
    caller do): a deadline that lands while a thread registers or withdraws its watch must not leave the
    watchdog's lock held, or every later render in the process waits for it forever (it did)."""
    source = "{% for i in range(3000) %}{{ i }}{% endfor %}"
    chat.render(source, HELLO)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.00005)
    monkeypatch.setattr(template_bounds, "LIMITS", template_bounds.TemplateLimits(seconds=0.0005))

    def many():
        for _ in range(120):
            try:
                chat.render(source, HELLO)
            except TemplateError:
                pass
        return "done"

    try:
        threads = [threading.Thread(target=many, daemon=True) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a rendering thread waits on the watchdog"
    finally:
        sys.setswitchinterval(interval)
    monkeypatch.setattr(template_bounds, "LIMITS", template_bounds.TemplateLimits())
    result, _ = in_thread(lambda: chat.render("{{ 'still renders' }}", HELLO))
    assert result == "still renders"
