"""The floor of one GRPO step on this CPU: matmul peak and memory bandwidth measured, nanorl's step against it.

    python bench/roofline.py [--threads N] [--models smollm2,d4,qwen] [--steps 3] [--json PATH] [--quick]
                             [--smollm2 DIR] [--nanochat-base DIR] [--nanochat-tag d4] [--d4-new-tokens 64]
                             [--qwen DIR] [--qwen-new-tokens 384]

1. Peak: the best of several large square products in float32, and in bf16 where the CPU multiplies it natively
   (avx512_bf16 or AMX in /proc/cpuinfo), at `--threads` (default: all cores), each through `torch.mm` (MKL on
   CPUs) and oneDNN's linear with the weight reordered once (nanorl's packed weights): on AVX-512 AMD CPUs MKL runs
   its AVX2 code, and oneDNN is about twice as fast.
2. Bandwidth: a sum over a 1 GiB float32 tensor (read) and a `copy_` of one (read + write counted), best of repeats.
   Both are measured before and after the nanorl runs and the better figure kept: on a shared machine a busy minute
   only lowers them, and a lowered peak would raise the floors.
3. Floors of one step: 2 prompts x 8 samples x 128 new tokens on SmolLM2-135M-Instruct (bench/trl_grpo.py's step) and
   2 x 8 x 64 on the nanochat-shaped d4 (bench/rl_step.py's step), and with `--models qwen` 4 x 8 x 384 on
   Qwen2.5-Coder-0.5B-Instruct (the GSM8K run of `nanorl.real --problems gsm8k`, prompts as that run renders them),
   from each model's shape (built on the meta device from its config.json or checkpoint meta). What a floor counts
   (`Floor`'s fields name the parts):
   - rollout: the prompt's prefill once per group (its weights read once, its FLOPs at the peak), then one decode step
     per further new token, each the max of (all matmul weights + the KV cache so far, read at the read bandwidth;
     the prompt's keys/values once per group) and (its FLOPs: 2 x matmul parameters x rows + attention, at the peak);
     sampling (top-k over the vocabulary), detokenizing and the engine's bookkeeping count 0;
   - reward: 0 (string checks of 16 replies);
   - train: forward + backward (3 x the forward's FLOPs) over every trained token (2 x matmul parameters, head
     included) plus each group's prompt once through the body (the gradient flows back through its keys and
     values), plus causal attention (QK^T and AV, only the visible half), at the peak; the weights' and activations'
     traffic is taken as hidden under the arithmetic; then the optimizer: AdamW's float32 state read and written at
     the bandwidth (p, g, m, v read; p, m, v written: 28 bytes a parameter; Muon: p, g, momentum read, p, momentum
     written: 20 bytes) plus Newton-Schulz's 5 iterations per Muon matrix at the faster dtype's peak.
   "matmul parameters" are the weights of the linear layers (the head included, a tied head once); embedding and
   value-embedding tables are lookups and count neither FLOPs nor a full read.
4. Measured: `python -m nanorl.train` in a fresh process with the flags of bench/trl_grpo.py's nanorl side (SmolLM2)
   or bench/rl_step.py (d4, when bench/results/nanochat-base holds its checkpoint: `python bench/rl_step.py` builds
   it) or the GSM8K recipe (qwen: bf16, passes of 2 replies; a step takes minutes), `--steps` steps, the first left
   out; its metrics.jsonl's t_rollout, t_reward and t_train, each against its
   floor at that step's prompts and mean completion length (the floor at the full new-token limit is shown too).

Prints the CPU kind first, then a markdown table for bench/README.md; `--json PATH` writes every figure.
"""

import argparse, json, math, os, statistics, subprocess, sys, tempfile, time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from nanochat_peer import GSM8K_DIR, RESULTS, ROOT, cpu_label
from rl_step import FLAGS as D4_FLAGS
from trl_grpo import EXAMPLES, ROWS_PER_PASS, SAMPLES, TOP_K

FLOAT32_BYTES, BF16_BYTES = 4, 2
ADAMW_BYTES, MUON_BYTES = 28, 20        # float32 optimizer traffic per parameter (see the docstring)
NS_STEPS = 5                            # Newton-Schulz iterations per Muon update
D4_PROMPT_GUESS = 100                   # prompt tokens assumed for d4 when its tokenizer is not there


# ---------------------------------------------------------------- the machine

