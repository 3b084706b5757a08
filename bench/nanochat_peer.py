"""nanochat's own code as the benchmark peer: its virtual environment, a shared base dir, its harness scripts.

nanochat is never imported into nanorl's process. Its pinned source and harness scripts live in
`../shared/reference/nanochat-src` (or any checkout with the same `harness/` folder, `--nanochat-src`). The first use
creates `bench/results/venv-nanochat` with torch pinned by `constraints.txt` and builds `bench/results/nanochat-base`:
a tokenizer trained by nanochat's rustbpe code, random nanochat-shaped checkpoints written by nanochat's own
`save_checkpoint`, and GSM8K's parquet cache from the local jsonl files. nanorl reads the same base dir, so both sides
run the same weights, tokenizer and problems.

`--isa avx2` sets ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 in every measured process (both sides), which
keeps an AVX-512 machine off its AVX-512 and bf16 kernels.
"""

import json, os, platform, re, subprocess, sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEFAULT_SRC = ROOT.parent / "shared" / "reference" / "nanochat-src"
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"
PEER_PACKAGES = ["torch==2.13.0", "tiktoken", "rustbpe", "numpy", "pyarrow", "filelock", "psutil"]
ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def add_peer_args(ap):
    "The flags every side-by-side benchmark takes."
    ap.add_argument("--nanochat-src", type=Path, default=DEFAULT_SRC, help="nanochat's source with its harness/ folder")
    ap.add_argument(
        "--nanochat-python",
        type=Path,
        default=None,
        help="a Python with nanochat's packages (default: create bench/results/venv-nanochat)",
    )
    ap.add_argument(
        "--isa",
        choices=list(ISA_ENV),
        default="native",
        help="native, or avx2: keep AVX-512 and bf16 kernels off on both sides",
    )
    ap.add_argument("--threads", type=int, default=2)


def peer_env(args, **extra) -> dict:
    "The environment of a measured process: thread count, ISA limits, offline switches."
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        **ISA_ENV[args.isa],
        **extra,
    }
    return env


def peer_python(args) -> Path:
    "The Python that runs nanochat: the one given, or a venv created once under bench/results."
    if args.nanochat_python:
        return args.nanochat_python
    venv = RESULTS / "venv-nanochat"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} for nanochat (torch pinned by constraints.txt)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), *PEER_PACKAGES], check=True
        )
    return python


def harness(args, name) -> Path:
    "Path of one of nanochat-src's harness scripts, with a clear error if the source is missing."
    path = args.nanochat_src / "harness" / name
    if not path.exists():
        raise SystemExit(f"{path} not found: pass --nanochat-src, a nanochat source with the harness/ scripts")
    return path


def last_json(out: str) -> dict:
    "The last line of a harness's output that parses as a JSON object."
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in the output:\n{out[-2000:]}")


def run_peer(args, script, *argv, env=None) -> dict:
    "Run one harness script under nanochat's Python; its final JSON line."
    cmd = [str(peer_python(args)), str(harness(args, script)), *map(str, argv)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env or peer_env(args), cwd=args.nanochat_src)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return last_json(res.stdout)


def base_dir(args, depth=4) -> Path:
    "A nanochat base dir written by nanochat's own code: tokenizer, random d{depth} SFT checkpoint, GSM8K cache."
    base = RESULTS / "nanochat-base"
    ckpt = base / "chatsft_checkpoints" / f"d{depth}" / "model_000000.pt"
    if not ckpt.exists():
        print(f"building {base} with nanochat's code (tokenizer, d{depth} checkpoint)", flush=True)
        run_peer(
            args,
            "nanochat_engine_bench.py",
            "--nanochat-root",
            args.nanochat_src,
            "--ckpt-dir",
            base,
            "--depths",
            depth,
            "--modes",
            "raw",
            "--runs",
            1,
            "--max-tokens",
            4,
        )
    if not (base / "task_data" / "openai--gsm8k" / "main" / "train" / "manifest.json").exists():
        cache = [
            str(peer_python(args)),
            str(harness(args, "nanochat_gsm8k_cache.py")),
            "--base-dir",
            str(base),
            "--data-dir",
            str(GSM8K_DIR),
        ]
        subprocess.run(cache, check=True, capture_output=True)
    return base


KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what picks torch's CPU kernels


def cpu_label() -> str:
    """The CPU kind every figure is measured on: model name, family and model numbers (Zen 2 is family 23, Zen 3 and
    Zen 4 family 25), the vector, bf16 and AMX features that decide which kernels run (the missing ones named too),
    cores and torch's version."""
    name, flags = platform.processor() or platform.machine(), None
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
        family = re.search(r"cpu family\s*:\s*(\d+)", info).group(1)
        model = re.search(r"^model\s*:\s*(\d+)", info, re.M).group(1)
        name = f"{name} (family {family} model {model})"
        flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
    except (OSError, AttributeError):
        pass
    if flags is None:
        feats = "CPU flags unknown"
    else:
        have, lack = [f for f in KERNEL_FLAGS if f in flags], [f for f in KERNEL_FLAGS if f not in flags]
        feats = "/".join(have) + (f", no {'/'.join(lack)}" if lack else "")
    return f"{name}, {os.cpu_count()} cores, {feats}, torch {torch.__version__}"
