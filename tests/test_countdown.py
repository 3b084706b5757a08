"countdown_reward never raises or hangs, and agrees with an independent exact evaluation on generated expressions."

import random, time
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from doubles import ReplyEngine, load_fixture_model, save_tiny_hf_model, tiny_chat_tokenizer
from nanorl.engine import Engine
from nanorl.evaluate import sample_outcomes
from nanorl.chat import template_messages
from nanorl.rollout import Sampling, collate, completion_text, prompt_ids, rollout, sample_seeds
from nanorl.step import score
from nanorl.rewards import countdown_reward
from nanorl.tasks import COUNTDOWN_SYSTEM, Countdown, CountdownShaping
from nanorl.config import Config, config_from_args, validate
from nanorl.start import make_tasks

NUMS = st.lists(st.integers(1, 99), min_size=3, max_size=4)
ANSWER_CHARS = st.sampled_from(list("0123456789+-*/() =.x^÷×\n\t") + ["**", "//", "<answer>", "</answer>", "١"])


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300), NUMS, st.integers(-5, 200))
def test_any_text_gives_zero_or_one(text, nums, target):
    assert countdown_reward(text, nums, target) in (0.0, 1.0)


@settings(max_examples=400, deadline=None)
@given(st.lists(ANSWER_CHARS, max_size=60).map("".join), NUMS, st.integers(1, 100))
def test_answer_like_text_gives_zero_or_one(body, nums, target):
    assert countdown_reward(f"<think>x</think><answer>{body}</answer>", nums, target) in (0.0, 1.0)


def test_hostile_inputs_are_fast_and_zero():
    hostile = [
        "<answer>" + "(" * 10_000 + "1" + ")" * 10_000 + "</answer>",
        "<answer>" + "9" * 100_000 + " * " + "9" * 100_000 + "</answer>",
        "<answer>" + "1+" * 50_000 + "1</answer>",
        "<answer>" * 50_000 + "</answer>" * 50_000,
        "<answer>" + " " * 100_000 + "</answer>",
        "<answer>\u0661 + 2 + 3</answer>",
    ]
    for text in hostile:
        start = time.perf_counter()
        assert countdown_reward(text, [1, 2, 3], 6) == 0.0
        assert time.perf_counter() - start < 2.0


def exact_eval(expr):
    "Our own generated expression, evaluated by Python over Fractions (never model text)."
    try:
        return eval(_fractions(expr), {"F": Fraction})
    except ZeroDivisionError:
        return None


def _fractions(expr):
    "Wrap every integer literal of our expression in F(...)."
    out, num = [], ""
    for ch in expr + " ":
        if ch.isdigit():
            num += ch
            continue
        if num:
            out.append(f"F({num})")
            num = ""
        out.append(ch)
    return "".join(out)


def random_expression(rng, nums):
    "A random full binary expression over nums, each once, in random order."
    terms = [str(n) for n in rng.sample(nums, len(nums))]
    while len(terms) > 1:
        i, j = sorted(rng.sample(range(len(terms)), 2))
        b, a = terms.pop(j), terms.pop(i)
        terms.append(f"({a} {rng.choice('+-*/')} {b})")
    return terms[0]


def test_agrees_with_exact_evaluation():
    rng, hits = random.Random(0), 0
    for _ in range(3000):
        nums = [rng.randint(1, 20) for _ in range(rng.choice((3, 4)))]
        expr = random_expression(rng, nums)
        value = exact_eval(expr)
        target = int(value) if value is not None and value.denominator == 1 else rng.randint(1, 100)
        want = 1.0 if value is not None and value == target else 0.0
        assert countdown_reward(f"<answer>{expr}</answer>", nums, target) == want, (expr, nums, target)
        hits += want == 1.0
        if want:  # the same answer with a wrong target, a missing number, an extra one
            assert countdown_reward(f"<answer>{expr}</answer>", nums, target + 1) == 0.0
            assert countdown_reward(f"<answer>{expr}</answer>", nums + [1], target) == 0.0
            assert countdown_reward(f"<answer>{expr}</answer>", nums[1:], target) == 0.0
    assert hits > 300


def test_cli_task_countdown():
    validate(config_from_args(["--task", "countdown"]))  # the command line accepts it
    train_task, held_out = make_tasks(Config(task="countdown", seed=0))
    assert isinstance(train_task, Countdown) and isinstance(held_out, Countdown) and len(train_task) > len(held_out) > 0
    conv = train_task[0]
    assert train_task.reward(conv, conv["messages"][-1]["content"]) == 1.0


def test_cli_task_class():
    train_task, held_out = make_tasks(Config(task="doubles:SplitToyTask"))
    assert (len(train_task), len(held_out)) == (8, 4)
    assert held_out.evaluate(held_out[0], " ok ") and not held_out.evaluate(held_out[0], "no")  # evaluate from reward
    with pytest.raises(ValueError, match="doubles:NoRewardTask.*lacks reward"):
        make_tasks(Config(task="doubles:NoRewardTask"))
    with pytest.raises(ValueError, match="unknown --task 'gsm9k'"):
        make_tasks(Config(task="gsm9k"))


# ------------------------------------------------------------------ both tokenizers, and a fixed start of the turn

R1_PREFIX = "Let me solve this step by step.\n<think>"