@dataclass
class Peak:
    "The best matmul rate of one dtype: (n, n) @ (n, n) at the fastest size tried."
    dtype: str
    n: int
    seconds: float
    gflops: float
    kernel: str = "torch.mm"            # the faster of torch.mm (MKL on CPUs) and oneDNN's linear


@dataclass
class Bandwidth:
    "Memory bandwidth over a tensor of `gib` GiB: a sum (read) and a copy_ (read + write counted)."
    gib: float
    read_gbs: float
    copy_gbs: float


@dataclass
class Machine:
    "What the floors are computed from, and where it was measured."
    cpu: str
    threads: int
    torch: str
    l3_mib: float | None
    native_bf16: bool
    float32: Peak
    bf16: Peak | None
    bandwidth: Bandwidth

    def best_with(self, other: "Machine") -> "Machine":
        "Each figure at the better of two measurements (before and after the runs: a busy machine only lowers them)."
        pick = lambda a, b, key: a if b is None or (a is not None and getattr(a, key) >= getattr(b, key)) else b
        bw = Bandwidth(self.bandwidth.gib, max(self.bandwidth.read_gbs, other.bandwidth.read_gbs),
                       max(self.bandwidth.copy_gbs, other.bandwidth.copy_gbs))
        return Machine(self.cpu, self.threads, self.torch, self.l3_mib, self.native_bf16,
                       pick(self.float32, other.float32, "gflops"), pick(self.bf16, other.bf16, "gflops"), bw)

    def fast_gflops(self) -> float:
        "The faster dtype's peak (Newton-Schulz runs in it)."
        return max(self.float32.gflops, self.bf16.gflops if self.bf16 else 0.0)


def cpu_flags() -> set:
    "The flags of /proc/cpuinfo (empty where it cannot be read)."
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def l3_mib() -> float | None:
    "The L3 cache of cpu0 in MiB, from sysfs (None where it is not reported)."
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None
    scale = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}
    return float(size[:-1]) * scale[size[-1]] if size[-1] in scale else float(size) / 2**20


def best_seconds(fn, repeats: int) -> float:
    "The shortest of `repeats` timed calls of fn, after one untimed call."
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def onednn_product(a: torch.Tensor, b: torch.Tensor):
    "a @ b.T through oneDNN's linear with b reordered once (nanorl's PackedLinear), or None where it cannot run."
    lp = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if lp is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b)
        lp(a, packed, None, "none", [], "")
    except RuntimeError:
        return None
    return lambda: lp(a, packed, None, "none", [], "")


def matmul_peak(dtype: torch.dtype, sizes, repeats: int) -> Peak:
    "The best GFLOPS of (n, n) @ (n, n) over `sizes`, through torch.mm (into an output) and oneDNN's linear."
    best = None
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)    # (n, n) each
        out = torch.empty(n, n, dtype=dtype)
        kernels = {"torch.mm": lambda: torch.mm(a, b, out=out), "oneDNN linear": onednn_product(a, b)}
        for kernel, fn in kernels.items():
            if fn is None:
                continue
            s = best_seconds(fn, repeats)
            peak = Peak(str(dtype).removeprefix("torch."), n, s, 2 * n**3 / s / 1e9, kernel)
            best = peak if best is None or peak.gflops > best.gflops else best
    return best


def bandwidth(gib: float, repeats: int) -> Bandwidth:
    "Read bandwidth (sum of a float32 tensor) and copy bandwidth (read + write) over `gib` GiB, best of repeats."
    n = int(gib * 2**30) // FLOAT32_BYTES
    src, dst = torch.ones(n), torch.zeros(n)                               # pages touched before timing
    nbytes = n * FLOAT32_BYTES
    read = best_seconds(lambda: src.sum(), repeats)
    copy = best_seconds(lambda: dst.copy_(src), repeats)
    return Bandwidth(gib, nbytes / read / 1e9, 2 * nbytes / copy / 1e9)


def measure_machine(threads: int, quick: bool) -> Machine:
    "Peaks and bandwidth at `threads` threads; tiny sizes with quick."
    torch.set_num_threads(threads)
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    sizes, repeats, gib = ([256], 2, 1 / 16) if quick else ([2048, 4096], 5, 1.0)
    fp32 = matmul_peak(torch.float32, sizes, repeats)
    bf16 = matmul_peak(torch.bfloat16, sizes, repeats) if native else None
    return Machine(cpu_label(), threads, torch.__version__, l3_mib(), native, fp32, bf16, bandwidth(gib, repeats))


