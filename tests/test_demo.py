"""The demo end to end, short: RL raises held-out pass@1 and the training reward; the same run with every advantage 0 does not."""
import json
from pathlib import Path

import pytest

from nanorl.demo import DemoConfig, before_after, run_demo, run_rl


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "The quick demo (seed 0) and its zero-advantage control from the same SFT checkpoint."
    dc = DemoConfig(out_dir=str(tmp_path_factory.mktemp("demo")), seed=0).quick(rl_steps=30)
    summary = run_demo(dc, progress=False)
    control, _ = run_rl(dc, control=True)
    return dc, summary, control


def mean_reward(records, steps):
    return sum(records[s]["reward"] for s in steps) / len(steps)


def test_rl_raises_held_out_pass1(runs):
    "30 RL steps raise pass@1 on 200 held-out problems x 4 samples by >= 10 points (about 4 standard errors of a single estimate)."
    _, s, _ = runs
    assert 0.05 < s["before"] < 0.8, f"the warm-up should leave room to improve, got pass@1 {s['before']:.3f}"
    assert s["after"] - s["before"] >= 0.10, f"pass@1 {s['before']:.3f} -> {s['after']:.3f}"


def test_training_reward_rises(runs):
    "Mean reward of the last 10 steps (1280 samples) beats the first 10 by >= 0.05 (seed 0 gives about 0.10)."
    _, s, _ = runs
    recs = s["records"]
    first, last = mean_reward(recs, range(10)), mean_reward(recs, range(20, 30))
    assert last - first >= 0.05, f"reward {first:.3f} -> {last:.3f}"


def test_zero_advantage_control_does_not_rise(runs):
    "The same run with every advantage 0: same starting pass@1, no gain, a zero loss and no gradient."
    _, s, control = runs
    before, after = before_after(control)
    assert before == s["before"], "the control starts from the same model, problems and seeds"
    assert after - before <= 0.02, f"control pass@1 {before:.3f} -> {after:.3f}"
    assert all(r["reward"] == 0 and r["loss"] == 0 and r["grad_norm"] == 0 for r in control)


def test_run_directory(runs):
    "nanochat layout, plots and a summary in the run directory."
    dc, s, _ = runs
    out = Path(dc.out_dir)
    assert (out / "tokenizer" / "tokenizer.pkl").is_file()
    assert len(list((out / "chatsft_checkpoints" / dc.tag).glob("model_*.pt"))) == 1
    assert (out / "chatrl_checkpoints" / dc.tag / f"model_{dc.rl_steps - 1:06d}.pt").is_file()
    assert (out / "rl_curves.png").stat().st_size > 1000
    saved = json.loads((out / "demo_summary.json").read_text())
    assert saved["before"] == s["before"] and saved["after"] == s["after"]
    assert 2e5 < s["params"] < 2e6
