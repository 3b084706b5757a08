"""--fsdp: the same run as DDP, checkpoints nanochat and transformers load, exact resume after SIGKILL, half memory."""

import json, os, shutil, signal, subprocess, sys
from pathlib import Path

import pytest
import torch

from doubles import base_dir, checkpoints_of, records, save_tiny_hf_model, small_run, step_files
from nanorl.checkpoint import load_model
from nanorl.train import Config, validate
from test_reliability import (
    ENV,
    assert_same_run_end,
    assert_same_tensors,
    check,
    train_cmd,
    wait_for_checkpoint,
    worker_pids,
)

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TWO_RANKS = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=0", "--monitor-interval=0.2"]
STEPS = ["--num-steps", "6"]  # checkpoints at steps 2, 4 and 5; evaluations at 0, 3 and 5


def two_ranks(base, *args, script=None):
    "A two-rank CPU run of the small settings on `base`, as DDP (or `script`'s variant) or with --fsdp in args."
    launcher = TWO_RANKS + ([str(ROOT / "tests" / script)] if script else ["-m", "nanorl.train"])
    return check(
        subprocess.run(
            train_cmd(base, *STEPS, *args, launcher=launcher), env=ENV, capture_output=True, text=True, timeout=300
        )
    )


def rel_diff(a, b):
    "|a - b| / |a| in the Frobenius norm."
    return ((a.float() - b.float()).norm() / a.float().norm().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    "An unbroken 6-step --fsdp run on two ranks."
    base = base_dir(tmp_path_factory.mktemp("fsdp"), "base")
    two_ranks(base, "--fsdp")
    return base


def test_fsdp_equals_ddp(fsdp_run, tmp_path):
    """Same checkpoint and seed, 2 ranks: the same rewards, losses within 1e-5, the same weights up to the float noise
    of DDP's shared prompt (AdamW's eps=1e-10 turns gradient rounding on near-zero entries into visible steps)."""
    ddp = base_dir(tmp_path, "ddp")
    two_ranks(ddp)
    a, b = records(ddp, drop_timing=True), records(fsdp_run, drop_timing=True)
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert any(0 < r["reward"] < 1 for r in a), "the toy reward should vary within groups"
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-8)
    wa, wb = (torch.load(checkpoints_of(x) / "model_000005.pt", weights_only=True) for x in (ddp, fsdp_run))
    assert set(wa) == set(wb)
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and wa[k].shape == wb[k].shape
        assert rel_diff(wa[k], wb[k]) < (1e-5 if k.startswith("transformer.h.") else 2e-4), k  # Muon's / AdamW's


def test_fsdp_is_ddp_without_the_shared_prompt(fsdp_run, tmp_path):
    """DDP doing FSDP's arithmetic (each row runs its own prompt): weights, optimizer state and metrics equal to the
    bit, but the gradient norm (FSDP sums each rank's squares of its slices, then over ranks: another rounding
    order)."""
    ddp = base_dir(tmp_path, "ddp")
    two_ranks(ddp, script="unshared_prompt_train.py")
    load = lambda base, name: torch.load(checkpoints_of(base) / name, weights_only=True)
    for name in ("model_000005.pt", "optim_000005_rank0.pt"):
        assert_same_tensors(load(ddp, name), load(fsdp_run, name), name)
    a, b = records(ddp, drop_timing=True), records(fsdp_run, drop_timing=True)
    assert [r.pop("grad_norm") for r in a] == pytest.approx([r.pop("grad_norm") for r in b], rel=1e-4)
    assert a == b


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
    "The 2-rank sharded run cut after step 4 and resumed on 1 rank: the same last step, up to the ranks' rounding."
    base = copy_without(fsdp_run, tmp_path / "one", "*_000005*")
    p = check(
        subprocess.run(
            train_cmd(base, *STEPS, "--fsdp", "--resume"), env=ENV, capture_output=True, text=True, timeout=300
        )
    )
    assert "resuming at step 5" in p.stdout
    assert records(base)[-1]["reward"] == records(fsdp_run)[-1]["reward"]
    wa, wb = (torch.load(checkpoints_of(x) / "model_000005.pt", weights_only=True) for x in (fsdp_run, base))
    for k in wa:
        assert rel_diff(wa[k], wb[k]) < 2e-4, k


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


HF_SMALL = small_run(max_new_tokens=10, lr="1e-3", seed=5, num_steps=2)


def test_hf_model_under_fsdp(tmp_path):
    "Qwen2 (tied head) on 2 sharded ranks: DDP's rewards and losses, a step folder transformers loads like load_model."
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
    assert [r["reward"] for r in recs["ddp"]] == [r["reward"] for r in recs["fsdp"]]
    for x, y in zip(recs["ddp"], recs["fsdp"]):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-8)
    step = runs["fsdp"] / "step_000001"
    ids = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(3))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    ours, _, _ = load_model(step, "cpu")
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max() < 1e-5
    ddp_model, _, _ = load_model(runs["ddp"] / "step_000001", "cpu")
    for (k, a), b in zip(ddp_model.state_dict().items(), ours.state_dict().values()):
        assert rel_diff(a, b) < 2e-4, k


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
