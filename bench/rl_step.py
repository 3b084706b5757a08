"""Seconds per RL step, nanorl against nanochat's own chat_rl, side by side on this CPU (run by hand).

The workload is chat_rl's, shrunk to a CPU: a random nanochat-shaped depth-4 model (n_embd 256, 2 heads, vocab
32768) written by nanochat's own code, real GSM8K, `--examples-per-step 2 --num-samples 8 --device-batch-size 8
--max-new-tokens 64`, 2 threads; nanorl in its default dtype (`--dtype auto`: bf16 where `bf16_pays`), nanochat's
chat_rl in its own (float32 on a CPU). Both sides read the same base dir (see `nanochat_peer.py`): nanochat runs
`scripts/chat_rl.py` unmodified through its harness (which times each step from outside), nanorl runs
`python -m nanorl.train` with the same flags. Runs alternate (nanochat, nanorl, nanochat, ...) in fresh processes so
both see the same machine load. A step is steady from the second one on: nanochat's first compiles its optimizer
(about a minute) and both evaluate there.

    python bench/rl_step.py [--rounds 2] [--steps 8] [--threads 2] [--isa native|avx2] [--nanochat-src PATH]
                            [--before CHECKOUT | --old-flags | --dtype bfloat16]

`--dtype bfloat16` compares nanorl in float32 (the peer) with nanorl under `--dtype bfloat16`, side by side: the
figure to read on a CPU with native bf16 (avx512_bf16 or AMX in lscpu). With `--model-path DIR` (a Hugging Face
folder, e.g. the SmolLM2 one `bench/smollm2.py` builds) that comparison runs bench/trl_grpo.py's SmolLM2 step instead:
2 GSM8K problems x 8 samples of at most 128 tokens, top-k 50, AdamW at 1e-6, token-level loss.
"""

import argparse, json, os, statistics, subprocess, sys, tempfile, time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from nanochat_peer import GSM8K_DIR, add_peer_args, base_dir, cpu_label, peer_env, run_peer

OLD = ["--logp", "model", "--no-train-stop"]  # the raw softmax trained, the stop token never (nanochat's update)
FLAGS = [
    "--device-type",
    "cpu",
    "--run",
    "dummy",
    "--model-tag",
    "d4",
    "--model-step",
    "0",
    "--examples-per-step",
    "2",
    "--num-samples",
    "8",
    "--device-batch-size",
    "8",
    "--max-new-tokens",
    "64",
    "--eval-every",
    "1000",
    "--eval-examples",
    "8",
    "--save-every",
    "1000",
]


HF_FLAGS = ["--device-type", "cpu", "--run", "dummy", "--examples-per-step", "2", "--num-samples", "8",
            "--device-batch-size", "8", "--max-new-tokens", "128", "--top-k", "50", "--lr", "1e-6", "--loss-norm",
            "token", "--eval-every", "1000", "--eval-examples", "2", "--save-every", "1000"]


def nanochat_run(args, base) -> dict:
    "One run of nanochat's chat_rl for --steps optimizer steps: seconds of each steady step, split as it reports."
    env = peer_env(args, NANOCHAT_BASE_DIR=str(base))
    out = run_peer(
        args,
        "nanochat_rl_step_wrapper.py",
        "--nanochat-dir",
        args.nanochat_src,
        "--steps",
        args.steps,
        "--",
        *FLAGS,
        env=env,
    )
    steady = slice(1, None)
    return {"step": out["per_step_wall_s"][steady], "rollout": out["per_step_gen_s"][steady]}


def nanorl_run(args, base, tree=None, extra=()) -> dict:
    "One run of `python -m nanorl.train` (`tree`'s nanorl if given, `extra` flags): seconds per steady step and parts."
    with tempfile.TemporaryDirectory() as out:
        model = ["--model-path", str(args.model_path)] if args.model_path else ["--base-dir", str(base)]
        cmd = [
            sys.executable,
            "-m",
            "nanorl.train",
            *(HF_FLAGS if args.model_path else FLAGS),
            *model,
            "--data-dir",
            str(GSM8K_DIR),
            "--num-steps",
            str(args.steps),
            "--output-dir",
            out,
            *extra,
        ]
        env = peer_env(args)
        if tree:  # an older checkout of nanorl, for before/after figures
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        records = [json.loads(line) for line in next(Path(out).rglob("metrics.jsonl")).open()]
    steady = [r for r in records[1:] if "t_eval" not in r]
    return {
        "step": [r["t_rollout"] + r["t_reward"] + r["t_train"] for r in steady],
        "rollout": [r["t_rollout"] for r in steady],
        "train": [r["t_train"] for r in steady],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_peer_args(ap)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (the first is not counted)")
    ap.add_argument("--before", default=None, help="instead of nanochat, compare with nanorl from this checkout")
    ap.add_argument("--old-flags", action="store_true",
                    help="instead of nanochat, compare with nanorl's update before it was on-policy: " + " ".join(OLD))
    ap.add_argument("--dtype", default=None, help="instead of nanochat, compare nanorl float32 with nanorl in this dtype")
    ap.add_argument("--model-path", type=Path, default=None, help="with --dtype: the step of this Hugging Face folder")
    args = ap.parse_args()
    if args.model_path and not args.dtype:
        raise SystemExit("--model-path compares dtypes: pass --dtype bfloat16 too")
    base = base_dir(args)
    now = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    print(f"# {now} | {cpu_label()} | isa {args.isa} | {args.threads} threads", flush=True)
    peer = "before" if args.before else "old" if args.old_flags else "float32" if args.dtype else "nanochat"
    peer_run = {
        "before": lambda a, b: nanorl_run(a, b, Path(args.before).resolve()),
        "old": lambda a, b: nanorl_run(a, b, extra=OLD),
        "float32": lambda a, b: nanorl_run(a, b, extra=["--dtype", "float32"]),
        "nanochat": nanochat_run,
    }[peer]
    ours = (lambda a, b: nanorl_run(a, b, extra=["--dtype", args.dtype])) if args.dtype else nanorl_run
    runs = {peer: [], "nanorl": []}
    for _ in range(args.rounds):
        for side, run in ((peer, peer_run), ("nanorl", ours)):
            t0 = time.perf_counter()
            r = run(args, base)
            runs[side].append(r)
            parts = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in r.items() if k != "step")
            print(
                f"{side:8s} median step {statistics.median(r['step']):.3f} s ({parts}); "
                f"steps {[round(x, 2) for x in r['step']]}; run {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    med = {side: statistics.median(x for r in rs for x in r["step"]) for side, rs in runs.items()}
    print(
        f"median steady step over {args.rounds} runs each: {peer} {med[peer]:.3f} s, nanorl "
        f"{med['nanorl']:.3f} s: nanorl {med[peer] / med['nanorl']:.2f}x faster"
    )
    steps = {f"{k}_step": v for k, v in med.items()}
    print(
        json.dumps(
            {"isa": args.isa, "threads": args.threads, "cpu": cpu_label(), "dtype": args.dtype or "auto", **steps,
             "ratio": med[peer] / med["nanorl"]}
        )
    )


if __name__ == "__main__":
    main()
