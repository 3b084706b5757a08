"""--fsdp: the same run as DDP, checkpoints nanochat and transformers load, exact resume after SIGKILL, half memory.

Both run a pass's shared prompt once (`11_loss`), but FSDP2 reduces the prefix call's gradients apart from the rest:
one step is compared within the bounds of tests/rounding.py, and whole runs without the shared prompt bit for bit."""

import json, math, os, shutil, signal, subprocess, sys
from pathlib import Path

import pytest
import torch

from doubles import NANOCHAT_HEAD, base_dir, checkpoints_of, records, save_tiny_hf_model, small_run, step_files, weights
from nanorl.checkpoint import load_model
from nanorl.optim import fast_matmul_dtype
from nanorl.train import Config, validate
from rounding import EVALUATION, GRAD_NORM_RTOL, LOGP_ATOL, assert_same_step, assert_updates_agree, nanochat_muon_names
from harness import ENV, ROOT, TORCHRUN, check
from test_reliability import (
    assert_same_run_end,
    assert_same_tensors,
    train_cmd,
    wait_for_checkpoint,
    worker_pids,
)

TWO_RANKS = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=0", "--monitor-interval=0.2"]
STEPS = ["--num-steps", "6"]  # checkpoints at steps 2, 4 and 5; evaluations at 0, 3 and 5


def two_ranks(base, *args, script=None, steps=STEPS):
    "A two-rank CPU run of the small settings on `base`, as DDP (or `script`'s variant) or with --fsdp in args."
    launcher = TWO_RANKS + ([str(ROOT / "tests" / script)] if script else ["-m", "nanorl.train"])
    return check(
        subprocess.run(
            train_cmd(base, *steps, *args, launcher=launcher), env=ENV, capture_output=True, text=True, timeout=300
        )
    )


def start_weights():
    "The fixture checkpoint every run here starts from."
    return torch.load(NANOCHAT_HEAD / "chatsft_checkpoints" / "d3" / "model_000000.pt", weights_only=True)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    "An unbroken 6-step --fsdp run on two ranks."
    base = base_dir(tmp_path_factory.mktemp("fsdp"), "base")
    two_ranks(base, "--fsdp")
    return base


def test_fsdp_equals_ddp(fsdp_run, tmp_path):
    """Same checkpoint and seed, 2 ranks, one step each: DDP and FSDP sample the same completions from the same weights
    (equal rewards and pass@k), and compute the loss, the gradient and the update within float32 rounding of each
    other (tests/rounding.py's bounds); test_fsdp_is_ddp_to_the_bit compares whole runs where the order is the same."""
    runs = {name: base_dir(tmp_path, name) for name in ("ddp", "fsdp")}
    for name, base in runs.items():
        two_ranks(base, *(["--fsdp"] if name == "fsdp" else []), steps=["--num-steps", "1"])
    (a,), (b,) = (records(base, drop_timing=True) for base in runs.values())
    assert_same_step(a, b)
    assert 0 < a["reward"] < 1, "the toy reward should vary within groups"
    (c,) = gaps_apart([b], records(fsdp_run, drop_timing=True)[:1])
    assert b == c, "the 6-step run's first step is this one (same arithmetic)"
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records(fsdp_run))
    start = start_weights()
    assert_updates_agree(
        start, weights(runs["ddp"], 0), weights(runs["fsdp"], 0), nanochat_muon_names(start), fast_matmul_dtype("cpu")
    )


