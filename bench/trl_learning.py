"""Held-out pass@1 against training time: `python -m nanorl.real`'s run against TRL's GRPOTrainer on the same work.

    python bench/trl_learning.py [--steps 40] [--eval-examples 64] [--eval-every 10] [--threads 2] [--seed 0]
                                 [--only nanorl recipe defaults] [--folder DIR] [--out FILE.jsonl] [--setup] [--tiny]

This is a learning comparison, not a speed benchmark (`bench/trl_grpo.py` is that): three arms, each alone on the
machine in its own process, one after another, each training SmolLM2-135M-Instruct (`--folder`, else
`nanorl.real.smollm2_default()`) for `--steps` optimizer steps on the task of `nanorl.real`: `real_tasks(seed)`'s
training split (one-step word problems, asked through the model's chat template with nanorl's instruction), 4
problems x 8 samples a step in nanorl's order (`step_examples`), rewarded by nanorl's `FinalNumber.reward` on the
decoded completion. Float32, CPU, `--threads` torch threads, no gradient checkpointing, no vLLM.

- `nanorl`: the real-model run, `run_real(real_config(...))` as `python -m nanorl.real` calls it (which has no flag
  for `eval_every`), in a small subprocess (this script with a hidden flag); its recipe is `nanorl.real.RECIPE`. It
  evaluates itself every `--eval-every` steps and at the end; its Trainer's `run`, `evaluate` and `save` are wrapped
  (in that process only, nanorl's files untouched) to read the clocks at each evaluation.
- `recipe` (TRL): GRPOTrainer with nanorl's recipe wherever TRL has the knob (`recipe_knobs`, read from nanorl's
  RECIPE and Config): lr 3e-5 decaying linearly to 0, no warm-up, AdamW betas (0.9, 0.95), eps 1e-8, no weight decay,
  no gradient clipping, no KL (beta 0), advantage r - mean (`scale_rewards="none"`), at most 48 new tokens,
  temperature 0.7, top-k 50, top-p 1, one iteration per generation; a reply cut at the token limit (one that does not
  end with TRL's end-of-turn token) is rewarded 0 by the reward function (nanorl `--truncated zero`). nanorl's
  recipe normalizes the loss per pass of 8 rows (`loss_norm="nanochat"`: each pass's token mean, averaged over
  passes), whose TRL counterpart is `loss_type="bnpo"` (tests/test_trl_loss.py) over micro-batches of 8 rows;
  `--recipe-loss dapo` trains with the token mean over the whole step instead.
- `defaults` (TRL): GRPOConfig's own defaults for every learning knob, except what makes it the same work: 8 rows per
  micro-batch x 4 accumulated = 4 prompts x 8 samples a step, `--steps`, the seed, the prompts in order, float32 (no
  bf16) and no gradient checkpointing (a memory knob). The reward is nanorl's, as is (cut replies scored too). Which
  knobs were left at TRL's defaults, and their values, is recorded in every record (`trl_knobs`).

Each TRL arm runs in bench/results/venv-trl (`bench/trl_grpo.py`'s venv: created on first use, `--setup` only creates
it) and saves its model (transformers' `save_pretrained`, with the source folder's tokenizer files) before the first
step, every `--eval-every` steps and at the end. Time is training time: wall-clock and the process's CPU seconds
(`time.process_time()` plus its children's) from the start of training (on_train_begin; nanorl: Trainer.run), less
the time spent saving (TRL, nanorl) and evaluating (nanorl, which evaluates in-process); model loading is left out
of both. Every saved TRL model is then evaluated in nanorl's own venv by nanorl's evaluator exactly as the real run
evaluates itself (a `Trainer` of `real_config` on that folder, its `evaluate()`): the first `--eval-examples` held-out
problems, 4 samples each, RECIPE's temperature, top-k and token limit, the run's seed. TRL's saved base must score
nanorl's step-0 pass@1 (same weights, same evaluator): both are printed.

Output: `--out` (default bench/results/trl_learning.jsonl, one record per arm per evaluation point; records of other
arms with the same settings are kept), a Markdown table beside it (.md) and one plot (.png): held-out pass@1 with
its sampling standard error against wall-clock minutes. The summary gives each arm's final pass@1 and the time
nanorl takes to reach each TRL arm's final pass@1 as a fraction of that arm's time (the goal: at most 1/3, ending at
or above it). Runs and saved models go under `--work-dir` (TRL's saved models are deleted once evaluated unless
`--keep-models`). `--tiny` is the smoke test: 2 steps, an evaluation every step, 4 held-out problems. The script
re-runs itself in nanorl's .venv ($NANORL_PYTHON overrides it); TRL is only ever imported in venv-trl.

Not matched (`NOT_MATCHED`, also in the .md): the random draws and samplers of the two sides; the trained
distribution (nanorl trains its sampler's, temperature and top-k; TRL the tempered softmax over every token); TRL's
micro-batches mix the groups (nanorl's passes are groups); TRL ends a reply only at <|im_end|> (nanorl also at
<|im_start|>).
"""

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import ROOT, ensure_venv  # noqa: E402  the TRL venv, shared with the speed benchmark