def test_countdown_renders_and_is_rewarded_with_nanochat_tokenizer(tok):
    "nanochat's format: the Countdown system prompt leads the first user turn; the reference reply, decoded, scores 1."
    task = Countdown("train", n=8, seed=0)
    for i in range(len(task)):
        conv = task[i]
        answer = conv["messages"][-1]["content"]
        ids, mask = tok.render_conversation(conv)
        assert tok.decode(ids).startswith("<|bos|><|user_start|>" + COUNTDOWN_SYSTEM + "\n\nNumbers: ")
        assert tok.decode([t for t, m in zip(ids, mask) if m]) == answer + "<|assistant_end|>"
        prompt = prompt_ids(tok, conv)
        assert prompt == tok.render_for_completion(conv) == ids[: len(prompt)]
        for reply, want in [(answer, 1.0), (answer.replace("<answer>", "<answer>1 + "), 0.0)]:
            seq = prompt + tok.encode(reply)
            assert task.reward(conv, completion_text(tok, seq, len(prompt), conv)) == want


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_countdown_renders_and_is_rewarded_with_a_chat_template(family, tmp_path):
    "A real chat template: Countdown's system prompt replaces the template's default; ids are transformers'."
    import transformers

    chat = tiny_chat_tokenizer(family, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    task = Countdown("train", n=8, seed=0)
    for i in range(len(task)):
        conv = task[i]
        messages = template_messages(conv)
        prompt = prompt_ids(chat, conv)
        assert prompt == hf.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)["input_ids"]
        text = chat.decode(prompt)
        assert text.count(COUNTDOWN_SYSTEM) == 1 and text.index(COUNTDOWN_SYSTEM) < text.index("Numbers: ")
        if family == "qwen":
            assert text.startswith(f"<|im_start|>system\n{COUNTDOWN_SYSTEM}<|im_end|>\n<|im_start|>user\nNumbers: ")
            assert "You are Qwen" not in text
        answer = conv["messages"][-1]["content"]
        ids, mask = chat.render_conversation(conv)
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
        assert chat.decode([t for t, m in zip(ids, mask) if m]).strip() == answer + chat.decode([chat.end_of_turn_id])
        assert task.reward(conv, completion_text(chat, prompt + chat.encode(answer), len(prompt), conv)) == 1.0
    if family == "qwen":  # without Countdown's system message, the template's own default would lead the prompt
        bare = chat.decode(prompt_ids(chat, Countdown("train", n=1, seed=0, system=None)[0]))
        assert "You are Qwen" in bare and COUNTDOWN_SYSTEM not in bare


def prefix_engines(tok, tmp_path):
    "(name, tokenizer, model, end of the generation prompt) for nanochat's fixture model and a tiny Qwen2 folder."
    from nanorl.llama import load_llama

    save_tiny_hf_model("qwen2", tmp_path / "qwen2")
    chat = tiny_chat_tokenizer("qwen", tmp_path / "qwen2")
    return [
        ("nanochat", tok, load_fixture_model("head"), "<|assistant_start|>"),
        ("qwen2", chat, load_llama(tmp_path / "qwen2").eval(), "<|im_start|>assistant\n"),
    ]


def test_assistant_prefix_is_prompt_not_trained_and_rewarded(tok, tmp_path):
    "The prefix's tokens end the prompt after the generation prompt, the loss skips them, the reward sees them."
    task = Countdown("train", n=4, seed=0, assistant_prefix=R1_PREFIX, shaping=CountdownShaping(format_weight=0.5))
    reply = task[0]["messages"][-1]["content"][len(R1_PREFIX) :]
    for name, tk, model, generation_prompt in prefix_engines(tok, tmp_path):
        rendered = list(tk.render_for_completion(task[0]))
        prompt = prompt_ids(tk, task[0])
        assert prompt == rendered + tk.encode(R1_PREFIX), name
        assert tk.decode(prompt).endswith(generation_prompt + R1_PREFIX), name
        sampling, seeds = Sampling(num_samples=3, max_new_tokens=5), sample_seeds(0, 0, [0, 1])
        batch = rollout(Engine(model, tk), tk, task, [0, 1], sampling, seeds, rollout_rows=8)  # the engine continues
        assert batch.prompts[0] == prompt
        for r, (seq, m) in enumerate(zip(batch.sequences, batch.masks)):
            p = batch.prompts[r // 3]
            assert seq[: len(p)] == p and m[: len(p)] == [0] * len(p) and len(seq) > len(p), name
        _, targets = collate(batch.sequences, batch.masks, pad_id=0)
        assert (targets[0, : len(prompt) - 1] == -1).all(), name  # no prefix token is ever a target
        # a reply that only closes the think block the prefix opened: right and formatted, as the reward sees it
        scripted = rollout(ReplyEngine(tk, reply), tk, task, [0], Sampling(num_samples=2), [0], rollout_rows=8)
        scores = score(task, scripted)
        assert scores.rewards.tolist() == [1.5, 1.5], name
        assert task.reward(task[0], reply) == 1.0  # the same text without the prefix: no format term
        outcomes = sample_outcomes(ReplyEngine(tk, reply), tk, task, [0], Sampling(num_samples=2)).outcomes
        assert outcomes.tolist() == [[True, True]], name
