"""Why SmolLM2 stops learning (and stopping): the real-model recipe of `18_real` under several arms, side by side.

Each arm changes one thing of `nanorl.real`'s recipe (SmolLM2-135M-Instruct, one-step word problems scored by the
reply's final number, 4 problems x 8 samples a step, 48 new tokens, temperature 0.7, AdamW). Every (arm, seed) is a
fresh process; `--jobs` of them run at once, each with `--threads` torch threads, so arms share the machine alike.
One JSON line per run goes to `--out`; the table (training reward by quarter of the run, held-out pass@1 before and
after with standard errors, stop rates, reply length, minutes) is printed and written beside it as Markdown.

    python bench/learning.py [--arms defaults,no_train_stop,...] [--seeds 0,1] [--steps 20] [--eval-examples 64]
                             [--jobs 2] [--threads 1] [--out bench/learning_runs.jsonl]
    python bench/learning.py --table-only          # the table of the runs already in --out
    python bench/learning.py --first-step --threads 2   # AdamW's first step: weights moved, replies stopping
    python bench/learning.py --task multi-step [--init FOLDER] [--keep DIR] ...   # the two- and three-step task
"""

import argparse, json, math, os, statistics, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from nanochat_peer import cpu_label  # noqa: E402  the CPU kind, as every benchmark here prints it

# each arm: the Config changes against the recipe as it was before the study (lr 3e-5, no warm-up, cut replies kept,
# the sampler's distribution and the stop token trained); "hold_stop_row" is not a Config field: see `hold_stop_rows`
BEFORE = dict(lr=3e-5, warmup_steps=0, truncated="keep", logp="sampler", train_stop=True)
ARMS = {
    "defaults": {},
    "no_train_stop": dict(train_stop=False),
    "nanochat": dict(logp="model", train_stop=False),
    "low_lr_warmup": dict(lr=1e-5, warmup_steps=5),
    "mask_truncated": dict(truncated="mask"),
    "zero_truncated": dict(truncated="zero"),
    "hold_stop_row": dict(hold_stop_row=True),
    "zero_warmup": dict(truncated="zero", warmup_steps=5),
    "zero_low_lr_warmup": dict(truncated="zero", lr=1e-5, warmup_steps=5),
    "mask_low_lr_warmup": dict(truncated="mask", lr=1e-5, warmup_steps=5),
    "zero_bf16": dict(truncated="zero", dtype="bfloat16"),   # the recipe under --dtype bfloat16 (native bf16 CPUs)
}


def hold_stop_rows(trainer):
    "After every optimizer step, put the stop tokens' rows of the (tied) embedding back as they were."
    import torch
    from nanorl.engine import stop_token_ids

    ids = torch.tensor(sorted(stop_token_ids(trainer.tokenizer)), dtype=torch.long)
    vocab = trainer.model.config.vocab_size
    tables = [p for p in trainer.model.parameters() if p.dim() == 2 and p.shape[0] == vocab]   # embedding (= head)
    step = trainer.optimizer.step

    def held_step(*args, **kwargs):
        kept = [t.detach()[ids].clone() for t in tables]
        out = step(*args, **kwargs)
        with torch.no_grad():
            for t, k in zip(tables, kept):
                t[ids] = k
        return out

    trainer.optimizer.step = held_step


