"""Run the notebooks as `nbdev_test` does, and check that each cell still prints what its saved output shows.

A saved output is true when the text a cell prints now has the same shape: the same lines with every number masked.
Numbers themselves are not compared: float rounding differs between CPU kinds (and training runs drift with it), so
a test of their digits would not hold on every machine; the words, the lines and the columns must hold everywhere.
Cells whose text depends on what a model samples or on the clock say so with a comment `# output: varies`.

    python tests/notebooks.py [--path nbs/11_loss.ipynb] [--flags vllm] [--n_workers 2] [--timing] [--save]
"""

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from execnb.shell import CaptureShell
from fastcore.parallel import parallel
from nbdev.config import get_config
from nbdev.process import NBProcessor
from nbdev.frontmatter import FrontmatterProc
from nbdev.doclinks import nbglob

VARIES = "# output: varies"    # a cell's printed words depend on sampled text or on the clock: its shape is not checked
NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:e[-+]?\d+)?%?|\bnan\b|\binf\b", re.I)
ADDRESS = re.compile(r"\b0x[0-9a-f]+\b", re.I)
NUMBERS_ONLY = re.compile(r"\[[#(),\s]*\]")     # a list of numbers (or of tuples of them), as long as its data


def shape(text: str) -> list[str]:
    "The lines of `text` with numbers, lists of numbers and addresses masked, spaces folded: what must not change."
    lines = [NUMBERS_ONLY.sub("[#...]", NUMBER.sub("#", ADDRESS.sub("<addr>", ln)))
             for ln in text.replace("\r", "\n").splitlines()]
    return [re.sub(r"\s+", " ", ln).strip() for ln in lines if ln.strip()]


def printed(outputs) -> str:
    "The text a cell showed a reader: its stdout and its plain-text results (no stderr, no images)."
    parts = []
    for o in outputs:
        o = dict(o)
        if o.get("output_type") == "stream" and o.get("name") == "stdout":
            parts.append("".join(o.get("text", "")))
        elif o.get("output_type") in ("execute_result", "display_data"):
            data = o.get("data", {})
            if "text/plain" in data and not any(k.startswith("image/") for k in data):
                parts.append("".join(data["text/plain"]))
    return "".join(parts)


def stale_cells(saved_cells, ran_cells) -> dict[int, str]:
    "{cell index: what changed} of the code cells whose fresh text lost its saved output's shape (ran ones only)."
    stale = {}
    for i, (saved, ran) in enumerate(zip(saved_cells, ran_cells)):
        source = "".join(saved["source"])
        if saved["cell_type"] != "code" or VARIES in source or not saved.get("outputs") or not ran.get("_ran"):
            continue
        want, got = shape(printed(saved["outputs"])), shape(printed(ran.get("outputs", [])))
        if want != got:
            first = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            saw = lambda lines: lines[first][:100] if first < len(lines) else "(nothing)"
            stale[i] = (f"cell {i} ({source.splitlines()[0][:60]}): saved line {first + 1} '{saw(want)}', "
                        f"now '{saw(got)}'")
    return stale


def save_fresh(fn, fresh: dict):
    "Write the fresh outputs {cell index: outputs} into notebook `fn`, every other cell as it was."
    nb = json.loads(Path(fn).read_text())
    for i, outputs in fresh.items():
        nb["cells"][i]["outputs"] = json.loads(json.dumps(outputs))
    Path(fn).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def run_notebook(fn, skip_flags=(), force_flags=(), basepath=None, save=False):
    "(ran without error, seconds, stale outputs) of one notebook run as `nbdev_test` runs it; `save`: fresh ones saved."
    if basepath:
        sys.path.insert(0, str(basepath))
    os.environ["IN_TEST"] = "1"
    flags = set(skip_flags) - set(force_flags)
    saved = json.loads(Path(fn).read_text())["cells"]
    nb = NBProcessor(fn, procs=FrontmatterProc, process=True).nb

    def skipped(cell):
        if cell.cell_type != "code":
            return True
        directives = getattr(cell, "directives_", {}) or {}
        if directives.get("eval:", [""])[0].lower() == "false" or "nbdev_export" + "(" in cell.source:
            return True
        if flags & directives.keys():
            return True
        cell["_ran"] = True
        return False

    start, shell = time.time(), CaptureShell(fn)
    cwd = os.getcwd()
    try:
        os.chdir(Path(fn).parent)
        shell.run_all(nb, exc_stop=True, preproc=skipped)
        ok = True
    except Exception:
        sys.stderr.write(shell.prettytb(fname=fn) + "\n")
        ok = False
    finally:
        os.chdir(cwd)
    stale = stale_cells(saved, nb.cells) if ok else {}
    if save and stale:
        save_fresh(fn, {i: nb.cells[i].get("outputs", []) for i in stale})
    return ok, time.time() - start, list(stale.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="a notebook or a glob (default: every notebook of nbs/)")
    ap.add_argument("--flags", default="", help="space-separated test flags to run that are normally skipped")
    ap.add_argument("--n_workers", type=int, default=2)
    ap.add_argument("--timing", action="store_true", help="print each notebook's seconds, slowest first")
    ap.add_argument("--save", action="store_true", help="save the fresh outputs of the cells found stale")
    args = ap.parse_args(argv)
    cfg = get_config()
    sys.path.insert(0, str(Path(__file__).parent))
    from notebooks import run_notebook as run    # by module name, so that worker processes can unpickle it
    files = [f.absolute() for f in sorted(nbglob(args.path, as_path=True)) if not (f.parent / ".notest").exists()]
    results = parallel(run, files, skip_flags=cfg.tst_flags.split(), force_flags=args.flags.split(),
                       basepath=cfg.config_path, save=args.save, n_workers=min(args.n_workers, len(files)), pause=0.01)
    failed = [f.name for f, (ok, _, _) in zip(files, results) if not ok]
    stale = [f"{f.name} {line}" for f, (_, _, s) in zip(files, results) for line in s]
    if args.timing:
        for f, (_, t, _) in sorted(zip(files, results), key=lambda x: -x[1][1]):
            print(f"{f.name}: {int(t)} secs")
    if stale:
        sys.stderr.write("saved outputs that no longer match what their cells print (save the fresh ones with "
                         f"`python tests/notebooks.py --path <notebook> --save`, or mark a cell `{VARIES}`):\n  "
                         + "\n  ".join(stale) + "\n")
    if failed:
        sys.stderr.write("notebooks that failed:\n  " + "\n  ".join(failed) + "\n")
    if failed or stale:
        sys.exit(1)
    print("Success.")


if __name__ == "__main__":
    main()
