"""Every shell command the README shows runs here at a tiny size, and the README's course map matches the notebooks."""

import dataclasses, json, os, re, subprocess, sys, zipfile
from pathlib import Path

import pytest

from doubles import base_dir, records
from nanorl.checkpoint import load_model
from nanorl.train import Config
from test_layout import notebook_modules
from harness import OFFLINE, ROOT, TORCHRUN

README, INDEX = ROOT / "README.md", ROOT / "nbs" / "index.ipynb"
GSM8K_SLICE = ROOT / "tests" / "fixtures" / "gsm8k"
QUICK_START = {"make demo", "make test"}  # CI runs them; every other command is run by the test named here
GPU_VENV = "python3 -m venv .venv && .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128"
COVERED = {
    "torchrun --standalone --nproc_per_node=8 -m nanorl.train -- --run=my_run": "test_torchrun_lines",
    "torchrun --standalone --nproc_per_node=8 -m nanorl.train -- --data-dir=/data/gsm8k": "test_torchrun_lines",
    "torchrun --standalone --nproc_per_node=8 -m nanorl.train -- --model-path=/models/Qwen2.5-1.5B-Instruct --fsdp "
    "--task=countdown": "test_torchrun_hf_line",
    "torchrun --standalone --nproc_per_node=8 -m nanorl.train -- --model-path=/models/Qwen2.5-1.5B-Instruct "
    "--engine=vllm --is-correction=tis": "test_torchrun_vllm_line",
    "python -m nanorl.train --help": "test_train_help",
    "make real": "test_make_real",
    "make gsm8k": "test_make_gsm8k",
    GPU_VENV: "test_gpu_setup",
    "make setup CONSTRAINTS=": "test_gpu_setup",
}


def shell_commands(markdown):
    "The command lines of the markdown's bash/sh/shell/console blocks, words joined by one space, comments dropped."
    commands = []
    for lang, body in re.findall(r"^```(bash|sh|shell|console)[ \t]*\n(.*?)^```", markdown, flags=re.M | re.S):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if lang == "console":
                if not line.startswith("$ "):
                    continue  # a console block's other lines are output
                line = line[2:]
            line = re.sub(r"(^|\s)#.*", "", line).strip()  # a comment starts at a '#' that begins a word
            if line:
                commands.append(" ".join(line.split()))
    return commands


def index_markdown():
    return "\n\n".join(
        "".join(c["source"]) for c in json.loads(INDEX.read_text())["cells"] if c["cell_type"] == "markdown"
    )


def commands_of(test_name):
    "The README commands that `test_name` runs."
    return [c for c, t in COVERED.items() if t == test_name]


