"""Seconds per GRPO step: TRL's GRPOTrainer against `python -m nanorl.train`, same model, data and settings (by hand).

    python bench/trl_grpo.py [--steps 4] [--folder DIR] [--only nanorl trl ...] [--lr 1e-6] [--threads 2] [--setup]
                             [--nanorl-dtype auto]

Both sides train SmolLM2-135M-Instruct (the folder `bench/smollm2.py` builds; `--folder`, else $NANORL_SMOLLM2, else
its default place) on GSM8K's training questions in nanorl's order (through the model's chat template; the prompt
token ids are checked equal on both sides), rewarded by nanorl's `GSM8K.reward` on the decoded completion. One step
is 2 prompts x 8 samples of at most 128 new tokens, temperature 1, top-k 50, top-p 1, then one AdamW step (lr 1e-6
decaying linearly to 0 over the run, betas (0.9, 0.95), eps 1e-8, no weight decay, no gradient clipping) on the 16
completions in two passes of 8 rows, token-level loss normalization over the step (nanorl `--loss-norm token`, TRL
`loss_type="dapo"`, see tests/test_trl_loss.py), mean-only group baseline (nanorl `--advantage mean`, TRL
`scale_rewards="none"`), no KL, CPU, 2 threads, no vLLM. Each side in its default dtype: nanorl `--dtype auto`
(bf16 on a CPU where it pays, `bf16_pays`; `--nanorl-dtype float32` for the float32 figure), TRL float32.

- nanorl: the real command line, `python -m nanorl.train --model-path DIR ...`, in its own process; the seconds of
  each step are read from its metrics.jsonl (`t_rollout`: sampling, `t_reward`, `t_train`: both passes and the update).
- TRL: `GRPOTrainer` (transformers' `generate` for sampling) in its own process with `torch.set_num_threads`;
  `per_device_train_batch_size=8, gradient_accumulation_steps=2` (so `steps_per_generation=2`: one generation of 16
  completions per optimizer step), `num_iterations=1`, `beta=0`. TRL's configs default to bf16 autocast and gradient
  checkpointing; both are turned off (float32, one forward per pass, as nanorl). A step is timed from the trainer's
  `on_step_begin` to its `on_step_end`; `_generate` (sampling) and `_generate_and_score_completions` (sampling,
  rewards, advantages, padding) are timed inside it; training is the rest (both passes' forward and backward, update).

The first step of each side is left out (its allocations and lazy set-up); the rest are "steady". The first use
creates bench/results/venv-trl (`pip install -c constraints.txt trl transformers pytest -e .`: torch stays the CPU
torch that constraints.txt pins) and re-runs this script inside it; `--setup` only creates it (tests/test_trl_loss.py
runs with its python). TRL and transformers are never installed into nanorl's own venv.
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
VENV = ROOT / "bench" / "results" / "venv-trl"
PINS = ["trl==1.16.0", "transformers==5.23.0", "pytest"]
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"
EXAMPLES, SAMPLES, ROWS_PER_PASS, MAX_NEW, TOP_K = 2, 8, 8, 128, 50


def ensure_venv() -> Path:
    "The benchmark venv's python, created on first use with torch held to constraints.txt's pin."
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV} (trl, transformers, pytest and nanorl; torch pinned by constraints.txt)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt")]
        subprocess.run([*pip, *PINS, "-e", str(ROOT)], check=True)
    check = "import torch, trl; assert torch.version.cuda is None, torch.__version__"
    if subprocess.run([str(python), "-c", check]).returncode != 0:
        raise SystemExit(f"{VENV} lacks trl or holds a CUDA torch; remove it and run again")
    return python


def in_bench_venv() -> bool:
    "Whether this interpreter can import TRL."
    try:
        import trl  # noqa: F401

        return True
    except ImportError:
        return False


def steady(xs):
    "The steps after the first."
    return xs[1:]


def nanorl_run(args, out: Path) -> dict:
    "One run of the real CLI in a fresh process; per-step seconds from its metrics.jsonl."
    cmd = [sys.executable, "-m", "nanorl.train", "--model-path", str(args.folder), "--data-dir", str(args.data_dir)]
    cmd += ["--num-steps", str(args.steps), "--examples-per-step", str(EXAMPLES), "--num-samples", str(SAMPLES)]
    cmd += ["--device-batch-size", str(ROWS_PER_PASS), "--max-new-tokens", str(MAX_NEW), "--temperature", "1.0"]
    cmd += ["--top-k", str(TOP_K), "--lr", str(args.lr), "--loss-norm", "token", "--advantage", "mean"]
    cmd += ["--kl-coef", "0", "--dtype", args.nanorl_dtype, "--eval-every", "1000", "--eval-examples", "2"]
    cmd += ["--save-every", "1000", "--output-dir", str(out), "--device-type", "cpu", "--run", "dummy"]
    print("nanorl:", " ".join(cmd[1:]), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"nanorl.train failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    path = next(out.rglob("metrics.jsonl"))
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        "step": [r["t_rollout"] + r["t_reward"] + r["t_train"] for r in recs],
        "generate": [r["t_rollout"] for r in recs],
        "score": [r["t_reward"] for r in recs],
        "train": [r["t_train"] for r in recs],
        "mean_length": [r["seq_len"] for r in recs],
        "reward": [r["reward"] for r in recs],
        "logp_gap_max": [r["logp_gap_max"] for r in recs],   # the sampler's log-probs against the trainer's
    }


def trl_run(args, out: Path) -> dict:
    "One TRL run in a fresh process (this script with --trl-worker); its per-step seconds."
    cmd = [sys.executable, __file__, "--trl-worker", "--steps", str(args.steps), "--folder", str(args.folder)]
    cmd += ["--data-dir", str(args.data_dir), "--lr", str(args.lr), "--threads", str(args.threads)]
    cmd += ["--worker-out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"the TRL worker failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    line = next(l for l in reversed(res.stdout.splitlines()) if l.startswith("{"))
    return json.loads(line)


def trl_worker(args):
    "Train with TRL's GRPOTrainer for --steps optimizer steps; print one JSON line of per-step seconds."
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nanorl.chat import ChatTokenizer
    from nanorl.tasks import GSM8K

    task = GSM8K(split="train", data_dir=args.data_dir)
    ours = ChatTokenizer.from_directory(args.folder)
    tok = AutoTokenizer.from_pretrained(args.folder)
    problems = list(range(args.steps * EXAMPLES))  # nanorl's step s takes problems 2s and 2s + 1
    prompts = [task[i]["messages"][:1] for i in problems]
    theirs = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)
    if [list(ids) for ids in theirs["input_ids"]] != [ours.render_for_completion(task[i]) for i in problems]:
        raise SystemExit("the chat template gives other prompt ids in transformers than in nanorl")

    def gsm8k_reward(completions, completion_ids, problem, **kwargs):
        "nanorl's GSM8K reward of each decoded completion (nanorl's tokenizer, as its trainer decodes)."
        return [task.reward(task[i], ours.decode(list(ids))) for i, ids in zip(problem, completion_ids)]

    times = {"generate": 0.0, "rollout": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        "GRPOTrainer with its sampling and its whole rollout (sampling, rewards, advantages) timed."

        def _generate(self, prompts):
            start = time.perf_counter()
            result = super()._generate(prompts)
            times["generate"] += time.perf_counter() - start
            return result

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            times["rollout"] += time.perf_counter() - start
            return result

    steps = []

    class StepClock(TrainerCallback):
        "Seconds from each optimizer step's begin to its end, split as timed above."

        def on_step_begin(self, args, state, control, **kwargs):
            times.update(generate=0.0, rollout=0.0, begin=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - times["begin"]
            steps.append(dict(step=wall, generate=times["generate"], score=times["rollout"] - times["generate"]))
            steps[-1]["train"] = wall - times["rollout"]
            print(f"trl step {len(steps) - 1}: {wall:.2f} s (generate {times['generate']:.2f})", flush=True)

    config = GRPOConfig(
        output_dir=str(args.worker_out),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
        max_steps=args.steps,
        per_device_train_batch_size=ROWS_PER_PASS,
        gradient_accumulation_steps=EXAMPLES * SAMPLES // ROWS_PER_PASS,
        num_generations=SAMPLES,
        num_iterations=1,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_k=TOP_K,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="none",
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        max_grad_norm=0.0,
        use_vllm=False,
    )
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "problem": i} for p, i in zip(prompts, problems)])
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=gsm8k_reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[StepClock()],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    result = {k: [s[k] for s in steps] for k in ("step", "generate", "score", "train")}
    result["mean_length"] = [h["completions/mean_length"] for h in logs]
    result["reward"] = [h["reward"] for h in logs]
    print(json.dumps(result))


def versions() -> str:
    "The packages both sides run on, and nanorl's commit (with a mark when its files differ from it)."
    import accelerate
    import torch
    import transformers
    import trl

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "nanorl"], capture_output=True, text=True, cwd=ROOT)
    commit = head.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, trl {trl.__version__}, transformers "
        f"{transformers.__version__}, accelerate {accelerate.__version__}, nanorl {commit}"
    )


def summary(side: str, r: dict) -> dict:
    "Print one side's per-step seconds and its steady medians; return the medians."
    med = {k: statistics.median(steady(r[k])) for k in ("step", "generate", "score", "train")}
    print(
        f"{side:6s} steady step {med['step']:.2f} s = generate {med['generate']:.2f} + score {med['score']:.2f} "
        f"+ train {med['train']:.2f} (median of steps 1-{len(r['step']) - 1}); every step "
        f"{[round(x, 2) for x in r['step']]}; mean completion length {[round(x, 1) for x in r['mean_length']]}; "
        f"reward {[round(x, 3) for x in r['reward']]}"
        + (f"; largest log-prob gap {[round(x, 3) for x in r['logp_gap_max']]}" if "logp_gap_max" in r else ""),
        flush=True,
    )
    return med


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per side (the first is not counted)")
    ap.add_argument("--folder", type=Path, help="the SmolLM2 folder (default: nanorl.real.smollm2_default())")
    ap.add_argument("--data-dir", type=Path, default=GSM8K_DIR, help="GSM8K's train.jsonl/test.jsonl")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nanorl-dtype", default="auto", help="nanorl's --dtype (default: its own default, auto)")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=["nanorl", "trl"],
        default=["nanorl", "trl"],
        help="sides, in order (a side may come again)",
    )
    ap.add_argument("--setup", action="store_true", help="only create the benchmark venv")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not in_bench_venv():
        if os.environ.get("NANORL_TRL_BENCH_VENV"):
            raise SystemExit(f"{sys.executable} cannot import trl")
        python = ensure_venv()
        if args.setup:
            print(python)
            return
        os.environ["NANORL_TRL_BENCH_VENV"] = "1"
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])
    if args.setup:
        print(sys.executable)
        return
    if args.trl_worker:
        return trl_worker(args)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2: the first step is not counted")
    if args.folder is None:  # resolved here, inside the venv that has nanorl
        from nanorl.real import smollm2_default

        args.folder = smollm2_default()
    if not (args.folder / "config.json").exists():
        raise SystemExit(f"no model in {args.folder}: run `python bench/smollm2.py` or pass --folder")
    sys.path.insert(0, str(Path(__file__).parent))
    from nanochat_peer import cpu_label

    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC | {cpu_label()} | {args.threads} threads", flush=True)
    print(f"# {versions()}", flush=True)
    meds = {"nanorl": [], "trl": []}
    for side in args.only:
        load = os.getloadavg()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            r = (nanorl_run if side == "nanorl" else trl_run)(args, Path(out))
        after = os.getloadavg()
        print(
            f"{side}: {args.steps} steps, run {time.perf_counter() - start:.0f} s; load average (1/5/15 min) "
            f"before {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}, after {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}",
            flush=True,
        )
        meds[side].append(summary(side, r))
    if all(meds.values()):  # each side's median over its runs, then the ratios
        med = {s: {k: statistics.median(m[k] for m in runs) for k in runs[0]} for s, runs in meds.items()}
        ratio = {k: med["trl"][k] / med["nanorl"][k] for k in ("step", "generate", "train")}
        print(
            f"nanorl is {ratio['step']:.2f}x faster per steady step (generation {ratio['generate']:.2f}x, "
            f"training {ratio['train']:.2f}x)"
        )
        print(json.dumps({"cpu": cpu_label(), "threads": args.threads, **med, "ratio": ratio}))


if __name__ == "__main__":
    main()
