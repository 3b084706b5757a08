"""Run by tests/test_train.py under torchrun: a DDP run (CPU, so the fused loss) whose ranks report, at the end,
whether the fused loss was on and their parameters' fingerprint, and whether a one-rank change is caught."""

import json
import os
import sys
from pathlib import Path

import torch

import nanorl.train as T
from nanorl.scale import param_fingerprint
from nanorl.speedups import CPU_FAST_PATHS

agree = T.check_ranks_agree


def report_then_check(model, world_size):
    "Write this rank's report, run the trainer's own check, then check that a change on one rank is caught."
    rank = int(os.environ["RANK"])
    report = {"fused": getattr(model, "fast_paths", None) is CPU_FAST_PATHS, "fingerprint": param_fingerprint(model)}
    agree(model, world_size)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1e-3
    try:
        agree(model, world_size)
        report["caught"] = False
    except RuntimeError:
        report["caught"] = True
    (Path(os.environ["NANORL_TEST_OUT"]) / f"rank{rank}.json").write_text(json.dumps(report))


T.check_ranks_agree = report_then_check

if __name__ == "__main__":
    T.main(sys.argv[1:])