# ---------------------------------------------------------------- the models

@dataclass
class ModelShape:
    "What a floor needs of a model: its matrices, attention widths and optimizer groups."
    name: str
    layers: int
    q_dim: int                  # heads x head_dim
    kv_dim: int                 # kv heads x head_dim
    vocab: int
    matmul_params: int          # linear-layer weights, head included (a tied head once)
    head_params: int            # the unembedding matrix
    total_params: int
    muon_shapes: list = field(default_factory=list)   # (rows, cols) of each Muon matrix
    adamw_params: int = 0

    @property
    def body_params(self) -> int:
        "Matmul parameters without the head: what a prompt position runs through."
        return self.matmul_params - self.head_params

    @property
    def muon_params(self) -> int:
        "Parameters updated by Muon."
        return sum(r * c for r, c in self.muon_shapes)


def shape_of(model: torch.nn.Module, name: str, layers: int, q_dim: int, kv_dim: int, vocab: int,
             muon_prefix: str | None = None) -> ModelShape:
    "A model's shape from its (meta-device) modules: linear weights, the head, its Muon and AdamW parameters."
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    params = dict(model.named_parameters())                                # a tied weight is listed once
    muon = [tuple(p.shape) for n, p in params.items() if muon_prefix and n.startswith(muon_prefix)]
    total = sum(p.numel() for p in params.values())
    return ModelShape(name, layers, q_dim, kv_dim, vocab, sum(p.numel() for p in params.values() if id(p) in linear),
                      model.lm_head.weight.numel(), total, muon, total - sum(r * c for r, c in muon))


def folder_shape(folder: Path, name: str) -> ModelShape:
    "A Hugging Face model's shape from its config.json (nanorl's decoder built on the meta device)."
    from nanorl.llama import DecoderConfig, Llama

    cfg = DecoderConfig.from_folder(folder)
    with torch.device("meta"):
        model = Llama(cfg)
    return shape_of(model, name, cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim,
                    cfg.num_key_value_heads * cfg.head_dim, cfg.vocab_size)


def nanochat_config(base: Path, tag: str):
    "(GPTConfig, where it came from): the checkpoint's meta in `base`, else nanochat's rule for a depth-4 model."
    from nanorl.checkpoint import config_from_meta, read_meta
    from nanorl.model import GPTConfig

    folder = base / "chatsft_checkpoints" / tag
    if (folder / "meta_000000.json").exists():
        return config_from_meta(read_meta(folder, 0), "current"), str(folder / "meta_000000.json")
    rule = "nanochat's rule for depth 4 (width 4 x 64 in 128-wide heads, vocab 32768): no checkpoint at " + str(folder)
    return GPTConfig(sequence_len=2048, vocab_size=32768, n_layer=4, n_head=2, n_kv_head=2, n_embd=256), rule


def d4_shape(base: Path, tag: str) -> tuple[ModelShape, str]:
    "The nanochat-shaped model's shape (nanorl's GPT on the meta device) and where its config came from."
    from nanorl.model import GPT

    cfg, source = nanochat_config(base, tag)
    with torch.device("meta"):
        model = GPT(cfg)
    shape = shape_of(model, f"nanochat {tag}", cfg.n_layer, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim,
                     cfg.vocab_size, muon_prefix="transformer.h.")
    return shape, source


# ---------------------------------------------------------------- the floor

@dataclass
class Workload:
    "One step: `prompts` groups of `samples` rows, `prompt_tokens` (mean) each, `new_tokens` (mean) per row."
    prompts: int
    samples: int
    new_tokens: float
    prompt_tokens: float

    @property
    def rows(self) -> int:
        "Rows sampled and trained."
        return self.prompts * self.samples


@dataclass
class Floor:
    "Seconds one step cannot go below on the measured machine, by phase, with the counts behind them."
    rollout_s: float
    rollout_compute_bound_s: float      # decode steps (and the prefill) whose FLOPs outweigh their bytes
    rollout_flops: float
    rollout_bytes: float
    train_s: float
    train_passes_s: float
    train_flops: float
    optimizer_s: float
    optimizer_bytes: float
    ns_flops: float
    reward_s: float = 0.0

    @property
    def step_s(self) -> float:
        "The whole step's floor."
        return self.rollout_s + self.reward_s + self.train_s


