"""Training end to end: torchrun with 2 CPU ranks (gloo), and the same update from 1 rank or 2."""

import json, os, shutil, subprocess, sys
from pathlib import Path

import pytest
import torch

import nanorl.rundir as R
import nanorl.step as S
import nanorl.train as T
from harness import ROOT, TORCHRUN, run_checked
from doubles import NANOCHAT_HEAD as FIXTURE, base_dir, records, small_run, step_files, weights
from nanorl.checkpoint import load_model
from nanorl.rundir import release_run_dir
from nanorl.optim import fast_matmul_dtype
from nanorl.config import PRESETS
from nanorl.start import load_policy
from nanorl.train import Config, config_from_args, lr_multiplier, train
from rounding import assert_same_step, assert_updates_agree, nanochat_muon_names

SMALL = small_run(device_type=None, eval_examples=4, matrix_lr=0.05, init_lr_frac=1.0)


def torchrun_train(nproc, base, *args):
    "Run nanorl.train under torchrun with `nproc` CPU ranks; fail the test with its output if it fails."
    cmd = [
        TORCHRUN,
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "nanorl.train",
        "--device-type",
        "cpu",
        "--base-dir",
        str(base),
        *SMALL,
        *args,
    ]
    return run_checked(cmd)


def test_two_ranks_train_and_agree(tmp_path):
    "2 gloo ranks: finite losses, rewards with signal, identical parameters, a loadable checkpoint."
    base = base_dir(tmp_path, "ddp")
    torchrun_train(2, base, "--num-steps", "3", "--save-every", "2")
    recs = records(base)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in recs)
    assert any(0 < r["reward"] < 1 for r in recs), "the toy reward should vary within groups"
    assert "pass@1" in recs[0] and "pass@1" in recs[-1]
    ckpt = base / "chatrl_checkpoints" / "d3"
    assert {p.name for p in ckpt.glob("*_000002*")} == step_files(2, ranks=2)
    model, tok, meta = load_model("rl", "cpu", base_dir=base)
    assert meta["nanorl"]["step"] == 2
    assert set(json.loads((ckpt / "meta_000002.json").read_text())["model_config"]) == {
        "sequence_len",
        "vocab_size",
        "n_layer",
        "n_head",
        "n_kv_head",
        "n_embd",
        "window_pattern",
    }
    start = torch.load(FIXTURE / "chatsft_checkpoints" / "d3" / "model_000000.pt", weights_only=True)
    moved = max((weights(base, 2)[k].float() - v.float()).abs().max().item() for k, v in start.items())
    assert moved > 1e-4, "training did not change the weights"


@pytest.mark.parametrize("norm", ["nanochat", "token"])
def test_one_rank_equals_two_ranks(tmp_path, norm):
    """One rank with the whole batch and two ranks with half each make the same update: one step from the same
    weights, so the same samples (rollouts must not depend on the rank layout) and the same record; the loss, the
    gradient and the update agree within the rounding of summing the two passes on one rank or across two
    (tests/rounding.py's bounds)."""
    one, two = base_dir(tmp_path, "one"), base_dir(tmp_path, "two")
    torchrun_train(1, one, "--num-steps", "1", "--loss-norm", norm)
    torchrun_train(2, two, "--num-steps", "1", "--loss-norm", norm)
    (a,), (b,) = records(one, drop_timing=True), records(two, drop_timing=True)
    assert_same_step(a, b)
    w1, w2 = weights(one, 0), weights(two, 0)
    start = torch.load(FIXTURE / "chatsft_checkpoints" / "d3" / "model_000000.pt", weights_only=True)
    assert_updates_agree(start, w1, w2, nanochat_muon_names(start), fast_matmul_dtype("cpu"))
    assert max((w1[k].float() - start[k].float()).abs().max().item() for k in w1) > 1e-4



def test_ddp_with_the_fused_loss_leaves_every_rank_identical(tmp_path):
    """Two DDP ranks on the CPU train with the fused loss; after their steps every rank's parameters are the same
    bytes (the trainer's end-of-run check, then the fingerprints compared here), and a change on one rank is caught."""
    base, out = base_dir(tmp_path, "fused"), tmp_path / "reports"
    out.mkdir()
    script = ROOT / "tests" / "ddp_ranks_script.py"
    run_checked([TORCHRUN, "--standalone", "--nproc_per_node=2", script, "--device-type", "cpu", "--base-dir", base,
                 *SMALL, "--num-steps", "2"], env={"NANORL_TEST_OUT": str(out)})
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["fused"] for r in reports), "the CPU ranks did not run the fused loss"
    assert reports[0]["fingerprint"] == reports[1]["fingerprint"], "the ranks' parameters differ after DDP steps"
    assert all(r["caught"] for r in reports), "a parameter changed on one rank was not caught"
    assert [r["step"] for r in records(base)] == [0, 1] and all(r["grad_norm"] > 0 for r in records(base))

