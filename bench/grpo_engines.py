"""Seconds per GRPO step of `python -m nanorl.train` on SmolLM2 with `--engine nanorl` and `--engine vllm` (by hand).

    python bench/grpo_engines.py [--rounds 2] [--steps 3] [--folder DIR] [--engines nanorl vllm] [--threads 2]

The same command line twice per round, only `--engine` differs, each run a fresh process (nanorl, vllm, nanorl, vllm,
...): SmolLM2-135M-Instruct (the folder `bench/smollm2.py` builds; `--folder`, else its default place), GSM8K's
training questions in nanorl's order, the settings of `bench/trl_grpo.py`'s nanorl side by default (2 prompts x 8
samples, at most 128 new tokens, temperature 1, top-k 50, passes of 8 rows, `--loss-norm token --advantage mean`, no
KL, lr 1e-6, float32, seed 0, CPU), `--threads` threads, vLLM in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
From each run's metrics.jsonl: `t_rollout` (sampling), `t_reward`, `t_train` (both passes and the update), `t_sync`
(vLLM only: the trainer's weights into vLLM after the update), `logp_gap_max` and `is_ratio_outside` (the engine's
log-probs of its sampled tokens against the trainer's). A step is their sum; the two evaluations (`--eval-examples`,
before the first step and after the last) and the checkpoint at the end lie outside it. Start-up is the seconds from
launching the process to the trainer's first line (imports, model load, vLLM's engine start). The first step of each
run is left out ("steady" steps), unless a run has one step only (`--steps 1`, a check that the script works).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from nanochat_peer import cpu_label  # noqa: E402  the CPU kind, as every benchmark here prints it
from trl_grpo import EXAMPLES, GSM8K_DIR, MAX_NEW, ROWS_PER_PASS, SAMPLES, TOP_K  # noqa: E402  the same settings

FIELDS = ("step", "t_rollout", "t_reward", "t_train", "t_sync", "logp_gap_max", "is_ratio_outside", "seq_len")


def command(args, engine: str, out: Path) -> list[str]:
    "The training command line of one run; only --engine differs between the sides."
    cmd = [sys.executable, "-m", "nanorl.train", "--model-path", str(args.folder), "--data-dir", str(args.data_dir)]
    cmd += ["--engine", engine, "--num-steps", str(args.steps), "--examples-per-step", str(args.examples)]
    cmd += ["--num-samples", str(args.samples), "--device-batch-size", str(args.rows), "--max-new-tokens",
            str(args.max_new), "--temperature", "1.0", "--top-k", str(TOP_K), "--lr", str(args.lr)]
    cmd += ["--loss-norm", "token", "--advantage", "mean", "--kl-coef", "0", "--dtype", "float32", "--seed", "0"]
    cmd += ["--eval-every", "1000", "--eval-examples", "2", "--save-every", "1000", "--output-dir", str(out)]
    return cmd + ["--device-type", "cpu", "--run", "dummy"]


def run(args, engine: str) -> dict:
    "One training run in a fresh process: its start-up seconds, wall seconds, load averages and per-step records."
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryFile("w+") as err:
        cmd, load = command(args, engine, Path(out)), os.getloadavg()
        start, ready = time.perf_counter(), None
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
        lines = []
        for line in proc.stdout:                    # the trainer's first line comes once its set-up is done
            if ready is None and line.startswith("nanorl: "):
                ready = time.perf_counter() - start
            lines.append(line)
        code, wall = proc.wait(), time.perf_counter() - start
        if code != 0:
            err.seek(0)
            raise SystemExit(f"--engine {engine} failed ({code}): {' '.join(cmd[1:])}\n{''.join(lines)[-2000:]}\n"
                             f"{err.read()[-4000:]}")
        recs = [json.loads(ln) for ln in next(Path(out).rglob("metrics.jsonl")).read_text().splitlines() if ln.strip()]
    for r in recs:
        r["step_seconds"] = r["t_rollout"] + r["t_reward"] + r["t_train"] + r.get("t_sync", 0.0)
    evals = sum(r.get("t_eval", 0.0) for r in recs)    # the evaluations before the first and after the last step
    return dict(engine=engine, startup=ready, wall=wall, evals=evals, load=load, load_after=os.getloadavg(), recs=recs)


def steady(recs: list[dict]) -> list[dict]:
    "The steps after the first (all of them when there is one)."
    return recs[1:] or recs


def cell(xs, fmt="{:.2f}") -> str:
    "median [min-max] of a list, the one value, or n/a."
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def table(results: dict, engines) -> str:
    "The markdown table: each row's median [min-max] over every steady step (or run) of each engine."
    def steps(e, key):
        return [r.get(key) for res in results[e] for r in steady(res["recs"])]

    rows = [("step: sampling + reward + training + sync (s)", "step_seconds", "{:.2f}"),
            ("sampling, `t_rollout` (s)", "t_rollout", "{:.2f}"), ("reward, `t_reward` (s)", "t_reward", "{:.3f}"),
            ("training, `t_train` (s)", "t_train", "{:.2f}"), ("weight sync, `t_sync` (s)", "t_sync", "{:.3f}"),
            ("`logp_gap_max`", "logp_gap_max", "{:.1e}"), ("`is_ratio_outside`", "is_ratio_outside", "{:.4f}"),
            ("mean completion length (tokens)", "seq_len", "{:.1f}")]
    lines = ["| median [min-max] | " + " | ".join(f"`--engine {e}`" for e in engines) + " |",
             "|---|" + "---|" * len(engines)]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(cell(steps(e, key), fmt) for e in engines) + " |")
    for label, key in (("start-up, per process (s)", "startup"), ("whole run, per process (s)", "wall"),
                       ("of which both evaluations, `t_eval` (s)", "evals")):
        lines.append(f"| {label} | " + " | ".join(cell([res[key] for res in results[e]], "{:.1f}") for e in engines)
                     + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, help="a Hugging Face folder (default: nanorl.real.smollm2_default())")
    ap.add_argument("--data-dir", type=Path, default=GSM8K_DIR, help="GSM8K's train.jsonl/test.jsonl")
    ap.add_argument("--engines", nargs="+", default=["nanorl", "vllm"], choices=["nanorl", "vllm"])
    ap.add_argument("--rounds", type=int, default=2, help="processes of each engine, alternating")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not counted)")
    ap.add_argument("--examples", type=int, default=EXAMPLES, help="prompts per step")
    ap.add_argument("--samples", type=int, default=SAMPLES, help="samples per prompt")
    ap.add_argument("--rows", type=int, default=ROWS_PER_PASS, help="rows per training pass")
    ap.add_argument("--max-new", type=int, default=MAX_NEW)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.folder is None:
        from nanorl.real import smollm2_default

        args.folder = smollm2_default()
    if not (args.folder / "config.json").exists():
        raise SystemExit(f"no model in {args.folder}: run `python bench/smollm2.py` or pass --folder")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "nanorl"], capture_output=True, text=True, cwd=ROOT)
    commit = head.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# {now} | {cpu_label()} | {args.threads} threads | {args.folder.name} | nanorl {commit}", flush=True)
    print(f"# {args.examples} prompts x {args.samples} samples, at most {args.max_new} new tokens, passes of "
          f"{args.rows} rows, {args.steps} steps per run, {args.rounds} rounds", flush=True)
    results = {e: [] for e in args.engines}
    for rnd in range(args.rounds):
        for e in args.engines:
            res = run(args, e)
            results[e].append(res)
            per = "; ".join(f"{r['step']}: {r['step_seconds']:.2f} (sample {r['t_rollout']:.2f}, train "
                            f"{r['t_train']:.2f}, sync {r.get('t_sync', 0):.3f}, gap {r.get('logp_gap_max', 0):.1e})"
                            for r in res["recs"])
            la, lb = res["load"], res["load_after"]
            print(f"  round {rnd + 1} {e:6s}: start-up {res['startup']:.1f} s, run {res['wall']:.1f} s, load "
                  f"{la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} -> {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f}; steps {per}",
                  flush=True)
    print(f"\n{now}, {cpu_label()}, {args.threads} threads; steady steps (after the first) of {args.rounds} "
          f"process(es) per engine\n")
    print(table(results, args.engines))
    print("\n" + json.dumps({e: [{k: res[k] for k in ("startup", "wall", "evals", "load", "load_after")}
                                  | {"recs": [{k: r.get(k) for k in (*FIELDS, "step_seconds")} for r in res["recs"]]}
                                  for res in results[e]] for e in args.engines}))


if __name__ == "__main__":
    sys.exit(main())