def attention_flops(q_dim: int, layers: int, start: float, end: float) -> float:
    "Forward FLOPs of causal attention (QK^T and AV) for positions start..end-1 of one row: 4 x q_dim x keys seen."
    keys = (end * (end + 1) - start * (start + 1)) / 2                     # sum over positions p of (p + 1)
    return 4 * q_dim * layers * keys


def rollout_floor(m: ModelShape, w: Workload, gflops: float, gbs: float, value_bytes: int):
    "(seconds, seconds in compute-bound steps, FLOPs, bytes) of the prefill and each decode step, max(compute, memory)."
    weights = m.matmul_params * value_bytes
    kv_token = 2 * m.kv_dim * m.layers * value_bytes                       # keys + values of one position
    prefill_flops = w.prompts * (2 * m.body_params * w.prompt_tokens + 2 * m.head_params
                                 + attention_flops(m.q_dim, m.layers, 0, w.prompt_tokens))
    steps = [(prefill_flops, weights)]
    for j in range(1, max(1, math.ceil(w.new_tokens))):                    # the first new token comes from the prefill
        keys = w.prompt_tokens + j                                         # positions seen by the token fed at step j
        flops = w.rows * (2 * m.matmul_params + 4 * m.q_dim * m.layers * keys)
        kv = (w.prompts * w.prompt_tokens + w.rows * j) * kv_token         # the prompt's cache once per group
        steps.append((flops, weights + kv))
    seconds = [max(f / gflops / 1e9, b / gbs / 1e9) for f, b in steps]
    bound = sum(s for s, (f, b) in zip(seconds, steps) if f / gflops > b / gbs)
    return sum(seconds), bound, sum(f for f, _ in steps), sum(b for _, b in steps)


def train_flops(m: ModelShape, w: Workload) -> float:
    "Forward + backward FLOPs of the passes: trained tokens through the model, each prompt once through the body."
    trained = w.rows * w.new_tokens
    forward = 2 * m.matmul_params * trained + w.prompts * 2 * m.body_params * w.prompt_tokens
    forward += w.rows * attention_flops(m.q_dim, m.layers, w.prompt_tokens, w.prompt_tokens + w.new_tokens)
    forward += w.prompts * attention_flops(m.q_dim, m.layers, 0, w.prompt_tokens)
    return 3 * forward                                                     # backward: twice the forward


def ns_flops(m: ModelShape) -> float:
    "Newton-Schulz FLOPs of one Muon update: per iteration X X^T, A A and B X on the (small, large) orientation."
    total = 0.0
    for r, c in m.muon_shapes:
        small, large = min(r, c), max(r, c)
        total += NS_STEPS * (4 * small * small * large + 2 * small**3)
    return total


def floor(m: ModelShape, w: Workload, gflops: float, gbs: float, value_bytes: int, fast_gflops: float) -> Floor:
    "The step's floor at `gflops` and `gbs` with weights and KV cache of `value_bytes` each."
    roll_s, bound_s, roll_flops, roll_bytes = rollout_floor(m, w, gflops, gbs, value_bytes)
    flops = train_flops(m, w)
    opt_bytes = m.adamw_params * ADAMW_BYTES + m.muon_params * MUON_BYTES
    ns = ns_flops(m)
    opt_s = opt_bytes / gbs / 1e9 + ns / fast_gflops / 1e9
    passes_s = flops / gflops / 1e9
    return Floor(roll_s, bound_s, roll_flops, roll_bytes, passes_s + opt_s, passes_s, flops, opt_s, opt_bytes, ns)


# ---------------------------------------------------------------- the measured step

@dataclass
class StepTimes:
    "One step of metrics.jsonl: its phases in seconds, mean completion length, and its prompts' mean length."
    step: int
    rollout: float
    reward: float
    train: float
    completion_tokens: float
    prompt_tokens: float

    @property
    def total(self) -> float:
        "t_rollout + t_reward + t_train."
        return self.rollout + self.reward + self.train


def smollm2_flags(folder: Path, new_tokens: int) -> list:
    "bench/trl_grpo.py's nanorl flags (2 x 8 rows, passes of 8, top-k 50, AdamW 1e-6, float32), one eval problem."
    return ["--model-path", str(folder), "--examples-per-step", str(EXAMPLES), "--num-samples", str(SAMPLES),
            "--device-batch-size", str(ROWS_PER_PASS), "--max-new-tokens", str(new_tokens), "--temperature", "1.0",
            "--top-k", str(TOP_K), "--lr", "1e-6", "--loss-norm", "token", "--advantage", "mean", "--kl-coef", "0",
            "--dtype", "float32", "--eval-every", "1000", "--eval-examples", "1", "--save-every", "1000",
            "--device-type", "cpu", "--run", "dummy"]


