"""The trainer with vLLM as its rollout engine (`--engine vllm`), and the importance-sampling flags of either engine.

The flag and correction tests run everywhere; the runs through vLLM skip where it does not import (it installs on
Linux x86-64 only, `make setup`), and run on this course's CPU machines.
"""

import json, math, os, shutil, subprocess, sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

from doubles import FIXTURES, demo_sft, small_run
from nanorl.engine import Engine
from nanorl.loss import token_logp
from nanorl.model import Sampler
from nanorl.rollout import Sampling, collate, collate_logprobs, rollout, sample_seeds, trained_rows
from nanorl.tasks import Arithmetic
from nanorl.step import Pass, Policy, backward_passes, step_normalizer
from nanorl.train import Config, Trainer, config_from_args, main, train, validate
from nanorl.vllm_engine import import_vllm, rollout_engine

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
GAP = 1e-4  # the trainer's promise in float32 (tests/test_on_policy.py); vLLM's float32 kernels keep it (test_vllm.py)
GRAD_RTOL = 1e-4  # two float32 paths to the same gradient (shared-prompt pass against the plain one): test_on_policy

try:
    import_vllm()
    NO_VLLM = None
except ImportError as e:
    NO_VLLM = f"vLLM does not import here: {str(e)[:300]}"
needs_vllm = pytest.mark.skipif(NO_VLLM is not None, reason=NO_VLLM or "")


# ---------------------------------------------------------------- flags (no vLLM needed)


def test_vllm_engine_needs_a_hugging_face_folder():
    "--engine vllm on a nanochat checkpoint stops before loading anything, saying why; the flags parse and check."
    with pytest.raises(ValueError, match="value embeddings, calculator tool loop"):
        validate(Config(engine="vllm"))
    with pytest.raises(SystemExit) as e:
        main(["--engine", "vllm", "--device-type", "cpu"])
    assert "nanorl.train: error: --engine vllm needs --model-path" in str(e.value)
    cfg = config_from_args(["--engine", "nanorl", "--is-correction", "mask", "--is-cap", "1.5"])
    assert (cfg.engine, cfg.is_correction, cfg.is_cap) == ("nanorl", "mask", 1.5)
    assert (Config().engine, Config().is_correction, Config().is_cap) == ("nanorl", "none", 2.0)
    with pytest.raises(ValueError, match="--is-correction must be one of"):
        validate(Config(is_correction="clip"))
    with pytest.raises(ValueError, match="--is-cap must be > 0"):
        validate(Config(is_cap=0.0))
    with pytest.raises(ValueError, match="--engine must be one of"):
        validate(Config(engine="sglang", model_path="x"))


@pytest.fixture(scope="module")
def demo_batch():
    "The demo model, one group of 4 samples with the engine's log-probs, collated: (model, pass, sampler log-probs)."
    model, tok = demo_sft()
    task = Arithmetic(n=8, seed=0, split="train")
    batch = rollout(Engine(model, tok), tok, task, [3], Sampling(4, 24, 1.0, None), sample_seeds(0, 0, [3]), 4)
    seqs, masks, logps = trained_rows(batch, range(4))
    inputs, targets = collate(seqs, masks, tok.encode_special("<|assistant_end|>"))
    return model, inputs, targets, collate_logprobs(logps)


def shifted(sampled, targets):
    "The engine's log-probs moved by -0.5, -0.02, 0.02 or 0.5 per trained token: ratios 1.65, 1.02, 0.98, 0.61."
    shifts = torch.tensor([0.5, 0.02, -0.02, -0.5])[torch.arange(targets.numel()) % 4].view(targets.shape)  # (B, T)
    return sampled - shifts, shifts