def test_bad_settings_fail_before_work(tmp_path):
    "Impossible settings are refused with a clear message before any model is loaded or process group started."
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [
            TORCHRUN,
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "nanorl.train",
            "--device-type",
            "cpu",
            "--base-dir",
            str(tmp_path / "nothing"),
            "--examples-per-step",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "nanorl.train: error: --examples-per-step 3 must be divisible by the number of ranks (2)" in p.stderr
    with pytest.raises(
        ValueError, match=r"expected checkpoints for source 'sft' in .*nothing.*found no such directory"
    ):
        train(Config(base_dir=str(tmp_path / "nothing"), task="doubles:toy_tasks", device_type="cpu"))


# ---------------------------------------------------------------- in-process runs of each option (smoke size)


def step_config(base, **kw):
    "One step of the small run, in-process; evaluation at step 0 only."
    return Config(
        **{
            "device_type": "cpu",
            "base_dir": str(base),
            "examples_per_step": 4,
            "num_samples": 4,
            "device_batch_size": 2,
            "max_new_tokens": 8,
            "eval_every": 100,
            "eval_examples": 2,
            "save_every": 100,
            "task": "doubles:toy_tasks",
            "matrix_lr": 0.05,
            "init_lr_frac": 1.0,
            "seed": 2,
            "num_steps": 1,
            **kw,
        }
    )  # seed 2: one of the 4 groups has no signal


def run_weights(base):
    "The weights of the last checkpoint of the run under `base`."
    d = base / "chatrl_checkpoints" / "d3"
    return torch.load(sorted(d.glob("model_*.pt"))[-1], weights_only=True)


def max_change(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    "The small run with nanochat's defaults: (records, weights)."
    base = base_dir(tmp_path_factory.mktemp("baseline"), "base")
    return train(step_config(base)), run_weights(base)


@pytest.mark.parametrize(
    "option",
    [
        dict(advantage="zscore"),
        dict(advantage="rloo"),
        dict(loss_norm="sequence"),
        dict(loss_norm="drgrpo"),
        dict(loss_norm="token"),
    ],
)
def test_option_trains(tmp_path, monkeypatch, baseline, option):
    "Each variant trains on the same samples (finite loss and gradient, weights move) through its own code path."
    kinds, real_normalizer = [], S.loss_normalizer
    monkeypatch.setattr(S, "loss_normalizer", lambda kind, **kw: kinds.append(kind) or real_normalizer(kind, **kw))
    base = base_dir(tmp_path, "run")
    recs = train(step_config(base, **option))
    assert all(
        torch.isfinite(torch.tensor([r["loss"], r["grad_norm"], r["entropy"], r["sampled_nll"]])).all() for r in recs
    )
    assert recs[0]["reward"] == baseline[0][0]["reward"], "the option must not change the samples"
    assert kinds == [option.get("loss_norm", "nanochat")]
    w = run_weights(base)
    assert max_change(w, load_fixture()) > 1e-5
    if "loss_norm" not in option:  # the normalizations differ only in scale here (every completion hits the
        assert max_change(w, baseline[1]) > 1e-7, f"{option} made the same update as the default"  # token limit), which
        # Adam's and Muon's first step do not see


def load_fixture():
    return torch.load(FIXTURE / "chatsft_checkpoints" / "d3" / "model_000000.pt", weights_only=True)


def test_skip_zero_signal_gives_the_same_update(tmp_path, baseline):
    "--skip-zero-signal leaves no-signal passes out but counts them in the normalizer: bitwise the same weights."
    recs = train(step_config(base := base_dir(tmp_path, "skip"), skip_zero_signal=True))
    assert recs[0]["zero_signal_frac"] > 0, "the test needs a step with a zero-signal group"
    assert recs[0]["loss"] == baseline[0][0]["loss"]
    w = run_weights(base)
    assert all(torch.equal(w[k], baseline[1][k]) for k in w)


def test_skip_zero_signal_when_every_group_is_skipped(tmp_path):
    "A step with every pass skipped still steps the optimizers (zero gradients): the weights as without the flag."
    runs = {}
    for skip in (False, True):
        base = base_dir(tmp_path, f"zero{int(skip)}")
        recs = train(
            step_config(base, task="doubles:make_zero_tasks", num_steps=2, weight_decay=0.1, skip_zero_signal=skip)
        )
        assert all(r["zero_signal_frac"] == 1 and r["loss"] == 0 for r in recs)
        runs[skip] = run_weights(base)
    assert all(torch.equal(runs[True][k], runs[False][k]) for k in runs[False])
    assert max_change(runs[False], load_fixture()) > 0, "weight decay should move the weights even without signal"


def test_cosine_schedule_and_logged_lr(tmp_path):
    "The logged lr is the lm_head group's base rate x init_lr_frac x the schedule, for linear and cosine."
    from nanorl.model import GPT  # noqa: F401  (setup_optimizers is patched onto GPT)

    cfg = step_config(base_dir(tmp_path, "cos"), num_steps=3, lr_schedule="cosine", init_lr_frac=0.5)
    recs = train(cfg)
    model, _, _ = load_model("sft", "cpu", base_dir=cfg.base_dir)
    base_lr = model.setup_optimizers(
        unembedding_lr=cfg.unembedding_lr, embedding_lr=cfg.embedding_lr, matrix_lr=cfg.matrix_lr
    ).param_groups[0]["lr"]
    for r in recs:
        assert r["lr"] == pytest.approx(base_lr * 0.5 * lr_multiplier(r["step"], 3, "cosine"), rel=1e-12)
    assert recs[1]["lrm"] == pytest.approx(0.75) and recs[1]["lrm"] != pytest.approx(1 - 1 / 3)


def test_bfloat16_on_cpu(tmp_path):
    "--dtype bfloat16 runs rollouts, evaluation and the update under CPU autocast."
    recs = train(step_config(base := base_dir(tmp_path, "bf16"), dtype="bfloat16"))
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"], r["pass@1"]])).all() for r in recs)
    assert "first@1" in recs[0], "nanochat's first@k is logged beside pass@k"
    assert max_change(run_weights(base), load_fixture()) > 1e-5


def test_kl_reference_is_the_source_model_after_resume(tmp_path):
    "--kl-coef changes the update once the policy has moved; a resumed run's KL reference is the source checkpoint."
    base, plain = base_dir(tmp_path, "kl"), base_dir(tmp_path, "plain")
    recs = train(step_config(base, num_steps=2, save_every=1, kl_coef=0.5))
    train(step_config(plain, num_steps=2))
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in recs)
    assert max_change(run_weights(base), run_weights(plain)) > 1e-7, "the KL term did not change the second update"
    policy = load_policy(step_config(base, num_steps=3, kl_coef=0.5, resume=True, allow_changes=True),
                         torch.device("cpu"), 1, 0)
    assert policy.resume["step"] == 2
    source, trained = load_fixture(), run_weights(base)
    ref = policy.reference.state_dict()
    assert all(torch.equal(ref[k].float(), source[k].float()) for k in source)
    assert all(torch.equal(v.float(), trained[k].float()) for k, v in policy.model.state_dict().items())
    assert not all(p.requires_grad for p in policy.reference.parameters())
    release_run_dir(policy.out)  # load_policy claimed the run directory; train() would release it at the end


# ---------------------------------------------------------------- presets and distributed details (no training)


def test_config_preset_applies_in_train(tmp_path, monkeypatch):
    "train(Config(preset=...)) runs the preset's settings for every field left at its default."
    seen = []

    class Recorder:
        engine = None  # train() closes the engine of the Trainer it ran
        out = tmp_path / "unused"  # and lets go of its run directory
        model = torch.nn.Linear(1, 1)  # whose size decides whether glibc keeps freed pages

        def __init__(self, cfg, rank, world, device, tasks):
            seen.append(cfg)

        def run(self):
            return []

    monkeypatch.setattr(T, "Trainer", Recorder)
    train(Config(preset="demo", base_dir=str(tmp_path), num_samples=4))
    cfg = seen[0]
    demo = PRESETS["demo"]
    assert (cfg.task, cfg.device_type, cfg.top_k, cfg.examples_per_step) == tuple(
        demo[k] for k in ("task", "device_type", "top_k", "examples_per_step")
    )
    assert demo["num_samples"] != 4 and cfg.num_samples == 4, "a field set explicitly keeps its value"
    assert cfg.max_new_tokens == demo["max_new_tokens"] != Config().max_new_tokens, "the preset must change something"
    with pytest.raises(ValueError, match="known presets: smoke, demo|known presets: demo, smoke"):
        train(Config(preset="nope", base_dir=str(tmp_path)))


def test_resume_agreement_tensor_is_on_the_run_device(tmp_path, monkeypatch):
    "The all-reduce that agrees on the resume step gets a tensor on the run's device (nccl reduces only GPU tensors)."
    seen = []

    class Reduced(Exception):
        pass

    def fake_all_reduce(t, op=None):
        seen.append(t.device)
        raise Reduced

    monkeypatch.setattr(R, "_read_resume_files", lambda out, step, device, rank: ("state", "optim", {"step": step}))
    monkeypatch.setattr(R.dist, "all_reduce", fake_all_reduce)
    with pytest.raises(Reduced):
        R.load_resume_point(tmp_path, [4, 2], torch.device("meta"), world_size=2, rank=1)
    assert seen == [torch.device("meta")]


def test_max_grad_norm_reaches_the_update(tmp_path, monkeypatch):
    "--max-grad-norm is the limit each step's update clips to (0, the default, is none: nanochat's)."
    seen, update = [], T.update
    monkeypatch.setattr(T, "update", lambda *a: seen.append(a[3]) or update(*a))
    train(step_config(base_dir(tmp_path, "clip"), max_grad_norm=0.5))
    train(step_config(base_dir(tmp_path, "noclip")))
    assert seen == [0.5, 0.0]