def qwen_flags(folder: Path, new_tokens: int) -> list:
    "The GSM8K run's flags (`nanorl.real --problems gsm8k`'s Config) for `python -m nanorl.train`."
    from nanorl.real import real_config

    cfg = real_config(folder, task="gsm8k", max_new_tokens=new_tokens)
    names = ("task", "model_tag", "examples_per_step", "num_samples", "device_batch_size", "max_new_tokens",
             "temperature", "top_k", "lr", "warmup_steps", "truncated", "dtype", "device_type")
    flags = [f for n in names for f in (f"--{n.replace('_', '-')}", str(getattr(cfg, n)))]
    return ["--model-path", str(folder), *flags, "--eval-every", "1000", "--eval-examples", "1", "--save-every", "1000",
            "--run", "dummy"]


def d4_flags(base: Path, tag: str, new_tokens: int) -> list:
    "bench/rl_step.py's nanorl flags for the d4 (chat_rl's, shrunk) with this base dir, tag and token limit."
    flags = list(D4_FLAGS)
    for name, value in (("--model-tag", tag), ("--max-new-tokens", str(new_tokens)), ("--eval-examples", "1")):
        flags[flags.index(name) + 1] = value
    return [*flags, "--base-dir", str(base)]


def run_train(flags: list, steps: int, threads: int) -> list[dict]:
    "The records of metrics.jsonl from `python -m nanorl.train` with `flags` for `steps` steps, in a fresh process."
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "nanorl.train", *flags, "--data-dir", str(GSM8K_DIR), "--num-steps", str(steps),
               "--output-dir", out]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        path = next(Path(out).rglob("metrics.jsonl"))
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_prompt_tokens(tokenizer, steps: int, examples: int = EXAMPLES, task=None) -> list[float]:
    "Mean prompt length of each step's problems (default GSM8K train, nanorl's order), rendered as the trainer does."
    from nanorl.rollout import prompt_ids, step_examples
    from nanorl.tasks import GSM8K

    task = task if task is not None else GSM8K("main", "train", data_dir=GSM8K_DIR)
    lengths = []
    for s in range(steps):
        ids = [prompt_ids(tokenizer, task[i]) for i in step_examples(s, examples, len(task))]
        lengths.append(statistics.mean(len(x) for x in ids))
    return lengths


def step_times(records: list[dict], prompts: list[float]) -> list[StepTimes]:
    "The steady steps (the first left out where there are more) as StepTimes."
    steady = records[1:] if len(records) > 1 else records
    return [StepTimes(r["step"], r["t_rollout"], r["t_reward"], r["t_train"], r["seq_len"], prompts[r["step"]])
            for r in steady]


# ---------------------------------------------------------------- one model

@dataclass
class ModelReport:
    "A model's shape, workload, floors and (when run) measured steps."
    shape: ModelShape
    source: str                         # where the shape came from
    nominal: Workload                   # the full new-token limit
    floor_float32: Floor                # at the nominal workload
    floor_bf16: Floor | None
    measured: list = field(default_factory=list)              # StepTimes
    floors_at_measured: list = field(default_factory=list)    # Floor (float32) per measured step
    floors_bf16_at_measured: list = field(default_factory=list)
    note: str = ""


def floors(m: ModelShape, w: Workload, mach: Machine) -> tuple[Floor, Floor | None]:
    "The float32 floor and, where bf16 is native, the floor with bf16 weights and KV cache at the bf16 peak."
    bw, fast = mach.bandwidth.read_gbs, mach.fast_gflops()
    f32 = floor(m, w, mach.float32.gflops, bw, FLOAT32_BYTES, fast)
    bf16 = floor(m, w, mach.bf16.gflops, bw, BF16_BYTES, fast) if mach.bf16 else None
    return f32, bf16


@dataclass
class ModelRun:
    "What a model's report is made of before the floors: its shape, workload and measured steps."
    shape: ModelShape
    source: str
    nominal: Workload
    measured: list = field(default_factory=list)              # StepTimes
    note: str = ""