def run_or_fail(cmd, cwd=ROOT, env=None, timeout=300):
    "Run one argv list; fail the test with its output unless it succeeds."
    p = subprocess.run(
        cmd, cwd=cwd, env={**os.environ, **OFFLINE, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    shown = " ".join(map(str, cmd))
    assert p.returncode == 0, f"{shown} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def test_every_readme_command_is_covered():
    "The README's commands are exactly the quick start plus the mapping's keys, and each maps to a test of this file."
    shown = shell_commands(README.read_text())
    assert shown == shell_commands(index_markdown()), "README.md is out of date: run `make readme`"
    assert QUICK_START <= set(shown), f"the quick-start commands {QUICK_START} are no longer shown"
    uncovered, stale = set(shown) - QUICK_START - set(COVERED), set(COVERED) - set(shown)
    assert not uncovered, f"README shows commands no test runs: {sorted(uncovered)}; add them to COVERED with a test"
    assert not stale, f"COVERED lists commands the README no longer shows: {sorted(stale)}"
    assert all(callable(globals().get(t)) for t in COVERED.values())


def test_shell_commands_parsing():
    "Comments, continuations, console prompts and other languages' blocks are handled."
    md = (
        "```bash\nmake a   # note\nfoo \\\n  --x=1  # more\n```\n```python\nprint(1)\n```\n"
        "```console\n$ ls -l\noutput line\n```\n```\nnot/a/command\n```\n"
    )
    assert shell_commands(md) == ["make a", "foo --x=1", "ls -l"]


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("line", commands_of("test_torchrun_lines"))
def test_torchrun_lines(tmp_path, line, nproc):
    "The README's torchrun line as written, with `nproc` gloo ranks, the tiny fixture checkpoint and smoke settings."
    # the Hub is offline here: the GSM8K slice in tests/fixtures stands in for it (and for /data/gsm8k)
    base = base_dir(tmp_path, "base")
    words = line.split()
    assert words[:2] == ["torchrun", "--standalone"] and "--nproc_per_node=8" in words
    words = [
        (
            TORCHRUN
            if w == "torchrun"
            else (
                f"--nproc_per_node={nproc}" if w == "--nproc_per_node=8" else w.replace("/data/gsm8k", str(GSM8K_SLICE))
            )
        )
        for w in words
    ]
    tiny = ["--device-type", "cpu", "--base-dir", str(base), "--preset", "smoke", "--num-steps", "1"]
    if "--data-dir" not in line:
        tiny += ["--data-dir", str(GSM8K_SLICE)]
    run_or_fail([*words, *tiny], cwd=tmp_path)
    ckpt = base / "chatrl_checkpoints" / "d3"
    assert sorted(p.name for p in ckpt.glob("resume_*")) == [f"resume_000000_rank{r}.pt" for r in range(nproc)]
    recs = records(base)
    assert [r["step"] for r in recs] == [0] and "pass@1" in recs[0]
    _, _, meta = load_model("rl", "cpu", base_dir=base)
    assert meta["step"] == 0
    if "--run=my_run" in line:  # only a named run starts (here: disabled) wandb, so the name reached nanorl.train
        assert (ckpt / "wandb_run_id").is_file()


def run_hf_line(test_name, folder, tmp_path, extra=(), env=None):
    "Run the README's `test_name` line on two gloo ranks with `folder` for its model, at a tiny size; its records."
    (line,) = commands_of(test_name)
    words = [TORCHRUN if w == "torchrun" else w for w in line.split()]
    words = [w.replace("/models/Qwen2.5-1.5B-Instruct", str(folder)).replace("=8", "=2") for w in words]
    tiny = ["--device-type", "cpu", "--num-steps", "1", "--examples-per-step", "2", "--num-samples", "2",
            "--device-batch-size", "2", "--max-new-tokens", "8", "--eval-every", "100", "--eval-examples", "2",
            "--save-every", "100", *extra, "--output-dir", str(tmp_path / "out")]
    run_or_fail([*words, *tiny], cwd=tmp_path, env=env)
    (metrics,) = (tmp_path / "out").rglob("metrics.jsonl")
    return [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]


def test_torchrun_hf_line(tmp_path):
    "The README's Hugging Face line as written (FSDP2, Countdown) on two gloo ranks, a tiny Qwen2 folder for the model."
    from doubles import save_tiny_hf_model

    folder = tmp_path / "Qwen2.5-1.5B-Instruct"
    save_tiny_hf_model("qwen2", folder)
    recs = run_hf_line("test_torchrun_hf_line", folder, tmp_path)
    assert [r["step"] for r in recs if "reward" in r] == [0], recs
    assert (folder / "config.json").is_file() and list((tmp_path / "out").rglob("model*.safetensors"))


def test_torchrun_vllm_line(tmp_path):
    "The README's vLLM line as written on two gloo ranks, each with its own vLLM, on a folder vLLM's CPU build takes."
    from doubles import save_tiny_qwen2_head32
    from nanorl.vllm_engine import import_vllm

    try:
        import_vllm()
    except ImportError as e:
        pytest.skip(f"vLLM does not import here (it installs on Linux x86-64 only): {str(e)[:200]}")
    folder = tmp_path / "Qwen2.5-1.5B-Instruct"
    save_tiny_qwen2_head32(folder)
    env = {"PYTHONPATH": str(ROOT / "tests"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    recs = run_hf_line("test_torchrun_vllm_line", folder, tmp_path, ["--task", "doubles:toy_tasks"], env)
    assert [r["step"] for r in recs] == [0] and all(k in recs[0] for k in ("logp_gap_max", "t_sync")), recs


def test_train_help():
    "`python -m nanorl.train --help` (with this interpreter) lists every field of the trainer's Config as a flag."
    (line,) = commands_of("test_train_help")
    words = line.split()
    assert words[0] == "python"
    out = run_or_fail([sys.executable, *words[1:]]).stdout
    listed = re.findall(r"^\s+(--?[\w-]+)", out, flags=re.M)
    assert len(listed) <= 40 and "nanochat's chat_rl flags" in out, f"--help lists {len(listed)} options"
    every = run_or_fail([sys.executable, *words[1:-1], "--help-all"]).stdout
    missing = [f.name for f in dataclasses.fields(Config) if f"--{f.name.replace('_', '-')}" not in every]
    assert not missing, f"--help-all does not show {missing}"



def test_demo_and_real_speak_train_flags():
    "Every flag of nanorl.demo and nanorl.real that sets a Config field is train's: its spelling, type and --no- form."
    import argparse
    from nanorl.demo import demo_parser
    from nanorl.real import real_parser
    from nanorl.config import build_parser

    train = {a.dest: a for a in build_parser(every=True)._actions if a.help != argparse.SUPPRESS}
    own = {"help", "threads", "quick", "control", "problems"}  # the demo's and the real run's settings that no trainer has
    for parser in (demo_parser(), real_parser()):
        shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest not in own]
        assert shown and all(a.dest in train for a in shown), [a.dest for a in shown if a.dest not in train]
        for a in shown:
            assert (a.option_strings, a.type) == (train[a.dest].option_strings, train[a.dest].type), a.dest
        ns = parser.parse_args(["--no-train-stop", "--output-dir", "x", "--num-steps", "3"])
        assert (ns.train_stop, ns.output_dir, ns.num_steps) == (False, "x", 3)
        assert parser.parse_args(["--out-dir", "y"]).output_dir == "y"  # the earlier spelling still works

def test_make_real(tmp_path):
    "`make real` = install the converter, build the SmolLM2 folder, `python -m nanorl.real`; run here on a tiny folder."
    from doubles import save_tiny_hf_model
    from nanorl.real import real_config

    (line,) = commands_of("test_make_real")
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "-n", *line.split()[1:]], cwd=ROOT, env=make_env, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    recipe = [l.split() for l in dry.stdout.splitlines() if "/python" in l]
    assert [w[1:3] for w in recipe] == [["-m", "pip"], ["bench/smollm2.py"], ["-m", "nanorl.real"]], dry.stdout
    assert recipe[-1][3:] == ["--num-steps", "40", "--eval-examples", "64", "--threads", "2"]  # the recorded run
    save_tiny_hf_model("llama", tmp_path / "tiny")
    out = tmp_path / "run"
    args = ["--model-path", tmp_path / "tiny", "--num-steps", "1", "--eval-examples", "2", "--output-dir", out]
    p = run_or_fail([sys.executable, "-m", "nanorl.real", *args, "--threads", "1"], timeout=600)
    assert "held-out pass@1" in p.stdout
    summary = json.loads((out / "real_summary.json").read_text())
    assert (out / "real_curves.png").stat().st_size > 0 and len(summary["records"]) == 1
    assert len(summary["answers_before"]) == len(summary["answers_after"]) == 3
    assert (
        0 <= summary["before"] <= 1 and summary["config"]["lr"] == real_config(out).lr
    )  # the recorded recipe, flags unchanged


def test_make_gsm8k(tmp_path):
    "`make gsm8k` = install the converter, build the Qwen folder, `nanorl.real --problems gsm8k`; run on a tiny Qwen2."
    from doubles import save_tiny_hf_model

    (line,) = commands_of("test_make_gsm8k")
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "-n", *line.split()[1:]], cwd=ROOT, env=make_env, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    recipe = [l.split() for l in dry.stdout.splitlines() if "/python" in l]
    assert [w[1:3] for w in recipe] == [["-m", "pip"], ["bench/qwen_coder.py"], ["-m", "nanorl.real"]], dry.stdout
    assert recipe[-1][3:] == ["--problems", "gsm8k", "--data-dir", "../shared/data/gsm8k", "--threads", "2",
                              "--output-dir", "runs/gsm8k"]        # beside make real's runs/real, not over it
    save_tiny_hf_model("qwen2", tmp_path / "tiny")
    out = tmp_path / "run"
    args = ["--model-path", tmp_path / "tiny", "--problems", "gsm8k", "--data-dir", GSM8K_SLICE, "--num-steps", "1",
            "--eval-examples", "2", "--max-new-tokens", "8", "--output-dir", out, "--threads", "1"]
    p = run_or_fail([sys.executable, "-m", "nanorl.real", *args], timeout=600)
    assert "held-out pass@1" in p.stdout
    summary = json.loads((out / "real_summary.json").read_text())
    assert summary["task"] == "gsm8k" and summary["config"]["task"] == "nanorl.real:gsm8k_tasks"
    assert summary["config"]["data_dir"] == str(GSM8K_SLICE) and len(summary["answers_after"]) == 3


def stand_in_index(root, name="torch", version="2.13.0+cu128"):
    "A local package index holding one tiny importable wheel, standing in for the CUDA index (no network here)."
    dist, files = f"{name}-{version}.dist-info", {f"{name}/__init__.py": f"__version__ = {version!r}\n"}
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{dist}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: nanorl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    wheel = root / name / f"{name}-{version}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    (root / name / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    return root.as_uri() + "/"


def test_gpu_setup(tmp_path):
    "The GPU set-up: a venv with its own torch, then `make setup CONSTRAINTS=` installing nanorl without pinning it."
    # No network here: a local index with a stand-in torch wheel replaces the CUDA index, and `make setup` runs as a
    # dry run (installing nanorl's dependencies would need PyPI); it must keep the venv and not pin (replace) torch.
    venv_line, make_line = commands_of("test_gpu_setup")
    steps = [s.split() for s in venv_line.split(" && ")]
    assert steps[0] == ["python3", "-m", "venv", ".venv"] and steps[1][:3] == [".venv/bin/pip", "install", "torch"]
    url = steps[1][steps[1].index("--index-url") + 1]
    local = stand_in_index(tmp_path / "index")
    steps[1] = [local if w == url else w for w in steps[1]]
    pip_env = {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for step in steps:
        run_or_fail(step, cwd=tmp_path, env=pip_env, timeout=180)
    venv = tmp_path / ".venv"
    got = run_or_fail([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    assert got == "2.13.0+cu128"

    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}

    def dry_run(*words):
        "The recipe lines `make -n` prints for the set-up into the stand-in venv."
        p = subprocess.run(
            ["make", "-n", *words, f"VENV={venv}"], cwd=ROOT, env=make_env, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, p.stderr
        return p.stdout

    assert make_line.split()[:2] == ["make", "setup"]
    pinned, unpinned = dry_run("setup"), dry_run(*make_line.split()[1:])
    install = [l for l in unpinned.splitlines() if '-e ".[dev]"' in l]
    assert len(install) == 1 and "-c " not in install[0] and "constraints" not in install[0], unpinned
    assert f"test -x {venv}/bin/python ||" in unpinned, "an existing venv must be kept"
    assert "-c constraints.txt" in pinned, "without CONSTRAINTS= the set-up pins torch"


# ---------------------------------------------------------------- the course map


def test_course_map_lists_every_notebook():
    "The README's course table lists exactly the numbered notebooks, in order, each with the module it exports."
    rows = re.findall(r"^\| `(\d\d[a-z]?_\w+)` \| `(\w+)` \|", README.read_text(), flags=re.M)
    assert [n for n, _ in rows] == sorted(n for n, _ in rows), "the course table is not in notebook order"
    expected = sorted((f"{num:02d}{letter}_{mod}", mod) for mod, (num, letter) in notebook_modules().items())
    assert rows == expected, f"the README's course table lists {rows}, the notebooks are {expected}"
