"""Chat templates cannot hang or exhaust a run: compiled and rendered in a child process with a time and memory cap."""

import time

import pytest

import nanorl.chat as chat
from doubles import save_tiny_hf_model
from nanorl.chat import ChatTokenizer

PROMPT = [{"role": "user", "content": "1 + 1?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    "A tiny Qwen2 folder's tokenizer, its real template rendered in the child."
    folder = tmp_path_factory.mktemp("qwen2")
    save_tiny_hf_model("qwen2", folder)
    return ChatTokenizer.from_directory(folder)


def hostile(tok, source, name):
    "The one-line error a template ends in, and the seconds it took."
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        ChatTokenizer(tok.tk, source, tok.special, template_source=name).render_text(PROMPT, True)
    return str(e.value), time.monotonic() - t0


@pytest.mark.parametrize("source", [
    "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",   # no hook inside
    "{% set x = lipsum(n=100000000) %}",
    "{% set x = 9 ** (9 ** 9) %}",                                                           # folded at compile time
])
def test_a_template_that_runs_forever_is_stopped(tok, source, monkeypatch):
    "Past its seconds (2 here) the child is killed: a ValueError naming the file, then a fresh child renders on."
    monkeypatch.setattr(chat, "RENDER_SECONDS", 2.0)
    msg, seconds = hostile(tok, source, "hostile.jinja")
    assert msg.startswith("hostile.jinja: ") and "over its budget" in msg and "\n" not in msg, msg
    assert seconds < 2.0 + 1 + 30, seconds                     # its grace second, and a new child's start
    assert tok.render_text(PROMPT, True).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("source", [
    "{% set ns = namespace(s='x') %}{% for i in range(0, 60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>1999999999}'.format('x') }}",
])
def test_a_template_that_fills_memory_is_stopped(tok, source):
    "Texts grown by `~` or formatted wide: out of the child's memory cap (or budget), named, the parent untouched."
    msg, _ = hostile(tok, source, "big.jinja")
    assert msg.startswith("big.jinja: ") and ("out of memory" in msg or "budget" in msg) and "\n" not in msg, msg
    assert tok.render_text(PROMPT, True).endswith("<|im_start|>assistant\n")


def test_a_template_error_is_named_with_its_line(tok):
    "A syntax error and raise_exception: one line each, naming the file."
    msg, _ = hostile(tok, "hello\n{% for %}", "bad.jinja")
    assert msg.startswith("bad.jinja: not a valid chat template (line 2"), msg
    msg, _ = hostile(tok, "{{ raise_exception('no system role') }}", "raise.jinja")
    assert msg == "raise.jinja: the chat template failed (TemplateError: no system role)", msg
