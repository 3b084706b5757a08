"""Every CPU kind: `make test` runs the numerics tests again on AVX2 kernels where the CPU also has AVX-512, the
selection names tests that exist, and the rounding checks of tests/rounding.py fail where they should."""

import ast, os, subprocess, sys
from pathlib import Path

import pytest
import torch

from conftest import NUMERICS
from rounding import (
    ADAMW_UPDATE_RTOL,
    LOGP_ATOL,
    MUON_UPDATE_RTOL,
    assert_greedy_agrees,
    assert_same_step,
    assert_updates_agree,
)

ROOT = Path(__file__).resolve().parents[1]
AVX2_PASS = "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"


def make_test_recipe(tmp_path, flags):
    "The commands `make -n test` prints on a machine whose /proc/cpuinfo flags line is `flags`."
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    p = subprocess.run(
        ["make", "-n", "test", f"CPUINFO={cpuinfo}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def pytest_lines(recipe):
    "The recipe's pytest commands."
    return [line for line in recipe if "-m pytest tests/" in line]


def test_avx512_machines_run_the_numerics_tests_again_on_avx2(tmp_path):
    "With avx512f among the flags, a second pytest over `-m numerics` on AVX2 kernels, announced; without, a notice."
    both = make_test_recipe(tmp_path, "fpu sse4_2 avx avx2 fma avx512f avx512dq avx512bw avx512_bf16")
    first, second = pytest_lines(both)
    assert "-m numerics" not in first and "ATEN_CPU_CAPABILITY" not in first, "the first pass runs every test as is"
    assert AVX2_PASS in second and " -m numerics " in second, second
    assert any(line.startswith("echo") and "AVX2 kernels" in line and AVX2_PASS in line for line in both), both
    avx2 = make_test_recipe(tmp_path, "fpu sse4_2 avx avx2 fma avx512_vnni")  # avx512_vnni is not avx512f
    assert len(pytest_lines(avx2)) == 1 and not any("-m numerics" in line for line in avx2), avx2
    assert any(line.startswith("echo") and "skipped" in line and "one instruction set" in line for line in avx2)


def test_this_machine_gets_the_pass_its_flags_call_for():
    "Read from the real /proc/cpuinfo: the second pass where this CPU has avx512f, the notice elsewhere."
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", "test"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60).stdout
    assert (AVX2_PASS in out) == ("avx512f" in flags), out[-2000:]


def test_numerics_selection_names_tests_that_exist():
    "Every file and test named in conftest.NUMERICS exists (a renamed test would silently leave the second pass)."
    for name, tests in NUMERICS.items():
        path = ROOT / "tests" / name
        assert path.is_file(), name
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        assert tests is None or tests <= defined, (name, tests - defined)
    assert "test_fsdp_equals_ddp" in NUMERICS["test_fsdp.py"]
    assert "test_one_rank_equals_two_ranks" in NUMERICS["test_train.py"]


def test_the_marker_selects_the_named_tests():
    "pytest -m numerics on test_train.py collects exactly the tests conftest names there (every parametrization)."
    collect = ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "numerics", "tests/test_train.py"]
    p = subprocess.run(
        [sys.executable, "-m", "pytest", *collect],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = [line for line in p.stdout.splitlines() if "::" in line]
    assert ids and {i.split("::")[1].split("[")[0] for i in ids} == NUMERICS["test_train.py"], p.stdout[-3000:]


# ---------------------------------------------------------------- the rounding checks can fail


def step_record(**changes):
    "A step's metrics record as the trainer logs it (a few of its keys), with `changes`."
    record = {"step": 0, "reward": 0.75, "pass@1": 0.5, "loss": -0.0445, "entropy": 5.94, "grad_norm": 0.66}
    return record | {"t_rollout": 1.0} | changes


def test_same_step_is_exact_on_samples_and_tolerant_on_arithmetic():
    a = step_record()
    assert_same_step(a, step_record(loss=a["loss"] + LOGP_ATOL / 2, grad_norm=0.66 * (1 + 1e-6), t_rollout=9.0))
    for bad in (dict(reward=0.5), dict(loss=a["loss"] + 3 * LOGP_ATOL), dict(grad_norm=0.67), {"pass@1": 0.25}):
        with pytest.raises(AssertionError):
            assert_same_step(a, step_record(**bad))
    with pytest.raises(AssertionError):
        assert_same_step(a, {**step_record(), "extra": 1})
    assert_same_step(a, step_record(**{"pass@1": 0.25}), after_update=("pass@",))  # evaluated after the update


def test_updates_agree_up_to_rounding_but_not_further():
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(200, 50, generator=g), "transformer.h.0.c": torch.randn(64, 64, generator=g)}
    step = {k: 1e-2 * torch.randn(v.shape, generator=g).sign() for k, v in start.items()}  # AdamW-like first steps
    a = {k: start[k] + step[k] for k in start}
    muon = {"transformer.h.0.c"}
    rounded = {k: v * (1 + 1e-7 * torch.randn(v.shape, generator=g)) for k, v in a.items()}
    assert assert_updates_agree(start, a, rounded, muon) < 1e-4
    flipped = {k: v.clone() for k, v in a.items()}
    flipped["w"].view(-1)[:5] -= 2 * step["w"].view(-1)[:5]  # 5 of 10,000 entries at the rounding level flip
    assert assert_updates_agree(start, a, flipped, muon) <= ADAMW_UPDATE_RTOL
    flipped["w"].view(-1)[:200] -= 2 * step["w"].view(-1)[:200]  # 2% of them: not rounding
    with pytest.raises(AssertionError, match="w: the updates differ"):
        assert_updates_agree(start, a, flipped, muon)
    off = {k: v.clone() for k, v in a.items()}
    off["transformer.h.0.c"] += 3e-3 * step["transformer.h.0.c"]  # 0.3%: within bf16 Newton-Schulz, not float32's
    assert_updates_agree(start, a, off, muon, torch.bfloat16)
    with pytest.raises(AssertionError, match="transformer.h.0.c"):
        assert_updates_agree(start, a, off, muon, torch.float32)
    assert MUON_UPDATE_RTOL[torch.float32] < 3e-3 < MUON_UPDATE_RTOL[torch.bfloat16]
    with pytest.raises(AssertionError, match="no tensor moved"):
        assert_updates_agree(start, start, start)


def test_greedy_agrees_up_to_a_near_tie():
    V, stops = 6, {5}
    logits = torch.zeros(4, V)
    logits[:, 1] = 2.0  # their pick everywhere: token 1
    theirs = [1, 1, 1, 5]
    assert assert_greedy_agrees([1, 1, 1], theirs, logits, stops, 1e-4) == 3  # the same, both stop at token 3
    logits[1, 2] = 2.0 - 1e-4  # a near tie at token 1: rounding may pick 2
    assert assert_greedy_agrees([1, 2, 4, 4], theirs, logits, stops, 1e-4) == 1
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_agrees([1, 1, 3], theirs, logits, stops, 1e-4)  # token 3 at 0.0 against 2.0
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_agrees([1], theirs, logits, stops, 1e-4)  # ours stops where theirs clearly goes on