RESULTS = ROOT / "bench" / "results"
ARMS = ("nanorl", "recipe", "defaults")
LABELS = {"nanorl": "nanorl (python -m nanorl.real)", "recipe": "TRL, nanorl's recipe", "defaults": "TRL defaults"}
NANORL_TAG = "smollm2"
REEXEC = "NANORL_TRL_LEARNING_PYTHON"  # set once this script has re-run itself in nanorl's interpreter
SETTINGS = ("steps", "eval_every", "eval_examples", "seed", "threads", "cpu")  # records compare only when these agree
TINY = dict(steps=2, eval_every=1, eval_examples=4)
BOOKKEEPING = dict(report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)  # no effect on learning
LEARNING_KNOBS = (  # GRPOConfig fields that change what is learned (recorded with their values, set or default)
    "learning_rate", "lr_scheduler_type", "warmup_steps", "optim", "adam_beta1", "adam_beta2", "adam_epsilon",
    "weight_decay", "max_grad_norm", "beta", "loss_type", "scale_rewards", "epsilon", "epsilon_high", "delta",
    "importance_sampling_level", "num_iterations", "mask_truncated_completions", "top_entropy_quantile",
    "entropy_coef", "disable_dropout", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "max_completion_length", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
    "steps_per_generation", "generation_batch_size", "shuffle_dataset", "seed", "bf16", "gradient_checkpointing",
    "use_vllm",
)  # fmt: skip


NOT_MATCHED = (
    "The samples: each side draws its own random numbers (nanorl: a seed per (run seed, step, problem); TRL: torch's "
    "generator seeded with --seed) with its own sampler (nanorl's engine; transformers' generate), so the rollouts "
    "differ; only their distribution is the same.",
    "The trained distribution: nanorl (logp=sampler) trains the log-probs of the distribution it samples, temperature "
    "0.7 and top-k 50 renormalized; TRL trains log_softmax(logits / temperature) over the whole vocabulary (no top-k) "
    "and has no knob for it.",
    "The loss normalization: nanorl's passes are its 4 groups of 8 samples; TRL shuffles the step's 32 rows before "
    "cutting its 8-row micro-batches, so bnpo averages token means over mixed rows (dapo: one token mean a step).",
    "Stop tokens: nanorl's engine ends a reply at <|im_end|> or <|im_start|> (its tokenizer's stop ids); TRL only at "
    "the eos ids (<|im_end|>), so a reply sampling <|im_start|> goes on in TRL (a reply is cut when it does not end "
    "with TRL's eos).",
    "Times: model loading and trainer set-up are left out of both; evaluation runs inside nanorl's run (left out) "
    "and after TRL's (every saved model, in nanorl's venv). The defaults arm trains with TRL's sampling (temperature "
    "1, no top-k, 512 tokens) but is evaluated, like every arm, with RECIPE's (0.7, top-k 50, 48 tokens).",
)


def run_env(threads: int) -> dict:
    "The environment of every process this script starts."
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}


def nanorl_python() -> str:
    "nanorl's own interpreter: $NANORL_PYTHON, else the repository's .venv, else this one."
    venv = ROOT / ".venv" / "bin" / "python"
    return os.environ.get("NANORL_PYTHON") or (str(venv) if venv.exists() else sys.executable)


def cpu_name() -> str:
    "The CPU's model name from /proc/cpuinfo, with its family and model numbers (which say its generation)."
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        info = {}
    info = {k.strip(): v.strip() for k, v in info.items()}  # the last CPU's fields (all alike)
    if "model name" not in info:
        import platform

        return platform.processor() or platform.machine()
    return f"{info['model name']} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


def process_cpu() -> float:
    "CPU seconds of this process (all its threads) and of its waited-for children."
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


class Clock:
    "Wall and CPU seconds since `start()`, less the spans spent inside `paused()` (saves, evaluations)."

    def __init__(self, wall=time.perf_counter, cpu=process_cpu):
        self.wall, self.cpu, self.t0, self.held = wall, cpu, None, [0.0, 0.0]

    def start(self):
        "Start counting from now."
        self.t0, self.held = (self.wall(), self.cpu()), [0.0, 0.0]

    def read(self) -> dict:
        "Seconds counted so far: wall_s and cpu_s."
        return {"wall_s": self.wall() - self.t0[0] - self.held[0], "cpu_s": self.cpu() - self.t0[1] - self.held[1]}

    @contextmanager
    def paused(self):
        "Leave the time spent inside out of the count."
        w, c = self.wall(), self.cpu()
        try:
            yield
        finally:
            self.held[0] += self.wall() - w
            self.held[1] += self.cpu() - c


def batch_shape() -> dict:
    "RECIPE's step as TRL spells it: 8 rows a micro-batch, 4 accumulated, 8 samples a prompt (4 prompts a step)."
    from nanorl.real import RECIPE

    rows, prompts, samples = RECIPE["device_batch_size"], RECIPE["examples_per_step"], RECIPE["num_samples"]
    return dict(
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=prompts * samples // rows,
        num_generations=samples,
    )


