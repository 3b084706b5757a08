"""Sampler against trainer, token by token, on SmolLM2-135M-Instruct in float32 and bfloat16 (run by hand).

`python bench/logp_band.py [--folder DIR] [--problems 8] [--dtypes float32 bfloat16] [--out FILE]` samples `--problems` of the
real-model run's problems (notebook 15: one-step word problems through SmolLM2's chat template) x 8 samples x 48 new
tokens at temperature 0.7, top-k 50, with nanorl's engine under the dtype's autocast (as `--dtype` runs it), then
computes the trainer's log-probs of the same tokens under the same autocast with the sampler's distribution, in passes
of 1 row and of 8 rows (`--device-batch-size` 1 and 8). It prints, per dtype and split, the gap |trainer - engine|
(max, percentiles) and the fraction of sampled tokens whose ratio pi_trainer / pi_sampler leaves [0.9, 1.1], with the
CPU kind, and writes the figures and the gaps' histogram to --out.
"""

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from nanorl.engine import Engine
from nanorl.speedups import packed_weights, use_fast_paths
from nanorl.checkpoint import load_model
from nanorl.loss import token_logp
from nanorl.model import Sampler
from nanorl.real import real_tasks, smollm2_default
from nanorl.rollout import Sampling, collate, collate_logprobs, rollout, sample_seeds, trained_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nanochat_peer import cpu_label  # noqa: E402  the CPU kind, as every benchmark here prints it

BINS = [10.0**e for e in range(-9, 2)]  # |gap| histogram edges, 1e-9 .. 10


def trainer_gaps(model, tok, batch, rows_per_pass, dtype, sampler):
    "trainer - engine log-probs (N,) of a batch's sampled tokens, in passes of `rows_per_pass` rows under autocast."
    seqs, masks, logps = trained_rows(batch, range(len(batch.sequences)))
    pad, out = tok.encode_special("<|assistant_end|>"), []
    for s in range(0, len(seqs), rows_per_pass):
        inp, tgt = collate(seqs[s : s + rows_per_pass], masks[s : s + rows_per_pass], pad)  # (b, T) each
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype == torch.bfloat16):
            lp = token_logp(model, inp, tgt, sampler=sampler)  # (b, T)
        out.append((lp - collate_logprobs(logps[s : s + rows_per_pass]))[tgt != -1])
    return torch.cat(out)


def summary(gap):
    "The figures of one gap vector."
    lo, hi = torch.tensor(0.9).log().item(), torch.tensor(1.1).log().item()
    a = gap.abs().double()
    return {
        "tokens": gap.numel(),
        "max": a.max().item(),
        "p50": a.quantile(0.5).item(),
        "p99": a.quantile(0.99).item(),
        "outside_0.9_1.1": ((gap < lo) | (gap > hi)).double().mean().item(),
        "histogram": torch.histogram(a.clamp(min=1e-9), bins=torch.tensor(BINS, dtype=torch.double)).hist.tolist(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=None, help="SmolLM2's folder (default: the one bench/smollm2.py builds)")
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).with_name("logp_band.json")))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    folder = Path(args.folder or smollm2_default())
    model, tok, _ = load_model(folder, "cpu")
    use_fast_paths(model)  # as the trainer runs on a CPU
    task, _ = real_tasks(0)
    sampler = Sampler(0.7, 50)
    sampling = Sampling(num_samples=8, max_new_tokens=48, temperature=0.7, top_k=50)
    problems = list(range(args.problems))
    now = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    print(f"# {now} | {cpu_label()} | SmolLM2-135M-Instruct, {args.problems} problems x 8 x 48, T 0.7, top-k 50")
    results = {"when": now, "cpu": cpu_label(), "bins": BINS, "runs": {}}
    for dtype in [getattr(torch, d) for d in args.dtypes]:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), packed_weights(model):
            batch = rollout(Engine(model, tok), tok, task, problems, sampling, sample_seeds(0, 0, problems), 64)
        t1 = time.perf_counter()
        for split in (1, 8):
            t2 = time.perf_counter()
            s = summary(trainer_gaps(model, tok, batch, split, dtype, sampler))
            s.update(rollout_s=t1 - t0, trainer_s=time.perf_counter() - t2)
            results["runs"][f"{str(dtype)[6:]}/{split}"] = s
            print(
                f"{str(dtype)[6:]:8s} {split} row(s) a pass: {s['tokens']} tokens, |gap| max {s['max']:.1e}, "
                f"p99 {s['p99']:.1e}, median {s['p50']:.1e}; ratio outside [0.9, 1.1]: {s['outside_0.9_1.1']:.2%} "
                f"(rollout {t1 - t0:.0f} s, trainer {s['trainer_s']:.0f} s)",
                flush=True,
            )
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
