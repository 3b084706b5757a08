"""The one way the tests start a process: the repository's paths, an offline environment, and a checked run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
OFFLINE = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **OFFLINE}


def check(p):
    "A finished process, or the test fails with the end of its output."
    assert p.returncode == 0, f"run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def run_checked(cmd, env=None, timeout=300, cwd=None):
    "Run one argv list in the offline environment (plus `env`); fail the test with its output unless it succeeds."
    cmd = [str(c) for c in cmd]
    return check(subprocess.run(cmd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout,
                                cwd=cwd))