def test_fsdp_is_ddp_to_the_bit(tmp_path):
    """DDP and FSDP2 with every row running its own prompt: weights, optimizer state and metrics of whole runs equal to
    the bit, but the gradient norm (FSDP sums each rank's squares of its slices, then over ranks: another rounding
    order). With the shared prompt FSDP2 reduces the prefix call's gradients apart from the rest (another rounding
    order, test_fsdp_equals_ddp's bounds); without it the equality does not depend on the CPU: both runs call the
    same kernels on the same shapes in the same order, and two ranks' gradients add to the same float in either order
    (a + b == b + a; halving is exact), so every step's weights, hence its samples, stay bit-equal."""
    ddp, fsdp = base_dir(tmp_path, "ddp"), base_dir(tmp_path, "fsdp")
    two_ranks(ddp, script="unshared_prompt_train.py")
    two_ranks(fsdp, "--fsdp", script="unshared_prompt_train.py")
    load = lambda base, name: torch.load(checkpoints_of(base) / name, weights_only=True)
    for name in ("model_000005.pt", "optim_000005_rank0.pt"):
        assert_same_tensors(load(ddp, name), load(fsdp, name), name)
    a, b = records(ddp, drop_timing=True), records(fsdp, drop_timing=True)
    assert [r.pop("grad_norm") for r in a] == pytest.approx([r.pop("grad_norm") for r in b], rel=GRAD_NORM_RTOL)
    assert a == gaps_apart(a, b)


def gaps_apart(a, b):
    """b's records with a's logp_gap fields where the two lie within LOGP_ATOL (else b's, so the comparison fails). The
    engine's side of the gap comes from packed or plain products as each process's one-time timing decides (notebook
    13_speedups: `onednn_pays`), so two processes may log gaps a rounding apart from the same samples and weights."""
    out = []
    for x, y in zip(a, b, strict=True):
        y = dict(y)
        for k in ("logp_gap_max", "logp_gap_mean"):
            if k in x and k in y and abs(x[k] - y[k]) <= LOGP_ATOL:
                y[k] = x[k]
        out.append(y)
    return out


def test_fsdp_checkpoint_is_nanochats_layout(fsdp_run):
    "The sharded run's checkpoint: nanochat's files, written once, whole tensors that load_model reads."
    ckpt = checkpoints_of(fsdp_run)
    assert {p.name for p in ckpt.glob("*_000005*")} == step_files(5, ranks=2)
    model, _, meta = load_model("rl", "cpu", base_dir=fsdp_run)
    assert meta["nanorl"]["step"] == 5
    saved = torch.load(ckpt / "model_000005.pt", weights_only=True)
    assert all(type(t) is torch.Tensor for t in saved.values())
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    optim = torch.load(ckpt / "optim_000005_rank0.pt", weights_only=True)
    muon = optim["optimizers"][1]["state"]
    assert all(type(s["momentum_buffer"]) is torch.Tensor for s in muon.values())
    shapes = {tuple(t.shape) for t in saved.values()}
    assert all(tuple(s["momentum_buffer"].shape) in shapes for s in muon.values()), "whole matrices, not slices"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_sigkill_then_resume_under_fsdp(fsdp_run, tmp_path):
    "Kill -9 both sharded ranks after the first checkpoint, --resume --fsdp: the run ends as the unbroken one."
    cut = base_dir(tmp_path, "cut")
    launcher = TWO_RANKS + ["-m", "nanorl.train"]
    proc = subprocess.Popen(
        train_cmd(cut, *STEPS, "--fsdp", launcher=launcher),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        killed_after = wait_for_checkpoint(checkpoints_of(cut), proc, ranks=2)
        for pid in worker_pids(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "the run finished before it could be killed"
    assert killed_after < 5 and not (checkpoints_of(cut) / "model_000005.pt").exists()
    p = two_ranks(cut, "--fsdp", "--resume")
    assert "resuming at step" in p.stdout
    assert_same_run_end(fsdp_run, cut, 5, ranks=2)
    assert [r["step"] for r in records(cut)] == list(range(6))


def copy_without(run, dest, pattern):
    "A copy of the run directory `run` at `dest`, its checkpoint files matching `pattern` removed."
    shutil.copytree(run, dest)
    for f in checkpoints_of(dest).glob(pattern):
        f.unlink()
    return dest


def test_resume_on_fewer_ranks_continues(fsdp_run, tmp_path):
    """The 2-rank sharded run cut after step 4 and resumed on 1 rank: step 5 samples from the same step-4 checkpoint
    (the same rewards), and its loss and update agree within the rounding of the other rank layout (one rank sums two
    passes, two ranks one each); the evaluation after the update is not compared (tests/rounding.py)."""
    base = copy_without(fsdp_run, tmp_path / "one", "*_000005*")
    p = check(
        subprocess.run(
            train_cmd(base, *STEPS, "--fsdp", "--resume"), env=ENV, capture_output=True, text=True, timeout=300
        )
    )
    assert "resuming at step 5" in p.stdout
    a, b = records(fsdp_run)[-1], records(base)[-1]
    assert a["step"] == b["step"] == 5
    assert_same_step(a, b, after_update=EVALUATION)
    start = weights(fsdp_run, 4)
    assert_updates_agree(
        start, weights(fsdp_run, 5), weights(base, 5), nanochat_muon_names(start), fast_matmul_dtype("cpu")
    )


def test_resume_on_more_ranks_is_refused(fsdp_run, tmp_path):
    "A checkpoint of 1 rank resumed on 2: a clear error naming the number of ranks that wrote it."
    base = copy_without(fsdp_run, tmp_path / "copy", "resume_*_rank1.pt")
    launcher = TWO_RANKS + ["-m", "nanorl.train"]
    p = subprocess.run(
        train_cmd(base, *STEPS, "--fsdp", "--resume", launcher=launcher),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0
    assert "written by 1 rank(s)" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]


HF_SMALL = small_run(max_new_tokens=10, lr="1e-3", seed=5, num_steps=1)


def test_hf_model_under_fsdp(tmp_path):
    """Qwen2 (tied head) on 2 sharded ranks, one step: DDP's samples, its loss and its update within float32 rounding
    (tests/rounding.py), a step folder transformers loads like load_model."""
    transformers = pytest.importorskip("transformers")
    source = tmp_path / "qwen2"
    save_tiny_hf_model("qwen2", source)
    runs = {}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        cmd = [
            *TWO_RANKS,
            "-m",
            "nanorl.train",
            "--model-path",
            str(source),
            "--output-dir",
            str(tmp_path / name),
            *HF_SMALL,
            *extra,
        ]
        check(subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300))
        runs[name] = tmp_path / name / "chatrl_checkpoints" / "qwen2"
    recs = {k: [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()] for k, d in runs.items()}
    (a,), (b,) = recs["ddp"], recs["fsdp"]
    assert_same_step(a, b)
    assert a["logp_gap_max"] <= 1e-4 and b["logp_gap_max"] <= 1e-4, "sampler and trainer agree on both layouts"
    step = runs["fsdp"] / "step_000000"
    ids = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(3))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    ours, _, _ = load_model(step, "cpu")
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max() < 1e-5
    state = lambda folder: load_model(folder, "cpu")[0].state_dict()
    assert_updates_agree(state(source), state(runs["ddp"] / "step_000000"), ours.state_dict())  # AdamW: every tensor


