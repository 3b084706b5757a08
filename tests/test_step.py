"""One step written once: `rl_loop` and `Trainer.step` call the four phases of `nanorl.step`, and from the same weights
and samples they make the same update, on the demo's GPT and on a tiny Hugging Face model, at every normalization.

The tolerance is rounding's (tests/rounding.py, `assert_updates_agree`): with the CPU fast paths off both run the same
arithmetic and agree to the bit in practice, but the bound is what the claim needs on any CPU kind. With them on
(the trainer's default) the loss is the fused one and the rollout packs its weights, so the samples are compared
first: they come from identical weights, and a near tie is the only way they could differ."""

import ast
import inspect
import textwrap

import pytest
import torch

import nanorl.step
from doubles import FIXTURES, LengthTask, demo_sft, save_tiny_hf_model
from rounding import assert_updates_agree, nanochat_muon_names
from nanorl.checkpoint import load_model
from nanorl.rundir import release_run_dir
from nanorl.config import Config
from nanorl.loop import rl_loop
from nanorl.loss import NORMALIZATIONS
from nanorl.optim import fast_matmul_dtype
from nanorl.tasks import Arithmetic
from nanorl.start import build_optimizer
from nanorl.train import Trainer

PHASES = ("sample", "score", "learn", "update")


def calls(fn) -> set[str]:
    "Names of the functions called by name in `fn`'s body."
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def test_loop_and_trainer_call_the_same_four_phases():
    "Both bodies call sample, score, learn and update, and each name is nanorl.step's function."
    for fn in (rl_loop, Trainer.step):
        assert set(PHASES) <= calls(fn), f"{fn.__qualname__} calls {sorted(calls(fn))}"
        for name in PHASES:
            assert fn.__globals__[name] is getattr(nanorl.step, name), f"{fn.__qualname__}: {name} is not the step's"
    assert all(getattr(nanorl.step, name).__module__ == "nanorl.step" for name in PHASES)


def trainer_step(cfg, tasks):
    "The weights before and after the trainer's step 0, and the step's record."
    trainer = Trainer(cfg, tasks=tasks)
    try:
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        record = trainer.step(0)
        return start, trainer.model.state_dict(), record
    finally:
        release_run_dir(trainer.out)


def loop_step(model, tokenizer, cfg, task):
    "The weights after one `rl_loop` step with the trainer's settings and optimizer, and its mean reward."
    rewards = rl_loop(model, tokenizer, task, steps=1, problems=cfg.examples_per_step, sampling=cfg.sampling(),
                      settings=cfg.loss_settings(), optimizer=build_optimizer(model, cfg))
    return model.state_dict(), rewards[0]


def demo_step_config(tmp_path, **changes):
    "The demo preset's step on the fixture's SFT model: 4 problems x 8 answers."
    return Config(preset="demo", base_dir=str(FIXTURES / "demo_sft"), output_dir=str(tmp_path), num_steps=10,
                  examples_per_step=4, eval_every=1000, save_every=1000, **changes)


@pytest.mark.parametrize("norm", NORMALIZATIONS)
def test_loop_step_is_the_trainers_on_the_demo_model(tmp_path, norm):
    "The demo's GPT (Muon and AdamW): the loop's update is the trainer's, within rounding's bounds."
    from nanorl.config import resolve_preset

    cfg = resolve_preset(demo_step_config(tmp_path, loss_norm=norm, cpu_fast_paths=False))
    task = Arithmetic(n=4000, seed=cfg.seed, split="train")                   # the trainer's --task arithmetic
    start, theirs, record = trainer_step(cfg, (task, Arithmetic(n=8, seed=1, split="test")))
    model, tokenizer = demo_sft()
    ours, reward = loop_step(model, tokenizer, cfg, task)
    assert reward == record["reward"] and 0 < reward < 1                      # the same samples, a signal
    assert_updates_agree(start, ours, theirs, nanochat_muon_names(start), fast_matmul_dtype("cpu"))


def test_loop_step_is_the_trainers_with_the_fast_paths(tmp_path):
    "The trainer's default on a CPU (fused loss, packed weights): the same samples, the same update within rounding."
    from nanorl.config import resolve_preset

    cfg = resolve_preset(demo_step_config(tmp_path))
    assert cfg.cpu_fast_paths
    task = Arithmetic(n=4000, seed=cfg.seed, split="train")
    start, theirs, record = trainer_step(cfg, (task, Arithmetic(n=8, seed=1, split="test")))
    model, tokenizer = demo_sft()
    ours, reward = loop_step(model, tokenizer, cfg, task)
    if reward != record["reward"]:
        pytest.skip("a near tie sampled another token under the packed weights: the samples differ, nothing to compare")
    assert_updates_agree(start, ours, theirs, nanochat_muon_names(start), fast_matmul_dtype("cpu"))


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    "A tiny random Qwen3 folder written by transformers."
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf") / "qwen3"
    save_tiny_hf_model("qwen3", folder)
    return folder


@pytest.mark.parametrize("norm", NORMALIZATIONS)
def test_loop_step_is_the_trainers_on_a_hugging_face_model(tmp_path, qwen3_folder, norm):
    "A tiny Qwen3 (AdamW) on a task a random model can vary the reward of: the same update within rounding."
    cfg = Config(model_path=str(qwen3_folder), output_dir=str(tmp_path), device_type="cpu", lr=1e-3, num_steps=10,
                 examples_per_step=2, num_samples=4, device_batch_size=4, max_new_tokens=12, eval_every=1000,
                 save_every=1000, seed=0, loss_norm=norm, cpu_fast_paths=False)
    start, theirs, record = trainer_step(cfg, (LengthTask(), LengthTask()))
    model, tokenizer, _ = load_model(str(qwen3_folder), "cpu", phase="train")
    ours, reward = loop_step(model, tokenizer, cfg, LengthTask())
    assert reward == record["reward"] and 0 < reward < 1
    assert_updates_agree(start, ours, theirs)                                  # AdamW's bound for every tensor