def recipe_knobs(loss_type: str = "bnpo") -> dict:
    "nanorl's recipe (RECIPE over Config's defaults, the HF model's AdamW) in GRPOConfig's names, where TRL has them."
    from nanorl.config import Config
    from nanorl.llama import Llama
    from nanorl.real import RECIPE

    cfg, adamw = Config(**RECIPE), inspect.signature(Llama.setup_optimizers).parameters
    expected = dict(advantage="mean", loss_norm="nanochat", truncated="zero", kl_coef=0.0, entropy_coef=0.0,
                    train_stop=True, logp="sampler", is_correction="none")  # what the TRL arm and NOT_MATCHED assume
    changed = {k: getattr(cfg, k) for k, v in expected.items() if getattr(cfg, k) != v}
    if changed or cfg.lr_schedule not in ("linear", "cosine") or cfg.top_k < 2:
        raise SystemExit(f"nanorl's RECIPE changed ({changed or cfg}): update recipe_knobs to match it")
    (beta1, beta2), eps = adamw["betas"].default, adamw["eps"].default
    return dict(
        learning_rate=cfg.lr,
        lr_scheduler_type=cfg.lr_schedule,
        warmup_steps=cfg.warmup_steps,
        optim="adamw_torch",
        adam_beta1=beta1,
        adam_beta2=beta2,
        adam_epsilon=eps,
        weight_decay=cfg.weight_decay,
        max_grad_norm=0.0,  # nanorl measures the norm, clips nothing
        beta=cfg.kl_coef,
        loss_type=loss_type,
        scale_rewards="none",  # advantage r - mean(r) of the group
        num_iterations=1,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=1.0,
        max_completion_length=cfg.max_new_tokens,
    )


def nanorl_equivalents() -> dict:
    "What nanorl's real run does where TRL has a learning knob (RECIPE over Config's defaults), for the knob table."
    from nanorl.config import Config
    from nanorl.llama import Llama
    from nanorl.real import RECIPE

    cfg, adamw = Config(**RECIPE), inspect.signature(Llama.setup_optimizers).parameters
    rows = cfg.examples_per_step * cfg.num_samples
    return dict(
        learning_rate=f"lr {cfg.lr}",
        lr_scheduler_type=f"lr_schedule {cfg.lr_schedule} (to 0 at the last step)",
        warmup_steps=f"warmup_steps {cfg.warmup_steps}",
        optim="torch.optim.AdamW (its default, foreach)",
        adam_beta1=adamw["betas"].default[0],
        adam_beta2=adamw["betas"].default[1],
        adam_epsilon=adamw["eps"].default,
        weight_decay=f"weight_decay {cfg.weight_decay}",
        max_grad_norm="no clipping (the norm is only measured)",
        beta=f"kl_coef {cfg.kl_coef}",
        loss_type=f"loss_norm {cfg.loss_norm}: each pass's token mean, averaged over passes",
        scale_rewards=f"advantage {cfg.advantage}: r - group mean",
        epsilon="no ratio: logp x advantage (the same gradient on fresh samples)",
        num_iterations="1 (on-policy)",
        mask_truncated_completions=f"truncated {cfg.truncated}: a cut reply's reward is 0",
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p="none",
        min_p="none",
        repetition_penalty="none",
        max_completion_length=f"max_new_tokens {cfg.max_new_tokens}",
        num_generations=f"num_samples {cfg.num_samples}",
        per_device_train_batch_size=f"device_batch_size {cfg.device_batch_size} (a pass holds one group)",
        gradient_accumulation_steps=f"{rows // cfg.device_batch_size} passes a step",
        steps_per_generation="one rollout a step",
        generation_batch_size=f"{rows} rows sampled a step ({cfg.examples_per_step} problems x {cfg.num_samples})",
        shuffle_dataset="problems in order (step_examples)",
        seed="seed",
        bf16=f"dtype {cfg.dtype}",
        gradient_checkpointing="none",
        use_vllm=f"engine {cfg.engine}",
        entropy_coef=f"entropy_coef {cfg.entropy_coef}",
        top_entropy_quantile="every token",
        importance_sampling_level=f"is_correction {cfg.is_correction}",
        disable_dropout="SmolLM2 has no dropout",
    )


def same_work(args) -> dict:
    "The GRPOConfig settings both TRL arms share: the batch shape, steps, seed, data order, float32, no checkpointing."
    return dict(
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        max_steps=args.steps,
        seed=args.seed,
        shuffle_dataset=False,
        **batch_shape(),
    )


def arm_settings(arm: str, args) -> dict:
    "Every GRPOConfig keyword an arm passes (besides output_dir)."
    learning = recipe_knobs(args.recipe_loss) if arm == "recipe" else {}
    return {**same_work(args), **learning, **BOOKKEEPING}


def completion_rewards(task, tokenizer, problems, completion_ids, stop_ids, zero_cut: bool) -> list[float]:
    "nanorl's reward of each completion, decoded without its stop token; 0 for a cut one (no stop token) if zero_cut."
    from nanorl.rollout import completion_text

    out = []
    for i, ids in zip(problems, completion_ids, strict=True):
        ids, conv = [int(t) for t in ids], task[int(i)]
        stopped = bool(ids) and ids[-1] in stop_ids
        reward = float(task.reward(conv, completion_text(tokenizer, ids[:-1] if stopped else ids, 0, conv)))
        out.append(0.0 if zero_cut and not stopped else reward)
    return out


