"""`--dtype auto` on a CPU: bf16 where it pays (native bf16, fast paths on, a weight they pack), float32 elsewhere."""

import contextlib, io, os, shutil, subprocess, sys

import pytest
import torch

from doubles import FIXTURES, NANOCHAT_HEAD, small_run
from nanorl.config import config_from_args
from nanorl.optim import native_cpu_bf16
from nanorl.speedups import bf16_pays
from nanorl.train import Trainer

NATIVE = native_cpu_bf16()


def trainer(tmp_path, base, *flags):
    "A Trainer of the small run on a copy of `base` (a nanochat base directory), `--dtype auto` unless flags say."
    copy = tmp_path / base.name
    shutil.copytree(base, copy)
    argv = [*small_run(dtype="auto", model_tag="d3", num_steps=1), "--base-dir", str(copy), *flags]
    with contextlib.redirect_stderr(io.StringIO()):
        return Trainer(config_from_args(argv))


def test_auto_is_bf16_where_it_pays(tmp_path):
    "The fixture's d3 has a 32768-row head (packed): bf16 on a native-bf16 CPU, float32 on others."
    t = trainer(tmp_path, NANOCHAT_HEAD)
    assert bf16_pays(t.model) == NATIVE
    assert t.dtype == (torch.bfloat16 if NATIVE else torch.float32)


def test_auto_stays_float32_without_the_fast_paths_or_for_small_models(tmp_path):
    "No fast paths (plain autocast casts every weight at every call) or no packed weight (the demo's): float32."
    assert trainer(tmp_path, NANOCHAT_HEAD, "--no-cpu-fast-paths").dtype == torch.float32
    assert trainer(tmp_path / "demo", FIXTURES / "demo_sft").dtype == torch.float32
    assert trainer(tmp_path / "f32", NANOCHAT_HEAD, "--dtype", "float32").dtype == torch.float32


def test_avx2_kernels_mean_float32():
    "With torch's kernels capped at AVX2 (the numerics rerun of `make test`), bf16 is not native: auto is float32."
    code = "from nanorl.optim import native_cpu_bf16; print(native_cpu_bf16())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_resume_sees_what_auto_chose(tmp_path, monkeypatch, capsys):
    "auto resolves by CPU and model: a resume where it resolves otherwise (another CPU kind) names it and refuses."
    from nanorl.train import main

    base = tmp_path / "base"
    shutil.copytree(NANOCHAT_HEAD, base)
    run = [*small_run(dtype="auto", model_tag="d3", save_every=1), "--base-dir", str(base)]
    monkeypatch.setattr("nanorl.start.bf16_pays", lambda model: True)        # a CPU where bf16 pays
    main([*run, "--num-steps", "1"])
    monkeypatch.setattr("nanorl.start.bf16_pays", lambda model: False)       # the same run on a CPU where it does not
    with pytest.raises(SystemExit) as e:
        main([*run, "--num-steps", "2", "--resume"])
    msg = str(e.value.code)
    assert "the compute dtype bfloat16 -> float32 (--dtype bfloat16 keeps the run's" in msg and "\n" not in msg, msg
    capsys.readouterr()
    main([*run, "--num-steps", "2", "--resume", "--allow-changes"])
    assert "the compute dtype bfloat16 -> float32" in capsys.readouterr().out