def test_fsdp_holds_half_of_ddp(tmp_path):
    """A 20M-parameter GPT on 2 gloo ranks: FSDP holds half of DDP's weights, gradients and optimizer state (as the
    formula says) and its training step peaks lower."""
    measured = {}
    for mode in ("ddp", "fsdp"):
        out = tmp_path / mode
        out.mkdir()
        cmd = [*TWO_RANKS, str(ROOT / "tests" / "fsdp_memory_script.py"), mode, str(out)]
        check(
            subprocess.run(
                cmd, env={**ENV, "MALLOC_MMAP_THRESHOLD_": "65536"}, capture_output=True, text=True, timeout=300
            )
        )
        measured[mode] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for mode, ranks in measured.items():
        for m in ranks:
            for k, held in m["held"].items():
                assert held == pytest.approx(m["formula"][k], rel=1e-3), (mode, k)
    ddp, fsdp = (sum(measured[m][0]["held"].values()) for m in ("ddp", "fsdp"))
    assert 0.49 < fsdp / ddp < 0.51
    if measured["ddp"][0]["peak_train"]:  # Linux: the resident set's high-water mark
        assert measured["fsdp"][0]["peak_train"] < 0.85 * measured["ddp"][0]["peak_train"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(fsdp=True, skip_zero_signal=True), "--skip-zero-signal"),
        (dict(dist_timeout_min=0), "--dist-timeout-min"),
        (dict(fsdp=True, device_type="mps"), "--fsdp"),
    ],
)
def test_fsdp_flags_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        validate(Config(**change))