def save_hf(model, folder: Path, source: Path):
    "The model as a Hugging Face folder, with the source folder's tokenizer files (the tokenizer is not trained)."
    from nanorl.checkpoint import HF_SIDE_FILES

    model.save_pretrained(folder)
    for name in HF_SIDE_FILES:
        if name != "generation_config.json" and (source / name).is_file():
            shutil.copyfile(source / name, folder / name)


def jsonable(v):
    "A config value as JSON keeps it (enums by their value)."
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(getattr(v, "value", v))


def trl_knobs(config, given: dict) -> dict:
    "The learning knobs of a GRPOConfig: those this script set, and those left at TRL's defaults, with their values."
    values = {k: jsonable(getattr(config, k)) for k in LEARNING_KNOBS if hasattr(config, k)}
    return {
        "set": {k: v for k, v in values.items() if k in given},
        "default": {k: v for k, v in values.items() if k not in given},
    }


def trl_worker(args):
    "Train one TRL arm; write its saves (step, clocks, folder), per-step seconds and knobs under --worker-out."
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nanorl.chat import ChatTokenizer
    from nanorl.real import real_tasks
    from nanorl.rollout import prompt_ids, step_examples
    from trl_grpo import versions

    out, folder = args.worker_out, args.folder
    task, _ = real_tasks(args.seed)
    ours, tok = ChatTokenizer.from_directory(folder), AutoTokenizer.from_pretrained(folder)
    shape = batch_shape()
    per_step = shape["per_device_train_batch_size"] * shape["gradient_accumulation_steps"] // shape["num_generations"]
    problems = [i for s in range(args.steps) for i in step_examples(s, per_step, len(task))]
    prompts = [task[i]["messages"][:1] for i in problems]
    expected = {p[-1]["content"]: prompt_ids(ours, task[i]) for p, i in zip(prompts, problems)}
    theirs = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)
    if [list(ids) for ids in theirs["input_ids"]] != [expected[p[-1]["content"]] for p in prompts]:
        raise SystemExit("the chat template gives other prompt ids in transformers than nanorl's prompt_ids")

    stop_ids, reward_calls = set(), []

    def nanorl_reward(prompts, completions, completion_ids, problem, **kwargs):
        "nanorl's FinalNumber reward of each decoded completion (recipe: 0 for a cut one); checks the step's problems."
        want = sorted(step_examples(len(reward_calls), per_step, len(task)))
        if sorted(set(problem)) != want:
            raise SystemExit(f"TRL's step {len(reward_calls)} sampled problems {sorted(set(problem))}, not {want}")
        reward_calls.append(len(problem))
        return completion_rewards(task, ours, problem, completion_ids, stop_ids, args.arm == "recipe")

    class CheckedGRPOTrainer(GRPOTrainer):
        "GRPOTrainer that checks every prompt it samples is tokenized as nanorl's prompt_ids."

        def _generate(self, prompts):
            result = super()._generate(prompts)
            if [list(ids) for ids in result[0]] != [expected[p[-1]["content"]] for p in prompts]:
                raise SystemExit("TRL sampled from prompt ids other than nanorl's prompt_ids")
            return result

    clock, saves, steps = Clock(), [], []

    def save(model, step: int):
        "Record the clocks, then save the model (its time left out)."
        saves.append({"step": step, **clock.read(), "folder": str(out / f"step_{step:06d}")})
        with clock.paused():
            save_hf(model, Path(saves[-1]["folder"]), folder)

    class SaveClock(TrainerCallback):
        "Saves at the start, every --eval-every steps and at the end; each optimizer step's seconds."

        def on_train_begin(self, targs, state, control, model=None, **kwargs):
            clock.start()
            save(model, 0)

        def on_step_begin(self, targs, state, control, **kwargs):
            steps.append(time.perf_counter())

        def on_step_end(self, targs, state, control, model=None, **kwargs):
            steps[-1] = time.perf_counter() - steps[-1]
            print(f"trl {args.arm} step {state.global_step}: {steps[-1]:.2f} s", flush=True)
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                save(model, state.global_step)

    given = arm_settings(args.arm, args)
    config = GRPOConfig(output_dir=str(out / "trainer"), **given)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "problem": i} for p, i in zip(prompts, problems)])
    trainer = CheckedGRPOTrainer(
        model=model,
        reward_funcs=nanorl_reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[SaveClock()],
    )
    stop_ids.update(trainer.eos_token_ids)  # the ids that end TRL's completions: <|im_end|> for SmolLM2
    checkpointing = "is_activation_checkpointing" if hasattr(trainer.model, "is_activation_checkpointing") else None
    if getattr(trainer.model, checkpointing or "is_gradient_checkpointing", False):
        raise SystemExit("gradient checkpointing is on: the arms must run one forward per pass")
    trainer.train()
    if len(reward_calls) != args.steps:
        raise SystemExit(f"TRL generated {len(reward_calls)} times in {args.steps} steps")
    logs = [h for h in trainer.state.log_history if "completions/clipped_ratio" in h]
    train = [
        {"step": h["step"], "reward": h["reward"], "stop_rate": 1 - h["completions/clipped_ratio"],
         "mean_length": h["completions/mean_length"]}
        for h in logs
    ]  # fmt: skip
    info = dict(saves=saves, step_s=steps, train=train, knobs=trl_knobs(config, given), versions=versions(),
                eos_token_ids=sorted(stop_ids))  # fmt: skip
    (out / "trl_run.json").write_text(json.dumps(info, indent=1))