def one_run(arm: str, seed: int, steps: int, eval_examples: int, threads: int, out_dir: str, task: str = "one-step",
            init: str | None = None) -> dict:
    "Train one (arm, seed) on `task` in this process, from SmolLM2 or the model folder `init`; its summary."
    import nanorl.train as train_module
    from nanorl.demo import set_threads
    from nanorl.real import real_config, real_tasks, smollm2_path

    set_threads(threads)
    changes = {**BEFORE, **ARMS[arm]}
    held = changes.pop("hold_stop_row", False)
    if held:                                   # every Trainer this process builds holds its stop rows
        init = train_module.Trainer.__init__
        train_module.Trainer.__init__ = lambda self, *a, **kw: (init(self, *a, **kw), hold_stop_rows(self))[0]
    cfg = real_config(smollm2_path(init), out_dir, task, num_steps=steps, eval_every=steps,
                      eval_examples=eval_examples, save_every=steps, seed=seed, **changes)
    t0 = time.perf_counter()
    records = train_module.train(cfg, tasks=real_tasks(seed, task))
    minutes = (time.perf_counter() - t0) / 60
    evals = [r for r in records if "pass@1" in r]
    return {"arm": arm, "seed": seed, "task": task, "init": init, "run_dir": str(cfg.run_dir()), "steps": steps, "eval_examples": eval_examples, "threads": threads,
            "minutes": minutes, "config": {k: getattr(cfg, k) for k in (*BEFORE, "dtype")} | {"hold_stop_row": held},
            "before": evals[0]["pass@1"], "before_se": evals[0]["pass@1_se"], "after": evals[-1]["pass@1"],
            "after_se": evals[-1]["pass@1_se"], "eval_stop_before": evals[0].get("eval_stop_rate"),
            "eval_stop_after": evals[-1].get("eval_stop_rate"), "cpu": cpu_label(),
            "steps_log": [{k: r.get(k) for k in ("step", "reward", "seq_len", "stop_rate", "truncated_frac",
                                                 "stop_adv", "stop_trained", "grad_norm", "lrm", "entropy",
                                                 "zero_signal_frac")} for r in records]}


def first_step(threads: int, **changes) -> dict:
    "One RL step from SmolLM2: how far AdamW moved each weight (in units of the step's rate), and replies stopping."
    import torch
    from nanorl.demo import set_threads
    from nanorl.real import real_config, real_tasks, smollm2_path
    from nanorl.rollout import sample_seeds, step_examples
    from nanorl.step import sample
    from nanorl.train import Trainer

    set_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = real_config(smollm2_path(), out, num_steps=40, **{**BEFORE, **changes})
        trainer = Trainer(cfg, tasks=real_tasks(cfg.seed))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        record = trainer.step(0)
        moved = torch.cat([((p.detach() - before[n]).abs() / record["lr"]).flatten()
                           for n, p in trainer.model.named_parameters()])                   # (parameters,)
        indices = step_examples(0, cfg.examples_per_step, len(trainer.train_task))
        again = sample(trainer.engine, trainer.policy, trainer.tokenizer, trainer.train_task, indices, cfg.sampling(),
                       sample_seeds(cfg.seed, 0, indices), cfg.rollout_rows)  # step 0's seeds, the new weights
    return {"changes": changes, "lr_step0": record["lr"], "stop_before": record["stop_rate"],
            "stop_after": 1 - torch.tensor(again.cut).float().mean().item(),
            "median_move_over_lr": moved.median().item(), "moved_over_half_lr": (moved > 0.5).float().mean().item(),
            "parameters": moved.numel(), "cpu": cpu_label()}


