"""Reliability: exact resume after SIGKILL, atomic checkpoints, elastic restarts, non-finite steps, OOM halving,
clear errors on bad inputs, a fuzzed calculator and untrusted files."""
import json, os, shutil, signal, subprocess, sys, time, warnings
from pathlib import Path

import pytest
import torch

from nanorl.checkpoint import CheckpointError, load_model
from nanorl.train import Config, NonFiniteError, check_writable, complete_steps, main, make_tasks, rollout, train, validate

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "nanochat" / "head"
GSM8K_FIXTURE = ROOT / "tests" / "fixtures" / "gsm8k"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SMALL = ["--device-type", "cpu", "--examples-per-step", "2", "--num-samples", "4", "--device-batch-size", "4",
         "--max-new-tokens", "12", "--eval-every", "3", "--eval-examples", "2", "--save-every", "2",
         "--task", "toy_task:make_tasks", "--matrix-lr", "0.05", "--init-lr-frac", "1.0", "--seed", "7"]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}


def base_dir(tmp_path, name):
    "A nanochat base directory holding the tiny fixture checkpoint and tokenizer."
    d = tmp_path / name
    shutil.copytree(FIXTURE, d)
    return d


def run_dir(base): return base / "chatrl_checkpoints" / "d3"


def train_cmd(base, *args, launcher=None):
    "Command line of `nanorl.train` on the fixture base directory, with the small settings."
    launcher = launcher or [sys.executable, "-m", "nanorl.train"]
    return [*launcher, "--base-dir", str(base), *SMALL, *args]


def check(p):
    assert p.returncode == 0, f"run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def records(base, drop_timing=True):
    "metrics.jsonl records, without the timing fields (t_*) that differ between runs."
    recs = [json.loads(l) for l in (run_dir(base) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("t_")} for r in recs] if drop_timing else recs


def assert_same_tensors(a, b, where=""):
    "Bitwise equality of nested dicts/lists of tensors and numbers."
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a: assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths"
        for i, (x, y) in enumerate(zip(a, b)): assert_same_tensors(x, y, f"{where}[{i}]")
    else: assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run_end(a, b, step, ranks=1):
    "Two runs end with identical weights, optimizer states (every rank) and metrics."
    load = lambda base, name: torch.load(run_dir(base) / name, weights_only=True)
    assert_same_tensors(load(a, f"model_{step:06d}.pt"), load(b, f"model_{step:06d}.pt"), "model")
    for r in range(ranks):
        assert_same_tensors(load(a, f"optim_{step:06d}_rank{r}.pt"), load(b, f"optim_{step:06d}_rank{r}.pt"), f"optim rank{r}")
    assert records(a) == records(b)


def wait_for_checkpoint(directory, proc, ranks=1, timeout=120):
    "Poll until `directory` has a complete checkpoint (all files of all ranks); returns its step."
    t0 = time.time()
    while time.time() - t0 < timeout:
        steps = complete_steps(directory, ranks)
        if steps: return steps[0]
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{proc.stderr.read()[-3000:]}"
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


# ---------------------------------------------------------------- exact resume after SIGKILL

def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    "Kill -9 right after the first checkpoint, --resume: weights, optimizer state and metrics equal an uninterrupted run."
    steps = ["--num-steps", "8"]
    whole, cut = base_dir(tmp_path, "whole"), base_dir(tmp_path, "cut")
    check(subprocess.run(train_cmd(whole, *steps), env=ENV, capture_output=True, text=True, timeout=300))
    proc = subprocess.Popen(train_cmd(cut, *steps), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        killed_after = wait_for_checkpoint(run_dir(cut), proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None: proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert killed_after < 7 and not (run_dir(cut) / "model_000007.pt").exists()
    p = check(subprocess.run(train_cmd(cut, *steps, "--resume"), env=ENV, capture_output=True, text=True, timeout=300))
    assert "resuming at step" in p.stdout
    assert_same_run_end(whole, cut, 7)
    assert [r["step"] for r in records(cut)] == list(range(8))


# ---------------------------------------------------------------- fault tolerance under torchrun

def worker_pids(agent_pid):
    "{rank: pid} of the workers torchrun's agent process has started (read from /proc)."
    pids = {}
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            if "RANK" in env: pids[int(env["RANK"])] = int(pid)
    return pids


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_torchrun_restarts_a_killed_rank_and_resumes(tmp_path):
    "torchrun --max-restarts=1: SIGKILL rank 1 after the first checkpoint; the restarted group resumes and ends as an unbroken run."
    steps = ["--num-steps", "8"]
    launcher = lambda restarts: [TORCHRUN, "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}",
                                 "--monitor-interval=0.2", "-m", "nanorl.train"]
    whole, cut = base_dir(tmp_path, "whole"), base_dir(tmp_path, "cut")
    check(subprocess.run(train_cmd(whole, *steps, launcher=launcher(0)), env=ENV, capture_output=True, text=True, timeout=300))
    proc = subprocess.Popen(train_cmd(cut, *steps, launcher=launcher(1)), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_checkpoint(run_dir(cut), proc, ranks=2)
        os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None: proc.kill()
    assert proc.returncode == 0, f"the restarted group failed:\n{out[-3000:]}\n{err[-5000:]}"
    assert "resuming at step" in out and "elastic restart 1" in out, out[-3000:]
    assert_same_run_end(whole, cut, 7, ranks=2)
