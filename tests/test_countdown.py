"countdown_reward never raises or hangs, and agrees with an independent exact evaluation on generated expressions."

import random, time
from fractions import Fraction

from hypothesis import given, settings, strategies as st

from nanorl.tasks import Countdown, countdown_reward
from nanorl.train import Config, make_tasks

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
    train_task, held_out = make_tasks(Config(task="countdown", seed=0))
    assert isinstance(train_task, Countdown) and isinstance(held_out, Countdown) and len(train_task) > len(held_out) > 0
    conv = train_task[0]
    assert train_task.reward(conv, conv["messages"][-1]["content"]) == 1.0


def test_cli_task_class():
    import pytest

    train_task, held_out = make_tasks(Config(task="doubles:SplitToyTask"))
    assert (len(train_task), len(held_out)) == (8, 4)
    assert held_out.evaluate(held_out[0], " ok ") and not held_out.evaluate(held_out[0], "no")  # evaluate from reward
    with pytest.raises(TypeError, match="doubles:NoRewardTask.*lacks reward"):
        make_tasks(Config(task="doubles:NoRewardTask"))
    with pytest.raises(ValueError, match="unknown --task 'gsm9k'"):
        make_tasks(Config(task="gsm9k"))
