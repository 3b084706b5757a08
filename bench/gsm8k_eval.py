"""GSM8K test, held out: a model's pass@k with the real run's instruction and last-number rule, by nanorl's evaluator.

    python bench/gsm8k_eval.py [--model DIR ...] [--label NAME ...] [--examples 128] [--samples 4]
                               [--max-new-tokens 256] [--dtype float32] [--prompts-per-batch 16] [--threads 2]
                               [--out bench/gsm8k_eval.jsonl]
    python bench/gsm8k_eval.py --compare BEFORE_LABEL AFTER_LABEL [--out bench/gsm8k_eval.jsonl]

Each `--model` is a Hugging Face folder (default: SmolLM2-135M-Instruct's, see `bench/smollm2.py`) or a run directory
that `nanorl.checkpoint.load_model` reads (its newest step). The problems are the first `--examples` of GSM8K's test
split in nanorl's shuffled order (`GSM8K(split="test")`, read from `--data-dir`, default ../shared/data/gsm8k), asked
as `18_real` asks its word problems (`FinalNumber`: the question plus " Give the final answer as a number at the end.")
and scored by the reply's last number against the `#### N` answer. Sampling: `--samples` per problem, temperature 0.7,
top-k 50 (the real run's), at most `--max-new-tokens`; the seeds are the evaluator's, the same for every model, each
problem's its own (how many problems share a call changes only rounding; a record without the field used 4). Every
pass@k is printed with its standard error over problems; one JSON line per model goes to `--out`, with each sample's
outcome and whether it stopped. `--compare` reads two such records of the same problems and draws and prints the gain
problem by problem (paired), the stop rates, the share right among replies that stopped, and how much of the gain
more replies finishing within the limit would give alone.
"""

import argparse, json, sys, time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from nanochat_peer import cpu_label  # noqa: E402  the CPU kind, as every benchmark here prints it

from nanorl.checkpoint import load_model  # noqa: E402
from nanorl.engine import Engine  # noqa: E402
from nanorl.evaluate import evaluate_pass_at_k  # noqa: E402
from nanorl.real import FinalNumber, smollm2_path  # noqa: E402
from nanorl.rollout import Sampling  # noqa: E402
from nanorl.speedups import use_fast_paths  # noqa: E402
from nanorl.tasks import GSM8K  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "gsm8k"


def gsm8k_test(data_dir) -> FinalNumber:
    "GSM8K's test split, asked with the real run's instruction and scored by the last number."
    return FinalNumber(GSM8K(split="test", data_dir=data_dir))


def evaluate_model(folder, task, args) -> dict:
    "pass@k of the model in `folder` on the first `args.examples` problems of `task`, with the seconds it took."
    model, tokenizer, _ = load_model(folder, "cpu")
    model = model.to(getattr(torch, args.dtype))                      # bfloat16: weights cast, as fast as autocast
    engine = Engine(use_fast_paths(model.eval()), tokenizer)          # on a CPU, as the trainer samples
    sampling = Sampling(num_samples=args.samples, max_new_tokens=args.max_new_tokens, temperature=0.7, top_k=50)
    t0 = time.perf_counter()
    result = evaluate_pass_at_k(engine, tokenizer, task, sampling, args.examples, seed=args.seed,
                                prompts_per_batch=args.prompts_per_batch)
    right, stopped = result.outcomes, result.stopped                  # (P, n) each: per problem, for paired comparisons
    return result.metrics() | {"seconds": time.perf_counter() - t0,
                               "right_if_stopped": right[stopped].float().mean().item(),
                               "right": right.int().tolist(), "stopped": stopped.int().tolist()}


