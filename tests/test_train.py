"""Training end to end: torchrun with 2 CPU ranks (gloo), and the same update from 1 rank or 2."""
import json, os, shutil, subprocess, sys
from pathlib import Path

import pytest
import torch

from nanorl.checkpoint import load_model
from nanorl.train import Config, config_from_args, train

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "nanochat" / "head"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SMALL = ["--examples-per-step", "2", "--num-samples", "4", "--device-batch-size", "4", "--max-new-tokens", "12",
         "--eval-every", "100", "--eval-examples", "4", "--save-every", "100", "--task", "toy_task:make_tasks",
         "--matrix-lr", "0.05", "--init-lr-frac", "1.0", "--seed", "7"]


def base_dir(tmp_path, name):
    "A nanochat base directory holding the tiny fixture checkpoint and tokenizer."
    d = tmp_path / name
    shutil.copytree(FIXTURE, d)
    return d


def run(nproc, base, *args):
    "Run nanorl.train under torchrun with `nproc` CPU ranks; fail the test with its output if it fails."
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m", "nanorl.train",
           "--device-type", "cpu", "--base-dir", str(base), *SMALL, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def records(base):
    return [json.loads(l) for l in (base / "chatrl_checkpoints" / "d3" / "metrics.jsonl").read_text().splitlines()]


def weights(base, step):
    return torch.load(base / "chatrl_checkpoints" / "d3" / f"model_{step:06d}.pt", weights_only=True)


def test_two_ranks_train_and_agree(tmp_path):
    "2 gloo ranks: finite losses, rewards with signal, identical parameters (checked by the trainer), a loadable checkpoint."
    base = base_dir(tmp_path, "ddp")
    run(2, base, "--num-steps", "3", "--save-every", "2")
    recs = records(base)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in recs)
    assert any(0 < r["reward"] < 1 for r in recs), "the toy reward should vary within groups"
    assert "pass@1" in recs[0] and "pass@1" in recs[-1]
    ckpt = base / "chatrl_checkpoints" / "d3"
    assert {p.name for p in ckpt.glob("*_000002*")} >= {"model_000002.pt", "meta_000002.json", "optim_000002_rank0.pt",
                                                        "optim_000002_rank1.pt", "resume_000002_rank0.pt", "resume_000002_rank1.pt"}
    model, tok, meta = load_model("rl", "cpu", base_dir=base)
    assert meta["nanorl"]["step"] == 2
    assert set(json.loads((ckpt / "meta_000002.json").read_text())["model_config"]) == {
        "sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern"}
    start = torch.load(FIXTURE / "chatsft_checkpoints" / "d3" / "model_000000.pt", weights_only=True)
    moved = max((weights(base, 2)[k].float() - v.float()).abs().max().item() for k, v in start.items())
    assert moved > 1e-4, "training did not change the weights"


@pytest.mark.parametrize("norm", ["nanochat", "token"])
def test_one_rank_equals_two_ranks(tmp_path, norm):
    "One rank with the whole batch and two ranks with half each make the same update."
    one, two = base_dir(tmp_path, "one"), base_dir(tmp_path, "two")
    run(1, one, "--num-steps", "1", "--loss-norm", norm)
    run(2, two, "--num-steps", "1", "--loss-norm", norm)
    assert records(one)[0]["reward"] == records(two)[0]["reward"], "rollouts must not depend on the rank layout"
    w1, w2 = weights(one, 0), weights(two, 0)
    start = torch.load(FIXTURE / "chatsft_checkpoints" / "d3" / "model_000000.pt", weights_only=True)
    for k in w1:
        delta1, delta2 = w1[k].float() - start[k].float(), w2[k].float() - start[k].float()
        torch.testing.assert_close(delta2, delta1, atol=2e-6, rtol=1e-3, msg=lambda m: f"{k}: {m}")
    assert max((w1[k].float() - start[k].float()).abs().max().item() for k in w1) > 1e-4


def test_bad_settings_fail_before_work(tmp_path):
    "Impossible settings are refused with a clear message before any model is loaded or process group started."
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "nanorl.train", "--device-type", "cpu",
                        "--base-dir", str(tmp_path / "nothing"), "--examples-per-step", "3"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "nanorl.train: error: --examples-per-step 3 must be divisible by the number of ranks (2)" in p.stderr
    with pytest.raises(ValueError, match="expected"):
        train(Config(base_dir=str(tmp_path / "nothing"), task="toy_task:make_tasks", device_type="cpu"))
