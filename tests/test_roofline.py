"""bench/roofline.py: its floor arithmetic on a toy shape and a --quick run on the tiny fixture checkpoint (offline)."""

import json, os, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
roofline = pytest.importorskip("roofline")

TOY = roofline.ModelShape("toy", layers=2, q_dim=8, kv_dim=4, vocab=10, matmul_params=1000, head_params=100,
                          total_params=1100, muon_shapes=[(4, 8)], adamw_params=1068)


def test_train_flops_count_tokens_prompts_and_attention():
    w = roofline.Workload(prompts=2, samples=3, new_tokens=4, prompt_tokens=5)
    trained = 2 * 1000 * 6 * 4                             # 2 x matmul params x (rows x new tokens)
    prompts = 2 * 2 * 900 * 5                              # each group's prompt once through the body (no head)
    keys_new = sum(p + 1 for p in range(5, 9))             # keys seen by the new positions 5..8
    keys_prompt = sum(p + 1 for p in range(5))
    attention = 4 * 8 * 2 * (6 * keys_new + 2 * keys_prompt)
    assert roofline.train_flops(TOY, w) == pytest.approx(3 * (trained + prompts + attention))
    assert roofline.ns_flops(TOY) == 5 * (4 * 16 * 8 + 2 * 64)


def test_rollout_floor_is_bytes_when_compute_is_free():
    w = roofline.Workload(prompts=1, samples=2, new_tokens=3, prompt_tokens=4)
    seconds, bound, flops, nbytes = roofline.rollout_floor(TOY, w, gflops=1e12, gbs=1.0, value_bytes=4)
    kv = 2 * 4 * 2 * 4                                     # keys + values x kv_dim x layers x bytes, per position
    expected = 3 * 4000 + (4 + 2 * 1) * kv + (4 + 2 * 2) * kv   # prefill + 2 decode steps: weights + cache so far
    assert nbytes == expected and seconds == pytest.approx(expected / 1e9) and bound == 0 and flops > 0


def test_onednn_product_is_the_product():
    import torch
    a, b = torch.randn(96, 64), torch.randn(80, 64)
    product = roofline.onednn_product(a, b)
    if product is None:
        pytest.skip("this torch has no oneDNN linear: the peak is torch.mm's alone")
    expected = a @ b.T                                     # 64-term sums of N(0, 1) products: |x| about 8
    assert torch.allclose(product(), expected, atol=1e-4)  # float32 rounding of 64 terms: ~1e-6 relative


def test_quick_run_on_the_fixture(tmp_path):
    out = tmp_path / "roofline.json"
    cmd = [sys.executable, str(ROOT / "bench" / "roofline.py"), "--quick", "--threads", "1", "--models", "d4,smollm2",
           "--nanochat-base", str(ROOT / "tests" / "fixtures" / "nanochat" / "head"), "--nanochat-tag", "d3",
           "--smollm2", str(tmp_path / "no-smollm2"), "--json", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "cores" in p.stdout.splitlines()[0] and "| training, `t_train` |" in p.stdout
    report = json.loads(out.read_text())
    assert report["machine"]["float32"]["gflops"] > 0 and report["machine"]["bandwidth"]["read_gbs"] > 0
    assert report["machine"]["float32"]["kernel"] in ("torch.mm", "oneDNN linear")
    (model,) = report["models"]
    assert model["shape"]["name"] == "nanochat d3" and len(model["measured"]) == 1
    assert model["measured_step_s"] > 0 and all(f > 0 for f in model["step_floors_at_measured_s"])
    assert "python bench/smollm2.py" in report["skipped"][0]


def test_the_gsm8k_steps_flags_are_its_recipe(tmp_path):
    "`--models qwen` trains with nanorl.real's GSM8K Config: the flags parse back to the same settings."
    from nanorl.config import config_from_args
    from nanorl.real import real_config

    flags = roofline.qwen_flags(tmp_path, 384)
    cfg, recipe = config_from_args(flags), real_config(tmp_path, task="gsm8k")
    for name in ("task", "examples_per_step", "num_samples", "device_batch_size", "max_new_tokens", "lr", "truncated",
                 "dtype", "temperature", "top_k"):
        assert getattr(cfg, name) == getattr(recipe, name), name
    message = roofline.qwen_run(roofline.parse_args(["--qwen", str(tmp_path / "none"), "--models", "qwen"]))
    assert "python bench/qwen_coder.py" in message and "none" in message