def parse_args(argv=None):
    "Command-line flags."
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="model folder or run directory (repeatable; default: SmolLM2)")
    p.add_argument("--label", action="append", help="a name for each --model, in order (default: its path)")
    p.add_argument("--examples", type=int, default=128, help="first N test problems (default 128)")
    p.add_argument("--samples", type=int, default=4, help="samples per problem (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per reply at most (default 256)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the weights' dtype (default float32)")
    p.add_argument("--prompts-per-batch", type=int, default=16,
                   help="problems sampled in one engine call: more rows a decode step, the same seeds (default 16)")
    p.add_argument("--seed", type=int, default=42, help="the evaluator's seed (default 42)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--data-dir", default=str(DATA), help=f"GSM8K's folder (default {DATA})")
    p.add_argument("--out", default=str(ROOT / "bench" / "gsm8k_eval.jsonl"), help="JSON lines, appended")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="evaluate nothing: compare two labels' records in --out, problem by problem")
    args = p.parse_args(argv)
    if args.compare:
        return args
    args.model = args.model or [str(smollm2_path())]
    args.label = args.label or args.model
    if len(args.label) != len(args.model):
        p.error(f"{len(args.label)} --label for {len(args.model)} --model")
    counts = ("examples", "samples", "max_new_tokens", "prompts_per_batch", "threads")
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in counts if getattr(args, k) < 1]
    if bad:
        p.error(f"{', '.join(bad)}: each must be at least 1")
    return args


def paired(before: dict, after: dict) -> dict:
    "Two evaluations of the same problems and draws: the gain, its standard error over problems, and its parts."
    a, b = (torch.tensor(r["right"], dtype=torch.float64) for r in (before, after))       # (P, n) each
    sa, sb = (torch.tensor(r["stopped"], dtype=torch.float64) for r in (before, after))   # (P, n) each
    if a.shape[1] != b.shape[1]:
        raise SystemExit(f"the records cover {tuple(a.shape)} and {tuple(b.shape)} problems x samples: not paired")
    p = min(a.shape[0], b.shape[0])                  # the first problems of both: the same problems, the same draws
    a, b, sa, sb = a[:p], b[:p], sa[:p], sb[:p]
    gain = (b - a).mean(1)                                                    # (P,) per problem
    acc = lambda right, stop: (right * stop).sum().item() / max(stop.sum().item(), 1)   # right among stopped
    finishing = (sb.mean() - sa.mean()).item() * acc(a, sa)          # more replies stop, right as often as before
    return {"problems": a.shape[0], "samples": a.shape[1], "before": a.mean().item(), "after": b.mean().item(),
            "gain": gain.mean().item(), "gain_se": (gain.std(correction=1) / gain.numel() ** 0.5).item(),
            "stop_before": sa.mean().item(), "stop_after": sb.mean().item(), "right_if_stopped_before": acc(a, sa),
            "right_if_stopped_after": acc(b, sb), "gain_from_finishing": finishing}


def compare(out, labels) -> dict:
    "Print and return `paired` for the newest records of two labels in the JSON lines file `out`."
    records = {r["label"]: r for r in map(json.loads, Path(out).read_text().splitlines()) if "right" in r}
    missing = [label for label in labels if label not in records]
    if missing:
        raise SystemExit(f"no record with per-problem outcomes for {', '.join(missing)} in {out}")
    c = paired(records[labels[0]], records[labels[1]])
    print(f"{labels[0]} -> {labels[1]} on {c['problems']} problems x {c['samples']}: pass@1 {c['before']:.3f} -> "
          f"{c['after']:.3f}, gain {c['gain']:+.3f} ± {c['gain_se']:.3f} (paired, standard error over problems); "
          f"stop rate {c['stop_before']:.2f} -> {c['stop_after']:.2f}, right among stopped "
          f"{c['right_if_stopped_before']:.3f} -> {c['right_if_stopped_after']:.3f}; from finishing within the "
          f"limit alone {c['gain_from_finishing']:+.3f}")
    return c


def main(argv=None):
    "Evaluate each model and append its record (or, with --compare, compare two records)."
    args = parse_args(argv)
    if args.compare:
        return compare(args.out, args.compare)
    torch.set_num_threads(args.threads)
    task = gsm8k_test(args.data_dir)
    for folder, label in zip(args.model, args.label):
        m = evaluate_model(folder, task, args)
        record = {"label": label, "model": str(folder), "examples": args.examples, "samples": args.samples,
                  "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "threads": args.threads,
                  "prompts_per_batch": args.prompts_per_batch, "cpu": cpu_label(),
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **m}
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"{label}: pass@1 {m['pass@1']:.3f} ± {m['pass@1_se']:.3f}, pass@{args.samples} "
              f"{m[f'pass@{args.samples}']:.3f} ± {m[f'pass@{args.samples}_se']:.3f} (± standard error over "
              f"{args.examples} problems), stop rate {m['eval_stop_rate']:.2f}, {m['seconds']:.0f} s, {cpu_label()}",
              flush=True)


if __name__ == "__main__":
    main()