@pytest.mark.parametrize("mode", ["none", "tis", "mask"])
def test_is_correction_weights_reach_the_gradient(demo_batch, mode):
    "Sampler log-probs off by known amounts: tis weighs each token by min(ratio, cap), mask drops those past the cap."
    model, inputs, targets, sampled = demo_batch
    other, shifts = shifted(sampled, targets)
    mask, adv, cap = targets != -1, torch.tensor([1.0, -0.5, 0.25, -0.75]), 1.2
    cfg = Config(temperature=1.0, top_k=0, loss_norm="token", is_correction=mode, is_cap=cap)
    norm = step_normalizer(cfg.loss_norm, [targets], cfg.max_new_tokens, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    stats = backward_passes(Policy(model, autocast=torch.autocast("cpu", enabled=False)),
                            [Pass(inputs, targets, torch.arange(4), 0, other)], adv, cfg.sampling(), cfg.loss_settings(),
                            norm)
    ours = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    assert stats["outside"] == (shifts.abs() == 0.5)[mask].sum().item()  # ratios 1.65 and 0.61 leave [0.9, 1.1]
    model.zero_grad(set_to_none=True)  # the same loss written out: -sum(weight * advantage * logp) / tokens
    logp = token_logp(model, inputs, targets, sampler=Sampler(1.0, None))  # (B, T)
    ratio = torch.exp(logp.detach() - other)  # (B, T)
    weight = {"none": torch.ones_like(ratio), "tis": ratio.clamp(max=cap), "mask": (ratio <= cap).float()}[mode]
    (-(weight * adv[:, None] * logp)[mask].sum() / mask.sum()).backward()
    for a, p in zip(ours, model.parameters()):
        b = torch.zeros_like(p) if p.grad is None else p.grad
        assert (a - b).abs().max() <= GRAD_RTOL * b.abs().max().clamp(min=1e-12)
    if mode == "mask":
        assert ((ratio > cap) & mask).sum() > 0, "some tokens were dropped"
    model.zero_grad(set_to_none=True)


def demo_config(tmp_path, name, **changes):
    "A one-step run on a copy of the demo's SFT model (its step 0 has reward signal) with nanorl's engine."
    base = tmp_path / name
    shutil.copytree(FIXTURES / "demo_sft", base)
    argv = small_run(task="arithmetic", model_tag="d3", max_new_tokens=24, num_steps=1, eval_every=1000)
    return config_from_args([*argv, "--base-dir", str(base), *[w for k, v in changes.items() for w in (k, v)]])


def test_is_correction_flags_on_a_run(tmp_path):
    "With nanorl's engine the ratio is 1 within 1e-4: a cap of 2 changes nothing; a cap below 1 is refused."
    none, tis, mask = (train(demo_config(tmp_path, m, **{"--is-correction": m, "--is-cap": "2"}))[0]
                       for m in ("none", "tis", "mask"))
    assert none["reward"] == tis["reward"] == mask["reward"], "the same samples: the flag acts in the loss only"
    assert none["loss"] != 0 and none["is_ratio_outside"] == 0 and none["logp_gap_max"] <= GAP
    for corrected in (tis, mask):                          # every ratio is inside [1/2, 2]: weight 1, no token masked
        assert math.isclose(corrected["loss"], none["loss"], rel_tol=1e-6)
        assert math.isclose(corrected["grad_norm"], none["grad_norm"], rel_tol=1e-4)
    assert "t_sync" not in none  # nanorl's engine samples from the policy itself: nothing to sync
    for m in ("tis", "mask"):                              # below 1 the on-policy tokens themselves would be cut
        with pytest.raises(ValueError, match=f"--is-cap 0.5 is below 1.*--is-correction {m}"):
            train(demo_config(tmp_path, f"{m}-low", **{"--is-correction": m, "--is-cap": "0.5"}))


# ---------------------------------------------------------------- through vLLM


@pytest.fixture(scope="module")
def head32(tmp_path_factory):
    "A tiny random Qwen2 folder vLLM's CPU backend accepts (head_dim 32)."
    if NO_VLLM:
        pytest.skip(NO_VLLM)
    from doubles import save_tiny_qwen2_head32  # needs transformers, as vLLM does

    return save_tiny_qwen2_head32(tmp_path_factory.mktemp("vllm_train") / "qwen2")


def vllm_records(cmd, out, tmp):
    "Run a training command with its own TMPDIR; its per-step records, after checking vLLM left no folder behind."
    p = subprocess.run(cmd, env={**ENV, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "Traceback" not in p.stderr, f"run failed ({p.returncode}):\n{p.stderr[-5000:]}"
    assert not list(Path(tmp).glob("nanorl-vllm-*")), "vLLM's copy of the folder was not deleted"
    (metrics,) = Path(out).glob("chatrl_checkpoints/*/metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def hf_run(folder, tmp_path, name, *extra, launcher=None):
    """(command, output directory, temporary directory) of a 2-step run on the tiny Qwen2 folder.

    The entropy bonus makes step 0's gradient non-zero even where all rewards tie, so step 1 samples after a real
    update: without the sync its gap is about 2 (measured), with it within GAP."""
    out, tmp = tmp_path / name, tmp_path / f"{name}_tmp"
    tmp.mkdir()
    cmd = [*(launcher or [sys.executable, "-m", "nanorl.train"]), "--model-path", str(folder), "--output-dir",
           str(out), *small_run(lr="1e-3", num_steps=2, eval_every=1, rollout_rows=16, entropy_coef=0.1), *extra]
    return cmd, out, tmp


@needs_vllm
def test_cli_two_steps_through_vllm(head32, tmp_path):
    "`python -m nanorl.train --engine vllm` exits 0 with the gap, the ratio metric and the sync time at every step."
    recs = vllm_records(*hf_run(head32, tmp_path, "vllm", "--engine", "vllm", "--is-correction", "tis"))
    assert [r["step"] for r in recs] == [0, 1]
    assert recs[0]["grad_norm"] > 0, "step 0 updates the weights"
    for r in recs:  # step 1 sampled after a sync: a stale vLLM would be a whole update away from the trainer
        assert 0 <= r["logp_gap_mean"] <= r["logp_gap_max"] <= GAP, r
        assert r["is_ratio_outside"] == 0 and r["t_sync"] > 0 and "pass@1" in r, r
    theirs = vllm_records(*hf_run(head32, tmp_path, "nanorl", "--engine", "nanorl"))
    assert [r["step"] for r in theirs] == [0, 1] and all(r["logp_gap_max"] <= GAP for r in theirs)
    assert all("t_sync" not in r for r in theirs)


@needs_vllm
@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_ranks_each_with_its_own_vllm(head32, tmp_path, sharding):
    "torchrun, 2 gloo ranks: each rank's vLLM samples its problems and is synced (under FSDP from gathered weights)."
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                "nanorl.train"]
    recs = vllm_records(*hf_run(head32, tmp_path, "ranks", "--engine", "vllm", *sharding, launcher=launcher))
    assert [r["step"] for r in recs] == [0, 1] and recs[0]["grad_norm"] > 0
    assert all(r["logp_gap_max"] <= GAP and r["is_ratio_outside"] == 0 and r["t_sync"] > 0 for r in recs), recs


@needs_vllm
def test_trainer_step_syncs_vllm_to_the_updated_weights(head32, tmp_path):
    "After Trainer.step, vLLM's greedy continuation is nanorl's engine's on the updated weights, not the old one."
    from doubles import toy_tasks

    cfg = validate(Config(model_path=str(head32), engine="vllm", output_dir=str(tmp_path), device_type="cpu",
                          examples_per_step=2, num_samples=4, device_batch_size=4, max_new_tokens=8, lr=1e-2,
                          entropy_coef=0.1, rollout_rows=8, num_steps=2, seed=7))
    trainer = Trainer(cfg, tasks=toy_tasks(cfg))
    try:
        prompt = trainer.tokenizer.render_for_completion(trainer.val_task[0])
        greedy = dict(num_samples=1, max_tokens=16, temperature=0.0)
        before = trainer.engine.generate_many([prompt], **greedy)
        assert before == Engine(trainer.model, trainer.tokenizer).generate_many([prompt], **greedy)
        record = trainer.step(0)
        trainer.model.eval()
        after = trainer.engine.generate_many([prompt], **greedy)
        assert after == Engine(trainer.model, trainer.tokenizer).generate_many([prompt], **greedy)
        assert after != before and record["t_sync"] > 0 and record["grad_norm"] > 0
    finally:
        trainer.engine.close()


@needs_vllm
def test_a_head_size_vllms_cpu_backend_lacks_is_named_before_it_starts(tmp_path):
    "Head size 16 (the project's other tiny folders) has no CPU attention kernel: a ValueError saying what to use."
    from doubles import save_tiny_hf_model

    save_tiny_hf_model("qwen2", tmp_path / "qwen2_head16")
    with pytest.raises(ValueError, match="has 16: sample with --engine nanorl"):
        rollout_engine(None, None, torch.device("cpu"), str(tmp_path / "qwen2_head16"))