def report_model(run: ModelRun, mach: Machine) -> ModelReport:
    "Floors at the nominal workload and at each measured step's lengths."
    w = run.nominal
    f32, bf16 = floors(run.shape, w, mach)
    rep = ModelReport(run.shape, run.source, w, f32, bf16, list(run.measured), note=run.note)
    for s in run.measured:
        at = Workload(w.prompts, w.samples, s.completion_tokens, s.prompt_tokens)
        a32, a16 = floors(run.shape, at, mach)
        rep.floors_at_measured.append(a32)
        if a16:
            rep.floors_bf16_at_measured.append(a16)
    return rep


def smollm2_run(args) -> ModelRun | str:
    "SmolLM2's floors and measured steps; a message when its folder is missing."
    folder = args.smollm2
    if not (folder / "config.json").exists():
        return f"SmolLM2-135M-Instruct skipped: no folder at {folder}; build it with `python bench/smollm2.py`"
    from nanorl.chat import ChatTokenizer

    shape, new = folder_shape(folder, "SmolLM2-135M-Instruct"), args.new_tokens
    prompts = step_prompt_tokens(ChatTokenizer.from_directory(folder), args.steps)
    measured = [] if args.no_measure else step_times(run_train(smollm2_flags(folder, new), args.steps, args.threads),
                                                     prompts)
    w = Workload(EXAMPLES, SAMPLES, new, statistics.mean(prompts))
    return ModelRun(shape, str(folder / "config.json"), w, measured)


def qwen_run(args) -> ModelRun | str:
    "The 0.5B GSM8K step's floors (and measured steps unless --no-measure); a message when its folder is missing."
    folder = args.qwen
    if not (folder / "config.json").exists():
        return f"Qwen2.5-Coder-0.5B-Instruct skipped: no folder at {folder}; build it with `python bench/qwen_coder.py`"
    from nanorl.chat import ChatTokenizer
    from nanorl.real import real_config, real_tasks

    cfg = real_config(folder, task="gsm8k", max_new_tokens=args.qwen_new_tokens)
    train_task, _ = real_tasks(0, "gsm8k", GSM8K_DIR)
    prompts = step_prompt_tokens(ChatTokenizer.from_directory(folder), args.steps, cfg.examples_per_step, train_task)
    measured = [] if args.no_measure else step_times(run_train(qwen_flags(folder, cfg.max_new_tokens), args.steps,
                                                               args.threads), prompts)
    note = f"the GSM8K recipe: {cfg.dtype} autocast, passes of {cfg.device_batch_size} replies"
    return ModelRun(folder_shape(folder, "Qwen2.5-Coder-0.5B-Instruct"), str(folder / "config.json"),
                    Workload(cfg.examples_per_step, cfg.num_samples, cfg.max_new_tokens, statistics.mean(prompts)),
                    measured, note)


def d4_run(args) -> ModelRun:
    "The d4's floors, and its measured steps when the base dir holds the checkpoint."
    from nanorl.tokenizer import Tokenizer

    shape, source = d4_shape(args.nanochat_base, args.nanochat_tag)
    have_ckpt = (args.nanochat_base / "chatsft_checkpoints" / args.nanochat_tag / "model_000000.pt").exists()
    tok_dir = args.nanochat_base / "tokenizer"
    note, prompts = "", [D4_PROMPT_GUESS] * args.steps
    if tok_dir.exists():
        prompts = step_prompt_tokens(Tokenizer.from_directory(tok_dir), args.steps)
    else:
        note = f"prompt length assumed {D4_PROMPT_GUESS} tokens (no tokenizer in {args.nanochat_base}); "
    measured = []
    if have_ckpt and not args.no_measure:
        flags = d4_flags(args.nanochat_base, args.nanochat_tag, args.d4_new_tokens)
        measured = step_times(run_train(flags, args.steps, args.threads), prompts)
    elif not have_ckpt:
        note += f"not measured: no checkpoint in {args.nanochat_base} (`python bench/rl_step.py` builds it)"
    w = Workload(EXAMPLES, SAMPLES, args.d4_new_tokens, statistics.mean(prompts))
    return ModelRun(shape, source, w, measured, note.strip("; "))


MODEL_RUNS = {"smollm2": smollm2_run, "d4": d4_run, "qwen": qwen_run}


# ---------------------------------------------------------------- output

def fmt_s(x: float | None) -> str:
    "Seconds with 3 significant figures, or '-'."
    return "-" if x is None else f"{x:.3g}"