def quarters(values):
    "Means of the four quarters of a list."
    n = len(values)
    return [statistics.fmean(values[i * n // 4:(i + 1) * n // 4] or [math.nan]) for i in range(4)]


def mean_se(values, ses=None):
    "Mean over seeds and its standard error: within-run errors combined (ses) or the spread over seeds."
    m = statistics.fmean(values)
    if ses is not None:
        return m, math.sqrt(sum(s * s for s in ses)) / len(ses)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def table(runs) -> str:
    "The Markdown table: one row per arm, means over its seeds."
    head = ("| arm | seeds | train reward by quarter | pass@1 before | pass@1 after | gain | stop rate, last quarter "
            "| eval stop rate after | reply length, last quarter | min/run |\n|---" + "|---" * 9 + "|")
    lines, arms = [head], list(dict.fromkeys(map(label, runs)))
    for arm in arms:
        rs = [r for r in runs if label(r) == arm]
        q = [quarters([s["reward"] for s in r["steps_log"]]) for r in rs]
        qm = [statistics.fmean(x[i] for x in q) for i in range(4)]
        b, bse = mean_se([r["before"] for r in rs], [r["before_se"] for r in rs])
        a, ase = mean_se([r["after"] for r in rs], [r["after_se"] for r in rs])
        gain, gse = mean_se([r["after"] - r["before"] for r in rs])
        last = lambda key: statistics.fmean(quarters([s[key] for s in r["steps_log"]])[3] for r in rs)  # noqa: E731
        stop_after = statistics.fmean(r["eval_stop_after"] for r in rs)
        lines.append(f"| {arm} | {len(rs)} | {' / '.join(f'{x:.2f}' for x in qm)} | {b:.3f} ± {bse:.3f} "
                     f"| {a:.3f} ± {ase:.3f} | {gain:+.3f} ± {gse:.3f} | {last('stop_rate'):.2f} | {stop_after:.2f} "
                     f"| {last('seq_len'):.1f} | {statistics.fmean(r['minutes'] for r in rs):.1f} |")
    return "\n".join(lines)


def label(run) -> str:
    "A run's row in the table: its arm, with its task and starting model when they are not the recorded run's."
    task = run.get("task", "one-step")
    return (f"{task}: " if task != "one-step" else "") + run["arm"] + (" (curriculum)" if run.get("init") else "")


def launch(arm, seed, args) -> dict:
    "One (arm, seed) in a fresh process; its summary."
    keep = Path(args.keep) / f"{args.task}-{arm}-{seed}" if args.keep else None
    with (tempfile.TemporaryDirectory(prefix=f"nanorl-{arm}-{seed}-") if keep is None else nullcontext(keep)) as out:
        cmd = [sys.executable, __file__, "--one", arm, str(seed), "--steps", str(args.steps),
               "--eval-examples", str(args.eval_examples), "--threads", str(args.threads), "--run-dir", str(out),
               "--task", args.task] + (["--init", args.init] if args.init else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{arm} seed {seed} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{arm:>20} seed {seed}: pass@1 {result['before']:.3f} -> {result['after']:.3f}, "
          f"eval stop {result['eval_stop_after']:.2f}, {result['minutes']:.1f} min", flush=True)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-examples", type=int, default=64)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "learning_runs.jsonl")
    p.add_argument("--task", default="one-step", help="nanorl.real's task: one-step or multi-step")
    p.add_argument("--init", help="start from this model folder (e.g. a one-step run's step_<N>: a curriculum)")
    p.add_argument("--keep", help="keep each run's directory under KEEP/<task>-<arm>-<seed> (default: deleted)")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--first-step", action="store_true",
                   help="instead: one step at lr 3e-5 and at lr 1e-5 with 5 warm-up steps, and stopping before/after")
    p.add_argument("--one", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], int(args.one[1]), args.steps, args.eval_examples, args.threads,
                                 args.run_dir, args.task, args.init)))
        return
    if args.first_step:
        for changes in (dict(lr=3e-5), dict(lr=1e-5, warmup_steps=5)):
            print(json.dumps(first_step(args.threads, **changes)), flush=True)
        return
    if not args.table_only:
        arms = args.arms.split(",")
        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            raise SystemExit(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
        jobs = [(a, int(s)) for s in args.seeds.split(",") for a in arms]
        print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC | {cpu_label()} | {len(jobs)} runs, {args.jobs} at "
              f"a time, {args.threads} thread(s) each", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool, open(args.out, "a") as f:
            for result in pool.map(lambda job: launch(*job, args), jobs):
                f.write(json.dumps(result) + "\n")
                f.flush()
    runs = [json.loads(line) for line in open(args.out)]
    text = table(runs)
    print(text)
    args.out.with_suffix(".md").write_text(f"{cpu_label()}\n\n{text}\n")


if __name__ == "__main__":
    main()
