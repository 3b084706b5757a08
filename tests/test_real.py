"""nanorl.real: the reply's final number, the missing-folder error, the recipe's settings."""

import subprocess, sys

import pytest

from nanorl.real import FinalNumber, final_number, real_config, real_tasks, smollm2_path
from nanorl.rewards import reference_answer


@pytest.mark.parametrize(
    "text, number",
    [
        ("Tom has 5 + 14 = 19 pens.", "19"),
        ("1,200 apples", "1200"),
        ("It fell to -3", "-3"),
        ("2.50 dollars, so 7.0", "7"),
        ("the answer is 19.", "19"),
        ("no digits", None),
        ("", None),
    ],
)
def test_final_number(text, number):
    assert final_number(text) == number


@pytest.mark.parametrize("task", ["one-step", "multi-step"])
def test_tasks_are_disjoint_and_scored_by_the_last_number(task):
    train, held_out = real_tasks(seed=0, task=task)
    questions = lambda t, n: {t[i]["messages"][0]["content"] for i in range(n)}
    assert not questions(train, 2000) & questions(held_out, 500), "a held-out question is also a training question"
    conv = held_out[3]
    ref = reference_answer(conv, nanochat_compat=False)
    assert held_out.reward(conv, f"{ref} or {int(ref) + 2}") == 0.0
    assert held_out.reward(conv, f"so {ref}") == held_out.evaluate(conv, f"so {ref}") == 1.0
    assert isinstance(held_out, FinalNumber) and conv["messages"][-1]["role"] == "assistant"


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench/smollm2.py"):
        smollm2_path(tmp_path / "nothing")
    p = subprocess.run(
        [sys.executable, "-m", "nanorl.real", "--model-path", str(tmp_path / "nothing")], capture_output=True, text=True
    )
    assert p.returncode != 0 and str(tmp_path / "nothing") in p.stderr and "config.json" in p.stderr


def test_recipe_trains_the_folder_with_adamw_at_its_rate(tmp_path):
    "real_config's run: the folder as --model-path, the changes applied; one AdamW at its rate over every parameter."
    from doubles import save_tiny_hf_model
    from nanorl.start import build_optimizer, load_policy
    from nanorl.train import validate

    save_tiny_hf_model("llama", tmp_path / "m")
    cfg = validate(real_config(tmp_path / "m", str(tmp_path / "out"), num_steps=7, entropy_coef=0.01))
    assert (cfg.model_path, cfg.num_steps, cfg.entropy_coef, cfg.device_type) == (str(tmp_path / "m"), 7, 0.01, "cpu")
    model = load_policy(cfg, "cpu", 1, 0).model
    opt = build_optimizer(model, cfg)
    groups = [g for o in getattr(opt, "optimizers", [opt]) for g in o.param_groups]
    assert all(type(o).__name__ == "AdamW" for o in getattr(opt, "optimizers", [opt]))
    assert {g["lr"] for g in groups} == {cfg.lr} and sum(len(g["params"]) for g in groups) == len(
        list(model.parameters())
    )


def test_multi_step_task_has_two_or_three_steps_and_room_to_write_them():
    "The multi-step problems chain 2 or 3 calculator steps of + and - (both occur); the run gets 64 new tokens."
    from nanorl.real import real_parser

    train, _ = real_tasks(seed=0, task="multi-step")
    chains = [train.task.problems[i]["steps"] for i in range(300)]
    assert {len(c) for c in chains} == {2, 3} and {op for c in chains for op, _, _ in c} == {"+", "-"}
    assert real_config("m", task="multi-step").max_new_tokens == 64 and real_config("m").max_new_tokens == 48
    assert real_config("m", task="multi-step", max_new_tokens=80).max_new_tokens == 80     # a flag still wins
    with pytest.raises(ValueError, match="one-step, multi-step"):
        real_tasks(task="gsm9k")
    with pytest.raises(SystemExit):
        real_parser().parse_args(["--problems", "gsm9k"])
    assert real_parser().parse_args(["--problems", "multi-step"]).problems == "multi-step"


def test_study_flags_reach_the_config(tmp_path, monkeypatch):
    "The GSM8K study's knobs (group size, temperature, skipped groups, clipping, evaluations) reach the run via main."
    import nanorl.real as real
    from doubles import save_tiny_hf_model

    save_tiny_hf_model("llama", tmp_path / "m")
    seen = []
    summary = dict(before=0.0, before_se=0.0, after=0.0, after_se=0.0, seconds=0.0, plot="p.png")
    monkeypatch.setattr(real, "run_real", lambda cfg: seen.append(cfg) or summary)
    names = ("num_samples", "examples_per_step", "temperature", "skip_zero_signal", "eval_every", "max_grad_norm")
    flags = ["--num-samples", "16", "--examples-per-step", "2", "--temperature", "1.0", "--skip-zero-signal",
             "--eval-every", "5", "--max-grad-norm", "1.0"]
    common = ["--problems", "gsm8k", "--model-path", str(tmp_path / "m"), "--output-dir", str(tmp_path / "out")]
    real.main(common + flags)
    real.main(common)
    assert tuple(getattr(seen[0], k) for k in names) == (16, 2, 1.0, True, 5, 1.0)
    assert tuple(getattr(seen[1], k) for k in names) == (8, 4, 1.0, True, 10, 0.0)      # left out: the recipe's