def ratio(measured: float | None, fl: float | None) -> str:
    "measured / floor as 'N.Nx', or '-'."
    return "-" if measured is None or not fl else f"{measured / fl:.1f}x"


def machine_table(m: Machine) -> str:
    "The machine's figures as a markdown table."
    f, b = m.float32, m.bandwidth
    rows = [f"| float32 matmul peak | {f.gflops:.0f} GFLOPS ((n, n) @ (n, n), n = {f.n}, {f.kernel}, best of repeats) "
            "|"]
    if m.bf16:
        rows.append(f"| bf16 matmul peak | {m.bf16.gflops:.0f} GFLOPS (n = {m.bf16.n}, {m.bf16.kernel}) |")
    else:
        rows.append("| bf16 matmul peak | not measured: no avx512_bf16 or AMX (emulated) |")
    rows.append(f"| memory read (sum over {b.gib:g} GiB float32) | {b.read_gbs:.1f} GB/s |")
    rows.append(f"| memory copy (`copy_` of {b.gib:g} GiB, read + write) | {b.copy_gbs:.1f} GB/s |")
    l3 = f"{m.l3_mib:g} MiB" if m.l3_mib else "unknown"
    rows.append(f"| L3 cache | {l3} |")
    return "\n".join(["| machine | figure |", "|---|---|", *rows])


def med(xs) -> float | None:
    "Median, or None for no values."
    xs = list(xs)
    return statistics.median(xs) if xs else None


def phase_rows(r: ModelReport) -> list[str]:
    "One row per phase: measured median, floor at the measured lengths, ratio, floor at the full limit, bf16 floor."
    at, at16 = r.floors_at_measured, r.floors_bf16_at_measured
    phases = [("step", "total", "step_s"), ("sampling, `t_rollout`", "rollout", "rollout_s"),
              ("reward, `t_reward`", "reward", "reward_s"), ("training, `t_train`", "train", "train_s")]
    rows = []
    for label, got, fl in phases:
        meas = med(getattr(s, got) for s in r.measured)
        f_at = med(getattr(f, fl) for f in at)
        f16 = med(getattr(f, fl) for f in at16) if at16 else getattr(r.floor_bf16, fl, None)
        rows.append(f"| {label} | {fmt_s(meas)} | {fmt_s(f_at)} | {ratio(meas, f_at)} | "
                    f"{fmt_s(getattr(r.floor_float32, fl))} | {fmt_s(f16)} |")
    return rows


def model_table(r: ModelReport) -> str:
    "A model's phases against their floors as a markdown table, with what was counted below it."
    w, s, f = r.nominal, r.shape, r.floor_float32
    n = len(r.measured)
    lengths = (f"mean completion {med(x.completion_tokens for x in r.measured):.1f} tokens, prompt "
               f"{med(x.prompt_tokens for x in r.measured):.1f}" if n else f"prompt {w.prompt_tokens:.1f} tokens")
    head = (f"| {s.name}: {w.prompts} x {w.samples} x {w.new_tokens:g} ({lengths}) | measured, median of {n} "
            f"steps (s) | floor at the measured lengths (s) | measured / floor | floor at {w.new_tokens:g} tokens (s) "
            f"| floor, bf16 weights (s) |")
    counts = (f"Counted ({s.name}, {s.total_params / 1e6:.1f}M parameters, {s.matmul_params / 1e6:.1f}M in matmuls, "
              f"head {s.head_params / 1e6:.1f}M; at {w.new_tokens:g} tokens): training {f.train_flops / 1e12:.2f} "
              f"TFLOP ({f.train_passes_s:.2f} s) + optimizer {f.optimizer_bytes / 1e9:.2f} GB"
              f"{f' + Newton-Schulz {f.ns_flops / 1e9:.1f} GFLOP' if f.ns_flops else ''} ({f.optimizer_s:.3f} s); "
              f"sampling {f.rollout_bytes / 1e9:.1f} GB read and {f.rollout_flops / 1e12:.2f} TFLOP, "
              f"{f.rollout_compute_bound_s:.2f} s of its {f.rollout_s:.2f} s in compute-bound steps. Shape from "
              f"{r.source}.")
    lines = [head, "|---|---|---|---|---|---|", *phase_rows(r), "", *step_lines(r), counts]
    return "\n".join(lines + ([f"Note: {r.note}."] if r.note else []))