def nanorl_worker(args):
    "The real-model run with eval_every; the clocks at each of its evaluations go to --worker-out/clock.jsonl."
    import nanorl.train as train_module
    from nanorl.demo import set_threads
    from nanorl.real import real_config, run_real
    from nanorl.train import validate

    set_threads(args.threads)
    clock, lines, trainer = Clock(), [], train_module.Trainer
    run, evaluate, save = trainer.run, trainer.evaluate, trainer.save

    def timed_run(self):
        "Trainer.run with the clocks started."
        clock.start()
        return run(self)

    def timed_evaluate(self):
        "Trainer.evaluate with the clocks read before it and its time left out."
        lines.append(clock.read())
        with clock.paused():
            return evaluate(self)

    def timed_save(self, *a, **kw):
        "Trainer.save with its time left out."
        with clock.paused():
            return save(self, *a, **kw)

    trainer.run, trainer.evaluate, trainer.save = timed_run, timed_evaluate, timed_save
    cfg = real_config(args.folder, str(args.worker_out), num_steps=args.steps, eval_examples=args.eval_examples,
                      eval_every=args.eval_every, seed=args.seed, model_tag=NANORL_TAG)  # fmt: skip
    print(f"nanorl: run_real({cfg})", flush=True)
    run_real(validate(cfg))
    (args.worker_out / "clock.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def evaluate_folder(folder: Path, eval_examples: int, seed: int, scratch: Path, tag: str) -> dict:
    "nanorl's evaluation of a HF folder, as the real run evaluates itself: a Trainer of real_config, its evaluate()."
    import nanorl.train as train_module
    from nanorl.real import real_config, real_tasks

    cfg = real_config(folder, str(scratch), eval_examples=eval_examples, seed=seed, model_tag=tag)
    cfg = train_module.validate(cfg)
    trainer = train_module.Trainer(cfg, tasks=real_tasks(seed))
    try:
        return trainer.evaluate()
    finally:
        getattr(trainer.engine, "close", lambda: None)()
        train_module.release_run_dir(trainer.out)


def same_weights(a: Path, b: Path) -> bool:
    "Whether nanorl loads the same weights from two Hugging Face folders."
    import torch

    from nanorl.llama import load_llama

    x, y = load_llama(a).state_dict(), load_llama(b).state_dict()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def eval_worker(args):
    "Evaluate each saved folder of --worker-out/trl_run.json with nanorl's evaluator; results to evals.jsonl."
    from nanorl.demo import set_threads

    set_threads(args.threads)
    saves = json.loads((args.worker_out / "trl_run.json").read_text())["saves"]
    base = Path(saves[0]["folder"])
    same = same_weights(base, args.folder)
    print(f"TRL's saved base {base} has the source folder's weights, as nanorl loads them: {same}", flush=True)
    rows = []
    for s in saves:
        scratch = args.worker_out / "eval"
        m = evaluate_folder(Path(s["folder"]), args.eval_examples, args.seed, scratch, f"eval_{s['step']}")
        rows.append({"step": s["step"], "base_weights_equal": same if s["step"] == 0 else None, **m})
        print(f"{args.arm} step {s['step']}: pass@1 {m['pass@1']:.3f} ± {m['pass@1_se']:.3f}", flush=True)
    (args.worker_out / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def eval_updates(step: int, num_steps: int, eval_every: int) -> int:
    "Updates behind the evaluation logged with `step` (nanorl evaluates before a step, the last one after it)."
    before = step % eval_every == 0 and (step == 0 or step != num_steps - 1)
    return step if before else num_steps


def nanorl_points(metrics: list[dict], clocks: list[dict], num_steps: int, eval_every: int) -> list[dict]:
    "One point per evaluation of the nanorl run: updates, clocks, pass@1 and its error, stop rate."
    evals = [r for r in metrics if "pass@1" in r]
    if len(evals) != len(clocks):
        raise SystemExit(f"nanorl logged {len(evals)} evaluations but its clock saw {len(clocks)}")
    return [
        {"step": eval_updates(r["step"], num_steps, eval_every), **c, "pass@1": r["pass@1"],
         "pass@1_se": r["pass@1_se"], "stop_rate": r.get("eval_stop_rate")}
        for r, c in zip(evals, clocks)
    ]  # fmt: skip


def step_seconds(metrics: list[dict]) -> list[float]:
    "nanorl's seconds per step: sampling, rewards and training (and a vLLM sync, if any)."
    return [sum(r.get(k, 0.0) for k in ("t_rollout", "t_reward", "t_train", "t_sync")) for r in metrics]


def run_checked(cmd: list[str], threads: int, what: str):
    "Run a worker process (its output shown as it comes); stop with its exit status if it fails."
    print(f"\n# {what}: {' '.join(cmd)}", flush=True)
    res = subprocess.run(cmd, env=run_env(threads), cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{what} failed (exit status {res.returncode})")


def worker_cmd(python: str, flag: str, args, work: Path, arm: str) -> list[str]:
    "This script as a worker (`flag`) with this run's settings."
    cmd = [python, __file__, flag, "--arm", arm, "--worker-out", str(work), "--folder", str(args.folder)]
    cmd += ["--steps", str(args.steps), "--eval-every", str(args.eval_every)]
    cmd += ["--eval-examples", str(args.eval_examples)]
    return cmd + ["--threads", str(args.threads), "--seed", str(args.seed), "--recipe-loss", args.recipe_loss]


def run_nanorl(args, work: Path) -> tuple[list[dict], dict]:
    "The nanorl arm: its evaluation points and its run's facts."
    run_checked(worker_cmd(nanorl_python(), "--nanorl-worker", args, work, "nanorl"), args.threads, "nanorl arm")
    metrics_path = next(work.rglob("metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    clocks = [json.loads(line) for line in (work / "clock.jsonl").read_text().splitlines() if line.strip()]
    from nanorl.real import RECIPE

    run = dict(num_steps=args.steps, eval_every=args.eval_every, eval_examples=args.eval_examples, seed=args.seed)
    info = {"step_s": step_seconds(metrics), "config": {**RECIPE, **run}}
    return nanorl_points(metrics, clocks, args.steps, args.eval_every), info


def run_trl(args, work: Path, arm: str) -> tuple[list[dict], dict]:
    "A TRL arm: train in the TRL venv, evaluate its saves in nanorl's venv; its evaluation points and facts."
    run_checked(worker_cmd(str(ensure_venv()), "--trl-worker", args, work, arm), args.threads, f"TRL arm {arm}")
    run_checked(worker_cmd(nanorl_python(), "--eval-worker", args, work, arm), args.threads, f"evaluation of {arm}")
    info = json.loads((work / "trl_run.json").read_text())
    evals = {e["step"]: e for e in map(json.loads, (work / "evals.jsonl").read_text().splitlines())}
    points = [
        {"step": s["step"], "wall_s": s["wall_s"], "cpu_s": s["cpu_s"], "pass@1": evals[s["step"]]["pass@1"],
         "pass@1_se": evals[s["step"]]["pass@1_se"], "stop_rate": evals[s["step"]].get("eval_stop_rate"),
         "base_weights_equal": evals[s["step"]]["base_weights_equal"]}
        for s in info["saves"]
    ]  # fmt: skip
    if not args.keep_models:
        for s in info["saves"]:
            shutil.rmtree(s["folder"], ignore_errors=True)
    return points, info


def arm_records(arm: str, points: list[dict], info: dict, settings: dict) -> list[dict]:
    "The output records of one arm: one per evaluation point."
    steps = info["step_s"]
    extra = {"step_s_median": statistics.median(steps) if steps else None, "step_s": [round(s, 3) for s in steps]}
    if arm == "nanorl":
        extra["nanorl_config"] = info["config"]
    else:
        extra |= {"trl_knobs": info["knobs"], "versions": info["versions"], "train": info["train"]}
    return [{"arm": arm, **p, **settings, **extra} for p in points]


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
    "The new records, and the old ones of arms not run now that share the new records' settings."
    arms = {r["arm"] for r in new}
    settings = {tuple(r.get(k) for k in SETTINGS) for r in new}
    kept = [r for r in old if r["arm"] not in arms and tuple(r.get(k) for k in SETTINGS) in settings]
    order = {a: i for i, a in enumerate(ARMS)}
    return sorted(kept + new, key=lambda r: (order.get(r["arm"], len(ARMS)), r["step"]))


def by_arm(records: list[dict]) -> dict[str, list[dict]]:
    "Records grouped by arm (in ARMS order), each by step."
    groups = {a: sorted((r for r in records if r["arm"] == a), key=lambda r: r["step"]) for a in ARMS}
    return {a: rs for a, rs in groups.items() if rs}


def reach_fraction(nanorl: list[dict], trl: list[dict], key: str = "wall_s") -> dict:
    "When nanorl first reaches TRL's final pass@1, as a fraction of TRL's whole time; whether it ends at or above it."
    target, trl_time = trl[-1]["pass@1"], trl[-1][key]
    hit = next((p for p in nanorl if p["pass@1"] >= target), None)
    fraction = None if hit is None or trl_time <= 0 else hit[key] / trl_time
    above = nanorl[-1]["pass@1"] >= target
    return {
        "target": target, "trl_s": trl_time, "nanorl_s": hit and hit[key], "nanorl_step": hit and hit["step"],
        "fraction": fraction, "nanorl_final": nanorl[-1]["pass@1"], "ends_at_or_above": above,
        "goal_met": fraction is not None and fraction <= 1 / 3 and above,
    }  # fmt: skip


def summary_lines(records: list[dict]) -> list[str]:
    "Each arm's final pass@1 and time; nanorl's time to reach each TRL arm's final pass@1, as a fraction of TRL's."
    arms, lines = by_arm(records), []
    for arm, rs in arms.items():
        last = rs[-1]
        lines.append(
            f"{arm}: final pass@1 {last['pass@1']:.3f} ± {last['pass@1_se']:.3f} after {last['step']} steps, "
            f"{last['wall_s'] / 60:.1f} min wall, {last['cpu_s'] / 60:.1f} CPU-min; median step "
            f"{last['step_s_median']:.1f} s"
        )
    for arm in ("recipe", "defaults"):
        if "nanorl" not in arms or arm not in arms:
            continue
        wall, cpu = (reach_fraction(arms["nanorl"], arms[arm], k) for k in ("wall_s", "cpu_s"))
        if wall["fraction"] is None:
            reached = f"never reaches the TRL {arm} arm's final pass@1 {wall['target']:.3f}"
        else:
            reached = (
                f"reaches the TRL {arm} arm's final pass@1 {wall['target']:.3f} at step {wall['nanorl_step']}, "
                f"{wall['nanorl_s'] / 60:.1f} min = {wall['fraction']:.2f} of TRL's {wall['trl_s'] / 60:.1f} min "
                f"(CPU time: {cpu['fraction']:.2f})"
            )
        end = "at or above" if wall["ends_at_or_above"] else "below"
        goal = "goal met" if wall["goal_met"] else "goal NOT met"
        lines.append(f"nanorl {reached}; ends {end} it ({wall['nanorl_final']:.3f}): {goal} (<= 1/3 and at or above)")
    return lines


def base_check(records: list[dict]) -> list[str]:
    "Step-0 pass@1 of nanorl's own evaluation and of each TRL arm's saved base (the same weights)."
    arms = by_arm(records)
    if "nanorl" not in arms:
        return []
    ref, lines = arms["nanorl"][0], []
    for arm in ("recipe", "defaults"):
        if arm in arms:
            b = arms[arm][0]
            gap, se = abs(b["pass@1"] - ref["pass@1"]), max(ref["pass@1_se"], b["pass@1_se"], 1e-12)
            verdict = "equal" if gap == 0 else "within 2 standard errors" if gap <= 2 * se else "DIFFERENT"
            lines.append(
                f"base pass@1: nanorl step 0 {ref['pass@1']:.4f} ± {ref['pass@1_se']:.4f}, the TRL {arm} arm's saved "
                f"base {b['pass@1']:.4f} ± {b['pass@1_se']:.4f} ({verdict}; saved weights equal the source's: "
                f"{b.get('base_weights_equal')})"
            )
    return lines


def knob_table(records: list[dict], nanorl: dict | None = None) -> list[str]:
    "Markdown rows: each TRL learning knob per TRL arm (marked where left at TRL's default), and nanorl's counterpart."
    arms = {a: rs[0]["trl_knobs"] for a, rs in by_arm(records).items() if a != "nanorl"}
    if not arms:
        return []
    nanorl = nanorl_equivalents() if nanorl is None else nanorl
    names = sorted({k for knobs in arms.values() for part in knobs.values() for k in part})
    rows = ["| knob | nanorl (RECIPE) | " + " | ".join(f"TRL {a}" for a in arms) + " |"]
    rows.append("|---|---|" + "---|" * len(arms))
    for k in names:
        cells = [str(nanorl.get(k, ""))]
        for knobs in arms.values():
            default = k in knobs["default"]
            value = knobs["default"].get(k) if default else knobs["set"].get(k)
            cells.append(f"{value} (TRL default)" if default else f"{value}")
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    return rows


def threads(record: dict) -> str:
    "The torch threads of a record, in words."
    return f"{record['threads']} torch thread" + ("s" if record["threads"] != 1 else "")


def write_markdown(records: list[dict], path: Path):
    "The table of every evaluation point, the summary, the base check and the knobs, as Markdown."
    first = records[0]
    lines = [
        "# nanorl against TRL's GRPOTrainer: held-out pass@1 against training time (bench/trl_learning.py)",
        "",
        f"{first['cpu']}, {threads(first)}; {first['steps']} steps, evaluation every {first['eval_every']} "
        f"steps on {first['eval_examples']} held-out problems x 4 samples, seed {first['seed']}; {first['date']}.",
        "Times are training only (saving and evaluation left out); ± is the sampling standard error over problems.",
        "",
        "| arm | step | wall min | CPU min | pass@1 | ± se | eval stop rate |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        stop = "" if r.get("stop_rate") is None else f"{r['stop_rate']:.3f}"
        lines.append(
            f"| {r['arm']} | {r['step']} | {r['wall_s'] / 60:.2f} | {r['cpu_s'] / 60:.2f} | {r['pass@1']:.3f} "
            f"| {r['pass@1_se']:.3f} | {stop} |"
        )
    lines += ["", *[f"- {line}" for line in summary_lines(records) + base_check(records)], ""]
    lines += ["Learning knobs of the TRL arms (values as GRPOConfig holds them):", "", *knob_table(records), ""]
    lines += ["Not matched between nanorl and TRL:", "", *[f"- {n}" for n in NOT_MATCHED], ""]
    path.write_text("\n".join(lines))


def write_plot(records: list[dict], path: Path):
    "One plot: held-out pass@1 (± sampling standard error) against wall-clock minutes, one line per arm."
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for arm, rs in by_arm(records).items():
        x, y, e = [r["wall_s"] / 60 for r in rs], [r["pass@1"] for r in rs], [r["pass@1_se"] for r in rs]
        ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=LABELS.get(arm, arm))
    first = records[0]
    ax.set_title(f"Held-out pass@1 against training time\n{first['cpu']}, {threads(first)}", fontsize=10)
    ax.set_xlabel("wall-clock minutes of training (saving and evaluation left out)")
    ax.set_ylabel("held-out pass@1 (error bars: ± sampling standard error)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(new: list[dict], out: Path) -> list[dict]:
    "Merge the new records into --out; write it, its Markdown table and its plot; return every record."
    old = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    records = merge_records(old, new)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    write_markdown(records, out.with_suffix(".md"))
    write_plot(records, out.with_suffix(".png"))
    return records


def parse_args(argv=None):
    "The command line."
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of every arm (default 40)")
    ap.add_argument("--eval-examples", type=int, default=64, help="held-out problems per evaluation (default 64)")
    ap.add_argument("--eval-every", type=int, default=10, help="evaluate (TRL: save) every N steps (default 10)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads of every process (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="the task's and the runs' seed (default 0)")
    ap.add_argument("--only", nargs="+", choices=ARMS, default=list(ARMS), help="arms to run, in order (default all)")
    ap.add_argument("--folder", type=Path, help="the SmolLM2 folder (default: nanorl.real.smollm2_default())")
    ap.add_argument("--out", type=Path, default=RESULTS / "trl_learning.jsonl", help="the records (.md, .png beside)")
    ap.add_argument("--work-dir", type=Path, default=RESULTS / "trl_learning_runs", help="runs and saved models")
    ap.add_argument("--recipe-loss", choices=("bnpo", "dapo"), default="bnpo",
                    help="the recipe arm's loss_type: bnpo = nanorl's per-pass token mean (default), dapo = per step")
    ap.add_argument("--keep-models", action="store_true", help="keep TRL's saved models after their evaluation")
    ap.add_argument("--setup", action="store_true", help="only create the TRL venv (bench/results/venv-trl)")
    ap.add_argument("--tiny", action="store_true", help="the smoke test: --steps 2 --eval-every 1 --eval-examples 4")
    for hidden in ("--trl-worker", "--nanorl-worker", "--eval-worker"):
        ap.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY)
    for name in ("steps", "eval_examples", "eval_every", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run_arms(args) -> list[dict]:
    "Run each arm of --only in turn, alone on the machine; their records."
    settings = dict(steps=args.steps, eval_every=args.eval_every, eval_examples=args.eval_examples, seed=args.seed,
                    threads=args.threads, cpu=cpu_name(), date=f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
                    recipe_loss=args.recipe_loss)  # fmt: skip
    records = []
    for arm in args.only:
        work = args.work_dir / arm
        shutil.rmtree(work, ignore_errors=True)  # this script's own earlier run of the arm
        work.mkdir(parents=True)
        start, load = time.perf_counter(), os.getloadavg()
        points, info = run_nanorl(args, work) if arm == "nanorl" else run_trl(args, work, arm)
        print(f"# {arm}: {time.perf_counter() - start:.0f} s in all (load average before {load[0]:.2f}, after "
              f"{os.getloadavg()[0]:.2f}); seconds per step {[round(s, 2) for s in info['step_s']]}", flush=True)
        records += arm_records(arm, points, info, settings)
    return records


def main():
    "Entry point: a worker, the venv set-up, or the whole comparison."
    args = parse_args()
    if args.setup:
        print(ensure_venv())
        return
    if args.trl_worker:
        return trl_worker(args)  # started with --folder
    if not (args.nanorl_worker or args.eval_worker or os.environ.get(REEXEC)) and nanorl_python() != sys.executable:
        os.environ[REEXEC] = nanorl_python()  # once: nanorl's side runs in nanorl's venv
        os.execv(nanorl_python(), [nanorl_python(), __file__, *sys.argv[1:]])
    if args.folder is None:
        from nanorl.real import smollm2_default

        args.folder = smollm2_default()
    if args.nanorl_worker:
        return nanorl_worker(args)
    if args.eval_worker:
        return eval_worker(args)
    if not (args.folder / "config.json").exists():
        raise SystemExit(f"no model in {args.folder}: run `python bench/smollm2.py` or pass --folder")
    print(f"# {cpu_name()} | {args.threads} threads | arms {args.only} | {args.steps} steps", flush=True)
    records = write_outputs(run_arms(args), args.out)
    print(f"\nwrote {args.out}, {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")
    for line in summary_lines(records) + base_check(records):
        print(line)


if __name__ == "__main__":
    main()
