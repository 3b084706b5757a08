"""bench/trl_learning.py without TRL: the reward wrapper, the recipe's knobs, the clocks, the evaluation points, the
"fraction of TRL's time" and the records, table and plot written from fake records (offline, seconds)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import trl_learning as tl  # noqa: E402

from nanorl.real import real_tasks  # noqa: E402

STOP = 5


class DigitTokenizer:
    "Decodes ids to text; the stop token decodes to a digit, so a reply decoded with it ends in another number."
    pieces = {0: "Sam has 21 eggs. ", 1: "The answer is ", 2: "21", 3: "7", STOP: "5"}

    def decode(self, ids):
        "The pieces of the ids, joined."
        return "".join(self.pieces[i] for i in ids)


@pytest.fixture(scope="module")
def task():
    "The real run's training task (FinalNumber over generated word problems)."
    train, _ = real_tasks(0)
    assert "Sam has 11 eggs. Sam buys 10 more." in train[0]["messages"][0]["content"]   # the answer is 21
    return train


def test_reward_is_nanorls_and_zero_for_a_cut_reply(task):
    "nanorl's reward of the text without its stop token; 0 for a reply with no stop token when zero_cut."
    rewards = lambda ids, zero_cut: tl.completion_rewards(task, DigitTokenizer(), [0] * len(ids), ids, {STOP}, zero_cut)
    right_stopped, right_cut, wrong_stopped = [1, 2, STOP], [0, 1, 2], [1, 3, STOP]
    assert rewards([right_stopped, right_cut, wrong_stopped], zero_cut=True) == [1.0, 0.0, 0.0]
    assert rewards([right_stopped, right_cut, wrong_stopped], zero_cut=False) == [1.0, 1.0, 0.0]
    assert task.reward(task[0], "The answer is 21") == 1.0 and task.reward(task[0], "The answer is 215") == 0.0
    assert rewards([[1, 2]], zero_cut=True) == [0.0] and rewards([[]], zero_cut=False) == [0.0]
    with pytest.raises(ValueError):                       # one reward per completion, or an error
        tl.completion_rewards(task, DigitTokenizer(), [0, 0], [[1, 2]], {STOP}, True)


def test_recipe_knobs_are_nanorls_recipe():
    "The recipe arm's GRPOConfig knobs, read from nanorl's RECIPE and the HF model's AdamW."
    assert tl.recipe_knobs() == dict(
        learning_rate=3e-5, lr_scheduler_type="linear", warmup_steps=0, optim="adamw_torch", adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=0.0, beta=0.0, loss_type="bnpo",
        scale_rewards="none", num_iterations=1, temperature=0.7, top_k=50, top_p=1.0, max_completion_length=48)
    assert tl.recipe_knobs("dapo")["loss_type"] == "dapo"
    assert tl.batch_shape() == dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8)


def test_defaults_arm_sets_no_learning_knob_but_the_work():
    "The defaults arm sets the batch shape, steps, seed, float32 and no checkpointing, no learning knob."
    args = tl.parse_args(["--steps", "7", "--seed", "3"])
    defaults, recipe = tl.arm_settings("defaults", args), tl.arm_settings("recipe", args)
    learning = set(tl.recipe_knobs()) - set(tl.batch_shape())
    assert not learning & set(defaults) and learning <= set(recipe)
    assert defaults["max_steps"] == recipe["max_steps"] == 7 and defaults["seed"] == 3
    assert defaults["bf16"] is False and defaults["gradient_checkpointing"] is False
    assert {k: defaults[k] for k in tl.batch_shape()} == tl.batch_shape()


def test_clock_leaves_out_paused_spans():
    "Wall and CPU seconds since start, less the paused spans."
    now = {"wall": 100.0, "cpu": 10.0}
    clock = tl.Clock(wall=lambda: now["wall"], cpu=lambda: now["cpu"])
    clock.start()
    now.update(wall=105.0, cpu=12.0)
    with clock.paused():                                  # a save: 30 s, 20 CPU-s, not counted
        now.update(wall=135.0, cpu=32.0)
    now.update(wall=140.0, cpu=35.0)
    assert clock.read() == {"wall_s": 10.0, "cpu_s": 5.0}


def test_nanorl_evaluations_map_to_updates():
    "Each nanorl evaluation is placed after the updates it saw, with the clocks read at it."
    assert [tl.eval_updates(s, 40, 10) for s in (0, 10, 20, 30, 39)] == [0, 10, 20, 30, 40]
    assert [tl.eval_updates(s, 2, 1) for s in (0, 1)] == [0, 2]        # the last step evaluates after its update
    metrics = [{"step": 0, "pass@1": 0.1, "pass@1_se": 0.01, "eval_stop_rate": 0.5}, {"step": 1},
               {"step": 2, "pass@1": 0.4, "pass@1_se": 0.02}]                   # 3 steps, evaluated every 2
    clocks = [{"wall_s": 0.0, "cpu_s": 0.0}, {"wall_s": 9.0, "cpu_s": 17.0}]
    points = tl.nanorl_points(metrics, clocks, num_steps=3, eval_every=2)
    assert [(p["step"], p["wall_s"], p["pass@1"], p["stop_rate"]) for p in points] == [(0, 0.0, 0.1, 0.5),
                                                                                      (3, 9.0, 0.4, None)]
    with pytest.raises(SystemExit):
        tl.nanorl_points(metrics, clocks[:1], num_steps=3, eval_every=2)
    assert tl.step_seconds([{"t_rollout": 1.0, "t_reward": 0.5, "t_train": 2.0}]) == [3.5]


def point(step, wall, p, cpu=None):
    "An evaluation point."
    return {"step": step, "wall_s": wall, "cpu_s": 2 * wall if cpu is None else cpu, "pass@1": p, "pass@1_se": 0.05}


def test_fraction_of_trls_time():
    "nanorl's first time at or above TRL's final pass@1, over TRL's time; the goal needs <= 1/3 and ending above."
    nanorl = [point(0, 0, 0.1), point(10, 60, 0.5), point(20, 120, 0.7)]
    trl = [point(0, 0, 0.1), point(20, 600, 0.45)]
    r = tl.reach_fraction(nanorl, trl)
    assert (r["nanorl_step"], r["nanorl_s"], r["fraction"], r["ends_at_or_above"], r["goal_met"]) == (10, 60, 0.1,
                                                                                                      True, True)
    assert tl.reach_fraction(nanorl, [point(0, 0, 0.1), point(20, 240, 0.6)])["fraction"] == 0.5   # 120 / 240
    assert not tl.reach_fraction(nanorl, [point(0, 0, 0.1), point(20, 240, 0.6)])["goal_met"]
    never = tl.reach_fraction(nanorl, [point(0, 0, 0.1), point(20, 600, 0.8)])
    assert never["fraction"] is None and not never["ends_at_or_above"] and not never["goal_met"]
    dips = [point(0, 0, 0.1), point(10, 60, 0.5), point(20, 120, 0.3)]        # reached early, ends below: not met
    assert not tl.reach_fraction(dips, trl)["goal_met"] and tl.reach_fraction(dips, trl)["fraction"] == 0.1


def fake_records(settings=None, arms=tl.ARMS):
    "Records of a 20-step comparison: nanorl fast and high, TRL slow and lower."
    settings = settings or dict(steps=20, eval_every=10, eval_examples=64, seed=0, threads=2, cpu="Test CPU",
                                date="2026-01-01 00:00 UTC")
    curves = {"nanorl": [(0, 0, 0.1), (10, 60, 0.5), (20, 120, 0.7)], "recipe": [(0, 0, 0.1), (10, 300, 0.3),
              (20, 600, 0.45)], "defaults": [(0, 0, 0.1), (10, 400, 0.2), (20, 800, 0.25)]}
    knobs = {"set": {"learning_rate": 3e-5}, "default": {"epsilon": 0.2}}
    out = []
    for arm in arms:
        extra = {"step_s_median": 6.0} | ({} if arm == "nanorl" else {"trl_knobs": knobs})
        out += [{"arm": arm, **point(*c), "stop_rate": 0.9, **settings, **extra} for c in curves[arm]]
    return out


def test_records_table_and_plot(tmp_path):
    "The jsonl, the Markdown table with the summary and knobs, and a PNG, from fake records."
    out = tmp_path / "cmp.jsonl"
    records = tl.write_outputs(fake_records(), out)
    assert len(out.read_text().splitlines()) == len(records) == 9
    md = out.with_suffix(".md").read_text()
    assert "| recipe | 20 | 10.00 | 20.00 | 0.450 | 0.050 | 0.900 |" in md
    assert "0.10 of TRL's 10.0 min" in md and "goal met" in md                 # nanorl: 60 s of TRL recipe's 600 s
    assert "| epsilon | no ratio" in md and "0.2 (TRL default)" in md
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    lines = tl.summary_lines(records)
    assert lines[0].startswith("nanorl: final pass@1 0.700") and "goal NOT met" not in lines[3]


def test_a_rerun_of_one_arm_keeps_the_others_with_the_same_settings(tmp_path):
    "--only one arm replaces that arm's records; other settings replace every record."
    out = tmp_path / "cmp.jsonl"
    tl.write_outputs(fake_records(), out)
    rerun = [dict(r, **{"pass@1": 0.9}) for r in fake_records(arms=["recipe"])]
    records = tl.write_outputs(rerun, out)
    assert [r["arm"] for r in records] == ["nanorl"] * 3 + ["recipe"] * 3 + ["defaults"] * 3
    assert {r["pass@1"] for r in records if r["arm"] == "recipe"} == {0.9}
    other = dict(steps=40, eval_every=10, eval_examples=64, seed=0, threads=2, cpu="Test CPU", date="x")
    assert {r["arm"] for r in tl.write_outputs(fake_records(other, arms=["nanorl"]), out)} == {"nanorl"}


def test_base_check_says_when_the_bases_differ():
    "TRL's saved base against nanorl's step 0: equal, or DIFFERENT when far apart."
    records = fake_records()
    assert "(equal;" in tl.base_check(records)[0]
    records[3]["pass@1"] = 0.5                                                  # TRL recipe's base, 8 errors away
    assert "DIFFERENT" in tl.base_check(records)[0] and "(equal;" in tl.base_check(records)[1]


def test_tiny_flag_is_the_smoke_settings():
    "--tiny: 2 steps, an evaluation every step, 4 problems; the flags' checks."
    args = tl.parse_args(["--tiny", "--threads", "1"])
    assert (args.steps, args.eval_every, args.eval_examples, args.threads) == (2, 1, 4, 1)
    assert tl.parse_args([]).only == ["nanorl", "recipe", "defaults"]
    with pytest.raises(SystemExit):
        tl.parse_args(["--steps", "0"])