def step_lines(r: ModelReport) -> list[str]:
    "Each measured step against its floor (a shared machine shows here as one slow step)."
    lines = [f"Step {s.step}: {s.total:.2f} s = {s.rollout:.2f} + {s.reward:.4f} + {s.train:.2f} (floor {f.step_s:.2f} "
             f"= {f.rollout_s:.2f} + 0 + {f.train_s:.2f}; completions {s.completion_tokens:.1f} tokens, prompts "
             f"{s.prompt_tokens:.1f})." for s, f in zip(r.measured, r.floors_at_measured)]
    return [" ".join(lines)] if lines else []


def cache_note(m: Machine, reports: list) -> list[str]:
    "A warning where a model's weights fit the L3 cache: the DRAM bandwidth then overstates the sampling floor."
    notes = []
    for r in reports:
        for dtype, nbytes in (("float32", FLOAT32_BYTES), ("bf16", BF16_BYTES)):
            mib = r.shape.matmul_params * nbytes / 2**20
            if m.l3_mib and mib <= m.l3_mib and (dtype == "float32" or m.bf16):
                notes.append(f"{r.shape.name}'s {dtype} weights ({mib:.0f} MiB) fit the {m.l3_mib:g} MiB L3: its "
                             "sampling floor at DRAM bandwidth is not a true floor.")
    return notes


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    "The command line."
    from nanorl.real import qwen_default, smollm2_default

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    ap.add_argument("--models", default="smollm2,d4", help="comma-separated: smollm2, d4, qwen (the GSM8K step)")
    ap.add_argument("--steps", type=int, default=3, help="nanorl steps per model (the first is not counted)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: 256 matmuls, 64 MiB, 8 new tokens, 2 steps")
    ap.add_argument("--no-measure", action="store_true", help="floors only: do not run nanorl")
    ap.add_argument("--smollm2", type=Path, default=smollm2_default(), help="SmolLM2 folder (default %(default)s)")
    ap.add_argument("--nanochat-base", type=Path, default=RESULTS / "nanochat-base", help="base dir of the d4")
    ap.add_argument("--nanochat-tag", default="d4", help="its checkpoint tag")
    ap.add_argument("--new-tokens", type=int, default=128, help="SmolLM2's new-token limit")
    ap.add_argument("--d4-new-tokens", type=int, default=64, help="the d4's new-token limit (bench/rl_step.py's)")
    ap.add_argument("--qwen", type=Path, default=qwen_default(), help="Qwen2.5-Coder-0.5B folder (default %(default)s)")
    ap.add_argument("--qwen-new-tokens", type=int, default=384, help="the GSM8K run's new-token limit")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.new_tokens, args.d4_new_tokens, args.qwen_new_tokens = 2, 8, 8, 8
    unknown = set(args.models.split(",")) - set(MODEL_RUNS)
    if unknown:
        ap.error(f"unknown --models {sorted(unknown)}: expected {', '.join(MODEL_RUNS)}")
    return args


def main(argv=None):
    t0 = time.perf_counter()
    args = parse_args(argv)
    now, load = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", os.getloadavg()[0]
    print(f"# roofline | {now} | {cpu_label()} | {args.threads} threads | load average {load:.1f}", flush=True)
    before = measure_machine(args.threads, args.quick)
    runs, skipped = [], []
    for name in args.models.split(","):
        run = MODEL_RUNS[name](args)
        (skipped if isinstance(run, str) else runs).append(run)
    mach = before.best_with(measure_machine(args.threads, args.quick)) if runs else before
    reports = [report_model(r, mach) for r in runs]
    print(machine_table(mach) + "\n", flush=True)
    for rep in reports:
        print(model_table(rep) + "\n")
    for line in skipped + cache_note(mach, reports):
        print(line)
    wall, load_end = time.perf_counter() - t0, os.getloadavg()[0]
    print(f"\nroofline: {wall:.0f} s in all; load average {load:.1f} at the start, {load_end:.1f} at the end")
    if args.json:
        out = {"time": now, "machine": asdict(mach), "machine_before": asdict(before),
               "models": [asdict(r) for r in reports], "skipped": skipped, "wall_s": wall, "threads": args.threads,
               "quick": args.quick, "load_average": [load, load_end]}
        for m, r in zip(out["models"], reports):
            m["step_floor_float32_s"] = r.floor_float32.step_s
            m["measured_step_s"] = med(s.total for s in r.measured)
            m["step_floors_at_measured_s"] = [f.step_s for f in r.floors_at_measured]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return reports


if __name__ == "__main__":
    main()
