"""One-command GPU check of nanorl: correctness on the device, decode and training speed, a whole torchrun step.

`python bench/gpu.py [--out FILE] [--device cuda] [--dtype bfloat16] [--dry-run]`, from the repository root of a copy
of the tree (nanorl is imported from it, not installed). A bare GPU machine needs PyTorch with CUDA, numpy,
transformers, safetensors, tiktoken and jinja2, plus the wheels of nanorl's own imports it lacks (fastcore, rustbpe,
tqdm: the script names the missing ones and stops); vLLM is not used. At most 8 minutes on one H100. It writes one JSON
(`--out`, default `$OUT/gpu.json` when $OUT is set, else `bench/gpu.json`) and prints a table at the end; every
figure is tagged with the device (`torch.cuda.get_device_name`, or `cpu_label()` of `nanochat_peer.py` on a CPU).

Sections, each run on its own: an exception is recorded (JSON and table) and the next section goes on; the exit code is
1 if any section failed or a correctness check missed its limit.
- device: device-to-device copy bandwidth (bytes read + written / time) and the peak matmul rate of --dtype (one
  large square torch.matmul), measured once; the bounds below use them.
- correct_gpt, correct_llama: nanochat's GPT (random, weights spread so the logits are O(1)) and a Qwen2-style model
  (a random transformers Qwen2 saved to a temporary folder and read back by `nanorl.llama.load_llama`), float32
  weights on the device. (1) The engine's log-prob of each sampled token (`Completions.logprobs`, through
  `nanorl.rollout.rollout`) against the trainer's (`nanorl.loss.token_logp` with the sampler's
  `Sampler(1.0, 50)`, rows from `trained_rows` / `collate` / `collate_logprobs`, as `bench/logp_band.py`), in float32
  (max |gap|) and under bf16 autocast (the band: max |gap| and the fraction of tokens whose ratio
  pi_trainer / pi_sampler leaves [0.9, 1.1]). (2) KV cache against none: the logits of a full forward against a
  batch-1 prefill copied into 3 rows (`prefill_rows`, as the engine does) and 1-token decode steps; the prompt is longer
  than GPT's sliding window. (3) Greedy: `generate_many` at temperature 0 and at top-k 1 on 3 prompts of different
  lengths in one batch equals a plain argmax loop over full forwards without a cache, prompt by prompt.
- decode_gpt, decode_llama: `Engine.generate_many` tokens/s, one prompt x R samples (R = 1, 16, 64, 256), every row
  decoding all its tokens (min_new_tokens), under --dtype autocast as the trainer's rollouts run (float32 weights,
  cached low-precision copies, a --dtype KV cache), on a nanochat-d20-shaped GPT (20 layers, width 1280, 10 heads,
  vocab 65536, sequence_len 2048) and a Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 heads, 2 kv heads,
  intermediate 4864, vocab 151936, tied embeddings), both random. Against the memory-bandwidth bound: each decode
  step reads every matrix once (Linear layers and the head, in --dtype) and each row's KV cache so far, at the
  measured copy bandwidth; embedding rows and activations are left out.
- train_gpt, train_llama: one forward and backward of the trainer's loss (`nanorl.step.backward_passes`, default
  Config: the sampler's log-probs and entropies) on 8 rows x 512 random tokens under --dtype autocast; tokens/s and
  model-FLOPs utilization 6 * matmul parameters * tokens / time / measured peak (attention's own FLOPs left out).
- torchrun_ddp, torchrun_fsdp: `torchrun --standalone --nproc_per_node=1 -m nanorl.train` for 2 steps on a nanochat
  base dir written here (the tokenizer fixture of tests/fixtures/nanochat/head, a random GPT saved by nanorl's
  `save_checkpoint`), `--task arithmetic`, default DDP and `--fsdp` (a process group of one: NCCL on a GPU, gloo on a
  CPU; DDP at one rank opens none); the phase split t_rollout / t_reward / t_train / t_eval from its metrics.jsonl.

Timing: warm-up calls first, then torch.cuda.synchronize around a host clock; the median of --repeats runs.
`--dry-run` runs the same code at tiny shapes (2-3 layers, width 64, rows 1 and 4) in well under a minute on a CPU,
the torchrun steps included; tests/test_gpu_bench.py runs it. Its figures are no benchmark.
"""

import argparse, importlib.util, json, math, os, shutil, statistics, subprocess, sys, tempfile, time, traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

T_START = time.perf_counter()  # the printed wall time counts the imports of torch and nanorl too

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nanorl from this tree, without installing it
sys.path.insert(0, str(ROOT / "bench"))

WHEELS = {  # module nanorl imports at load time -> the wheel to carry to a bare machine
    "fastcore": "fastcore (pure Python: fastcore-<version>-py3-none-any.whl)",
    "rustbpe": "rustbpe (compiled: a wheel built for this machine's Python and platform)",
    "tqdm": "tqdm (pure Python: tqdm-<version>-py3-none-any.whl)",
}
_missing = [wheel for module, wheel in WHEELS.items() if importlib.util.find_spec(module) is None]
if _missing:
    raise SystemExit(
        "bench/gpu.py: nanorl imports modules this Python lacks; carry these wheels and pip install them first "
        "(`pip download --no-deps -d wheels <name>` where there is a registry): " + "; ".join(_missing)
    )

import torch  # noqa: E402

from engine import BenchTokenizer, prompt_ids  # noqa: E402  the engine benchmark's tokenizer and prompts
from nanochat_peer import cpu_label  # noqa: E402  the CPU kind, as every benchmark here prints it
from nanorl.capture import CapturedDecoder, masked_decoder  # noqa: E402
from nanorl.checkpoint import save_checkpoint  # noqa: E402
from nanorl.engine import Engine, stop_token_ids  # noqa: E402
from nanorl.llama import DecoderConfig, Llama, load_llama  # noqa: E402
from nanorl.loss import token_logp  # noqa: E402
from nanorl.model import GPT, GPTConfig, Sampler  # noqa: E402
from nanorl.rollout import Sampling, collate, collate_logprobs, rollout, sample_seeds, trained_rows  # noqa: E402
from nanorl.scale import autocast_for  # noqa: E402
from nanorl.config import Config  # noqa: E402
from nanorl.step import Pass, Policy, backward_passes  # noqa: E402

FIXTURE_TOKENIZER = ROOT / "tests" / "fixtures" / "nanochat" / "head" / "tokenizer"  # nanochat's, vocab 2048
F32_GAP_LIMIT = 1e-3  # float32 |engine - trainer| log-prob: rounding is ~1e-5 and below, a real bug is ~1e-2 and up
KV_GAP_LIMIT = 1e-3  # float32 |cached - full| logits (|logit| <= 15 under GPT's softcap)
SAMPLER = dict(temperature=1.0, top_k=50)  # the trainer's defaults
PHASES = ("t_rollout", "t_reward", "t_train", "t_eval")

QWEN05 = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True,
              rope_theta=1e6, max_position_embeddings=32768)
SIZES = {
    "full": dict(
        correct_gpt=dict(sequence_len=256, vocab_size=4096, n_layer=4, n_head=2, n_kv_head=1, n_embd=256),
        correct_llama=dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2),
        speed_gpt=dict(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280),
        speed_llama=QWEN05,
        run_gpt=dict(sequence_len=512, vocab_size=2048, n_layer=6, n_head=3, n_kv_head=3, n_embd=384),
        run_flags=dict(examples_per_step=4, num_samples=16, device_batch_size=16, max_new_tokens=64),
        rollout=(8, 8, 64), greedy_tokens=32, rows=(1, 16, 64, 256), prompt=64, new_tokens=64,
        train=(8, 512), repeats=3, copy_mib=1024, matmul_n=8192, run_timeout=240,
    ),
    "dry": dict(
        correct_gpt=dict(sequence_len=256, vocab_size=512, n_layer=3, n_head=2, n_kv_head=1, n_embd=64),
        correct_llama=dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2),
        speed_gpt=dict(sequence_len=256, vocab_size=512, n_layer=3, n_head=2, n_kv_head=2, n_embd=64),
        speed_llama={**QWEN05, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 256},
        run_gpt=dict(sequence_len=256, vocab_size=2048, n_layer=3, n_head=2, n_kv_head=1, n_embd=64),
        run_flags=dict(examples_per_step=2, num_samples=4, device_batch_size=4, max_new_tokens=16),
        rollout=(4, 4, 24), greedy_tokens=16, rows=(1, 4), prompt=16, new_tokens=8,
        train=(2, 32), repeats=1, copy_mib=16, matmul_n=128, run_timeout=150,
    ),
}
RUN_FLAGS = dict(num_steps=2, eval_every=100, eval_examples=2, save_every=100, task="arithmetic", seed=0)


class IdsTokenizer(BenchTokenizer):
    "The engine benchmark's tokenizer, whose conversations are token ids (for `rollout`); the calculator never runs."

    def render_for_completion(self, conversation):
        return list(conversation)

    def decode(self, ids):
        return "ids " + " ".join(map(str, ids))  # no expression: a sampled tool call forces no output tokens


@dataclass
class Ctx:
    "What every section reads: the flags, the device and its name, the sizes, the measured peaks, a scratch folder."

    args: argparse.Namespace
    device: torch.device
    label: str
    dtype: torch.dtype
    size: dict
    tmp: Path
    bandwidth: float | None = None  # bytes/s
    peak: float | None = None  # FLOP/s of --dtype matmuls
    models: dict = field(default_factory=dict)


# ---------------------------------------------------------------- timing and device peaks


def sync(device):
    "Wait for the device's queued work (CUDA); nothing on a CPU."
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, repeats, warmup=1):
    "(median, all) wall seconds of `repeats` calls of fn after `warmup` calls, synchronized around each."
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def copy_bandwidth(device, mib, repeats):
    "Device-to-device copy bandwidth in bytes/s: 2 x bytes (read + write) per copy of `mib` MiB."
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t, _ = median_time(lambda: [dst.copy_(src) for _ in range(5)], device, max(repeats, 3))
    return 2 * 5 * src.numel() / t


def matmul_peak(device, dtype, n, repeats):
    "FLOP/s of one large (n, n) @ (n, n) torch.matmul in `dtype`, 5 per timed call."
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    t, _ = median_time(lambda: [torch.matmul(a, b, out=out) for _ in range(5)], device, max(repeats, 3))
    return 2 * n**3 * 5 / t


def device_section(ctx):
    "Copy bandwidth and peak matmul rate, measured once for the bounds of the speed sections."
    S = ctx.size
    ctx.bandwidth = copy_bandwidth(ctx.device, S["copy_mib"], S["repeats"])
    ctx.peak = matmul_peak(ctx.device, ctx.dtype, S["matmul_n"], S["repeats"])
    return {
        "copy_bytes_per_s": ctx.bandwidth, "copy_mib": S["copy_mib"], "matmul_flops": ctx.peak,
        "matmul_n": S["matmul_n"], "matmul_dtype": str(ctx.dtype)[6:],
        "figures": {"copy bandwidth": f"{ctx.bandwidth / 1e9:,.1f} GB/s",
                    f"{str(ctx.dtype)[6:]} matmul peak": f"{ctx.peak / 1e12:,.2f} TFLOP/s"},
    }


# ---------------------------------------------------------------- models


@torch.no_grad()
def spread_weights(model, seed=0):
    "Every matrix normal(0, 1/sqrt(fan-in)), GPT's head twice that and its smear on: logits O(1), no near-ties."
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 2:
            p.normal_(0.0, (2.0 if name == "lm_head.weight" else 1.0) / math.sqrt(p.shape[1]))
    if hasattr(model, "smear_lambda"):
        model.smear_lambda.fill_(0.5)
    return model


def correctness_gpt(ctx):
    "A random nanochat GPT of the correctness size, float32 on the device."
    with torch.device(ctx.device):
        return spread_weights(GPT(GPTConfig(**ctx.size["correct_gpt"]))).eval()


def correctness_llama(ctx):
    "A random Qwen2 (norms and biases perturbed) saved by transformers to a folder, read back by nanorl's loader."
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cfg = transformers.Qwen2Config(**ctx.size["correct_llama"], tie_word_embeddings=True, initializer_range=0.15,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.3 * torch.randn_like(p))
    folder = ctx.tmp / "qwen2_tiny"
    hf.save_pretrained(folder)
    return load_llama(folder, ctx.device).eval()


def speed_model(ctx, family):
    "The random d20-shaped GPT or Qwen2.5-0.5B-shaped model (built once, float32 on the device) and its tokenizer."
    if family not in ctx.models:
        ctx.models.clear()  # one family on the device at a time
        empty_cache(ctx.device)
        torch.manual_seed(0)
        with torch.device(ctx.device):
            if family == "gpt":
                model = GPT(GPTConfig(**ctx.size["speed_gpt"]))
            else:
                model = Llama(DecoderConfig(**ctx.size["speed_llama"]))
        ctx.models[family] = (model.eval(), IdsTokenizer(model.config.vocab_size))
    return ctx.models[family]


def empty_cache(device):
    "Hand cached blocks back to the GPU (nothing on a CPU)."
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_params(model):
    "Parameters of the Linear layers, the head included (a tied one once): what each token is multiplied by."
    seen = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            seen.update({id(p): p.numel() for p in (m.weight, m.bias) if p is not None})
    return sum(seen.values())


def kv_bytes_per_token(model, dtype):
    "Bytes of keys and values one token adds to the KV cache, over all layers, in `dtype`."
    cache = model.new_kv_cache(1, 1, dtype=dtype)  # k_cache (L, B, T, H_kv, D)
    return 2 * cache.k_cache[:, 0, 0].numel() * cache.k_cache.element_size()


# ---------------------------------------------------------------- correctness


def trainer_gaps(model, batch, pad, dtype, rows_per_pass=8):
    "trainer - engine log-probs (N,) of a batch's sampled tokens, in passes of `rows_per_pass` rows, under autocast."
    seqs, masks, logps = trained_rows(batch, range(len(batch.sequences)))
    dev, out = model.get_device(), []
    for s in range(0, len(seqs), rows_per_pass):
        inp, tgt = collate(seqs[s : s + rows_per_pass], masks[s : s + rows_per_pass], pad, dev)  # (b, T) each
        with torch.no_grad(), autocast_for(dev, dtype):
            lp = token_logp(model, inp, tgt, sampler=Sampler(**SAMPLER))  # (b, T)
        out.append((lp.float() - collate_logprobs(logps[s : s + rows_per_pass], dev))[tgt != -1])
    return torch.cat(out)


def engine_for(model, tok, captured=False):
    "nanorl's Engine on `model`; `captured`: its decode steps replayed from CUDA graphs (masked, unrecorded, on a CPU)."
    engine = Engine(model, tok)
    if captured:
        engine.decoder = CapturedDecoder if model.get_device().type == "cuda" else masked_decoder
    return engine


def logp_gaps(ctx, model, tok, dtype, captured=False):
    "Engine against trainer log-probs of the engine's samples (rollout and trainer both under `dtype`'s autocast)."
    n, samples, new = ctx.size["rollout"]
    V, idx = model.config.vocab_size, list(range(n))
    task = [prompt_ids(12 + 5 * i, V, i) for i in idx]
    sampling = Sampling(num_samples=samples, max_new_tokens=new, **SAMPLER)
    with autocast_for(ctx.device, dtype):
        batch = rollout(engine_for(model, tok, captured), tok, task, idx, sampling, sample_seeds(0, 0, idx), 256)
    gap = trainer_gaps(model, batch, tok.encode_special("<|assistant_end|>"), dtype)
    out = (gap < math.log(0.9)) | (gap > math.log(1.1))
    return {"tokens": gap.numel(), "gap_max": gap.abs().max().item(), "gap_mean": gap.abs().mean().item(),
            "outside_0.9_1.1": out.double().mean().item()}


@torch.no_grad()
def kv_cache_gap(model, prompt_len=160, new_tokens=8, rows=3):
    "Max |logit| gap: full forwards against a batch-1 prefill copied into `rows` rows, then 1-token decode steps."
    dev, V = model.get_device(), model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1, prompt_len), generator=g).to(dev)
    tails = torch.randint(0, V, (rows, new_tokens), generator=g).to(dev)
    full = model(torch.cat([prompt.expand(rows, -1), tails], 1))[:, prompt_len - 1 :]  # (rows, new + 1, V)
    one, cache = model.new_kv_cache(1, prompt_len), model.new_kv_cache(rows, prompt_len + new_tokens)
    steps = [model.unembed(model.hidden(prompt, kv_cache=one)[:, -1]).expand(rows, -1)]  # (rows, V)
    cache.prefill_rows(one, list(range(rows)))
    for i in range(new_tokens):
        steps.append(model.unembed(model.hidden(tails[:, i : i + 1], kv_cache=cache)[:, -1]))
    return {"max_abs": (torch.stack(steps, 1) - full).abs().max().item(), "logit_max": full.abs().max().item(),
            "prompt": prompt_len, "decoded": new_tokens, "rows": rows}


@torch.no_grad()
def argmax_loop(model, prompt, max_tokens, stops):
    "Greedy decoding the plain way: a full forward over the whole sequence per token, no cache; stops not kept."
    seq = list(prompt)
    for _ in range(max_tokens):
        t = int(model(torch.tensor([seq], device=model.get_device()))[0, -1].argmax())
        if t in stops:
            break
        seq.append(t)
    return seq


def greedy_check(model, tok, new_tokens):
    "Engine greedy (temperature 0; temperature 1 with top-k 1), 3 prompts in one batch, against argmax_loop."
    V = model.config.vocab_size
    prompts = [prompt_ids(n, V, 100 + n) for n in (20, 33, 47)]
    ref = [argmax_loop(model, p, new_tokens, stop_token_ids(tok)) for p in prompts]
    out = {"tokens": sum(len(r) - len(p) for r, p in zip(ref, prompts))}
    runs = {"temperature_0": (dict(temperature=0.0), False), "top_k_1": (dict(temperature=1.0, top_k=1), False),
            "captured_temperature_0": (dict(temperature=0.0), True)}
    for name, (kw, captured) in runs.items():
        engine = engine_for(model, tok, captured)
        seqs, _ = engine.generate_many(prompts, 1, new_tokens, seed=0, **kw).without_stops()   # as the loop
        out[name] = seqs == ref
    return out


def correctness(ctx, model):
    "The three checks on one model; `error` names the checks that missed their limits."
    tok = IdsTokenizer(model.config.vocab_size)
    res = {"float32": logp_gaps(ctx, model, tok, torch.float32), "bfloat16": logp_gaps(ctx, model, tok, torch.bfloat16),
           "captured_float32": logp_gaps(ctx, model, tok, torch.float32, captured=True),
           "captured_bfloat16": logp_gaps(ctx, model, tok, torch.bfloat16, captured=True),
           "kv_cache": kv_cache_gap(model), "greedy": greedy_check(model, tok, ctx.size["greedy_tokens"]),
           "limits": {"float32_gap": F32_GAP_LIMIT, "kv_cache": KV_GAP_LIMIT}}
    f32, bf, kv, gr = res["float32"], res["bfloat16"], res["kv_cache"], res["greedy"]
    cf32, cbf = res["captured_float32"], res["captured_bfloat16"]
    missed = [name for name, bad in [("float32 gap", f32["gap_max"] > F32_GAP_LIMIT),
                                     ("captured float32 gap", cf32["gap_max"] > F32_GAP_LIMIT),
                                     ("kv cache", kv["max_abs"] > KV_GAP_LIMIT),
                                     ("greedy temperature 0", not gr["temperature_0"]),
                                     ("greedy top-k 1", not gr["top_k_1"]),
                                     ("captured greedy", not gr["captured_temperature_0"])] if bad]
    res["error"] = f"check failed: {', '.join(missed)}" if missed else None
    res["figures"] = {
        "float32 engine vs trainer logp, max abs gap": f"{f32['gap_max']:.1e} ({f32['tokens']} tokens)",
        "bf16 engine vs trainer logp, max abs gap": f"{bf['gap_max']:.1e} ({bf['tokens']} tokens)",
        "bf16 share of ratios outside [0.9, 1.1]": f"{bf['outside_0.9_1.1']:.2%}",
        "float32 KV cache vs none, max abs logit gap": f"{kv['max_abs']:.1e} (largest logit {kv['logit_max']:.1f})",
        "greedy = argmax loop (T 0 / top-k 1)": f"{gr['temperature_0']} / {gr['top_k_1']} ({gr['tokens']} tokens)",
        "captured decoding: float32 / bf16 logp max gap, bf16 outside [0.9, 1.1], greedy = argmax loop":
            f"{cf32['gap_max']:.1e} / {cbf['gap_max']:.1e}, {cbf['outside_0.9_1.1']:.2%}, "
            f"{gr['captured_temperature_0']}",
    }
    return res


def correct_gpt_section(ctx):
    "Correctness of nanochat's GPT on the device."
    model = correctness_gpt(ctx)
    return {"shape": ctx.size["correct_gpt"], **correctness(ctx, model)}


def correct_llama_section(ctx):
    "Correctness of the Qwen2-style model, loaded from a transformers folder, on the device."
    model = correctness_llama(ctx)
    return {"shape": ctx.size["correct_llama"], **correctness(ctx, model)}


# ---------------------------------------------------------------- speed


def decode_bound(rows, prompt, new_tokens, weight_bytes, kv_token_bytes, bandwidth):
    "tokens/s if each step read the matrices once and every row's KV cache so far at `bandwidth` bytes/s, no more."
    cache_reads = rows * kv_token_bytes * sum(prompt + s for s in range(new_tokens))
    return rows * new_tokens * bandwidth / (new_tokens * weight_bytes + cache_reads)


def decode_section(ctx, family):
    "Engine decode tokens/s of one family's speed model at each row count, plain and captured, against the bound."
    model, tok = speed_model(ctx, family)
    S, itemsize = ctx.size, torch.empty(0, dtype=ctx.dtype).element_size()
    W, kv = matmul_params(model) * itemsize, kv_bytes_per_token(model, ctx.dtype)
    prompt, new = prompt_ids(S["prompt"], model.config.vocab_size, 0), S["new_tokens"]
    res = {"params": model.num_params(), "matmul_params": matmul_params(model), "weight_bytes": W,
           "kv_bytes_per_token": kv, "prompt": len(prompt), "new_tokens": new, "dtype": str(ctx.dtype)[6:],
           "rows": {}, "captured": {}, "figures": {}}
    with autocast_for(ctx.device, ctx.dtype):
        for rows in S["rows"]:
            bound = decode_bound(rows, len(prompt), new, W, kv, ctx.bandwidth) if ctx.bandwidth else None
            for kind, captured in (("rows", False), ("captured", True)):
                eng, made = engine_for(model, tok, captured), []     # each call's Completions, for its counters
                t, times = median_time(lambda: made.append(eng.generate_many([prompt], rows, new, seed=0,
                                                                             min_new_tokens=new, **SAMPLER)),
                                       ctx.device, S["repeats"])
                tokens = made[-1].stats["generated_tokens"]
                r = res[kind][str(rows)] = {"tok_s": tokens / t, "tokens": tokens, "seconds": times,
                                            "bound_tok_s": bound, "of_bound": bound and tokens / t / bound}
                tail = (f" ({r['of_bound']:.1%} of the bound {bound:,.0f})" if bound
                        else " (no bound: no device section)")
                name = f"{rows} row{'s' * (rows > 1)}{', captured' * captured}, tok/s"
                res["figures"][name] = f"{r['tok_s']:,.0f}{tail}"
    return res


def train_section(ctx, family):
    "Forward + backward of the trainer's loss on one pass of random tokens: tokens/s and model-FLOPs utilization."
    model, _ = speed_model(ctx, family)
    (B, T), dev = ctx.size["train"], ctx.device
    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, model.config.vocab_size, (B, T), generator=g).to(dev) for _ in range(2))
    advantages, cfg = torch.randn(B, generator=g).to(dev), Config()

    def step():
        model.zero_grad(set_to_none=True)
        backward_passes(Policy(model, device=dev, autocast=autocast_for(dev, ctx.dtype)),
                        [Pass(inputs, targets, torch.arange(B), 0)], advantages, cfg.sampling(), cfg.loss_settings(),
                        float(B * T))

    model.train()
    try:
        t, times = median_time(step, dev, ctx.size["repeats"])
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    flops = 6 * matmul_params(model) * B * T
    mfu = flops / t / ctx.peak if ctx.peak else None
    return {"rows": B, "seq_len": T, "dtype": str(ctx.dtype)[6:], "tok_s": B * T / t, "seconds": times,
            "model_flops_per_s": flops / t, "mfu": mfu,
            "figures": {f"fwd+bwd tok/s ({B} x {T})": f"{B * T / t:,.0f}",
                        "model FLOPs utilization": f"{mfu:.1%} ({flops / t / 1e12:,.2f} TFLOP/s)" if mfu
                        else f"{flops / t / 1e12:,.2f} TFLOP/s (no peak: no device section)"}}


# ---------------------------------------------------------------- a whole step under torchrun


def nanochat_base(ctx):
    "A nanochat base dir (built once): the fixture tokenizer and a random GPT saved by nanorl's save_checkpoint."
    base, cfg = ctx.tmp / "base", GPTConfig(**ctx.size["run_gpt"])
    tag = f"d{cfg.n_layer}"
    if not (base / "chatsft_checkpoints" / tag).is_dir():
        shutil.copytree(FIXTURE_TOKENIZER, base / "tokenizer")
        torch.manual_seed(0)
        model = GPT(cfg)  # on the CPU: what a checkpoint holds
        save_checkpoint(base / "chatsft_checkpoints" / tag, 0, model.state_dict(), None,
                        {"model_config": cfg, "step": 0})
    return base, tag


def torchrun_section(ctx, fsdp):
    "2 steps of `torchrun --nproc_per_node=1 -m nanorl.train` (DDP, or --fsdp): exit status and phase split."
    ctx.models.clear()  # the speed models leave the device to the run
    empty_cache(ctx.device)
    base, tag = nanochat_base(ctx)
    out = ctx.tmp / ("run_fsdp" if fsdp else "run_ddp")
    flags = {**RUN_FLAGS, **ctx.size["run_flags"], "device_type": ctx.device.type, "base_dir": base,
             "model_tag": tag, "output_dir": out}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "nanorl.train"]
    cmd += [w for k, v in flags.items() for w in (f"--{k.replace('_', '-')}", str(v))] + (["--fsdp"] if fsdp else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    if ctx.device.type == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=ctx.size["run_timeout"])
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"torchrun exited {p.returncode}: {(p.stdout + p.stderr)[-2500:]}")
    lines = (out / "chatrl_checkpoints" / tag / "metrics.jsonl").read_text().splitlines()
    keep = ("step", "logp_gap_max", "is_ratio_outside", *PHASES)
    steps = [{k: v for k, v in json.loads(l).items() if k in keep or k.startswith("mem_")} for l in lines if l.strip()]
    last = steps[-1]
    group = ("nccl" if ctx.device.type == "cuda" else "gloo") if fsdp else "none (DDP at 1 rank)"
    return {"command": " ".join(map(str, cmd)), "wall_s": wall, "process_group": group, "steps": steps,
            **{k: last[k] for k in PHASES if k in last},
            "figures": {"whole command": f"{wall:.1f} s ({len(steps)} steps, process group {group})",
                        f"last step {'/'.join(k[2:] for k in PHASES)} (s)":
                        " / ".join(f"{last[k]:.3f}" if k in last else "-" for k in PHASES)}}


SECTIONS = {
    "device": device_section,
    "correct_gpt": correct_gpt_section,
    "correct_llama": correct_llama_section,
    "decode_gpt": lambda ctx: decode_section(ctx, "gpt"),
    "train_gpt": lambda ctx: train_section(ctx, "gpt"),
    "decode_llama": lambda ctx: decode_section(ctx, "llama"),
    "train_llama": lambda ctx: train_section(ctx, "llama"),
    "torchrun_ddp": lambda ctx: torchrun_section(ctx, fsdp=False),
    "torchrun_fsdp": lambda ctx: torchrun_section(ctx, fsdp=True),
}


# ---------------------------------------------------------------- the run


def run_section(ctx, name, fn):
    "fn(ctx)'s figures, tagged with the device; an exception is recorded as the section's error and the run goes on."
    t0 = time.perf_counter()
    try:
        res = fn(ctx)
    except Exception as e:  # one broken part must not hide the others
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        empty_cache(ctx.device)
    res = {"device": ctx.label, "error": None, **res, "seconds_total": time.perf_counter() - t0}
    status = "ok" if res["error"] is None else f"FAILED: {res['error'][:300]}"
    print(f"[{name}] {status} ({res['seconds_total']:.1f} s)", flush=True)
    return res


def table(report):
    "The printed summary: one row per figure, every section's status, under the device's name."
    kind = "dry run: tiny shapes, not a benchmark" if report["dry_run"] else "full shapes"
    lines = [f"# nanorl GPU check | {report['when']} | {kind} | compute dtype {report['dtype']}",
             f"# device: {report['device']}", f"# torch {report['torch']}, CUDA {report['cuda']}", "",
             "| section | figure | value |", "|---|---|---|"]
    for name, res in report["sections"].items():
        status = "ok" if res["error"] is None else f"FAILED: {' '.join(res['error'].split())[:200]}"
        lines.append(f"| {name} | status ({res['seconds_total']:.1f} s) | {status.replace('|', '/')} |")
        lines += [f"| {name} | {k} | {v} |" for k, v in res.get("figures", {}).items()]
    return "\n".join(lines)


def default_out():
    "$OUT/gpu.json when $OUT is set, else bench/gpu.json."
    return str(Path(os.environ["OUT"]) / "gpu.json") if os.environ.get("OUT") else str(ROOT / "bench" / "gpu.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=default_out(), help="the JSON report ($OUT/gpu.json, else bench/gpu.json)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the speed sections' autocast")
    ap.add_argument("--dry-run", action="store_true", help="the same code at tiny shapes: a check that it runs")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections (default: all)")
    args = ap.parse_args()
    device = torch.device(args.device)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_label()
    if device.type == "cpu" and not args.dry_run:
        print("warning: full shapes on a CPU take far longer than 8 minutes; --dry-run is the CPU check", flush=True)
    report = {"when": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "device": label, "dry_run": args.dry_run,
              "dtype": args.dtype, "torch": torch.__version__, "cuda": torch.version.cuda,
              "float32_matmul_precision": torch.get_float32_matmul_precision(), "sections": {}}
    print(f"# nanorl GPU check on {label}{' (dry run)' if args.dry_run else ''}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nanorl_gpu_") as tmp:
        ctx = Ctx(args, device, label, getattr(torch, args.dtype), SIZES["dry" if args.dry_run else "full"], Path(tmp))
        for name, fn in SECTIONS.items():
            if not args.only or name in args.only:
                report["sections"][name] = run_section(ctx, name, fn)
        ctx.models.clear()
    report["failed"] = [n for n, r in report["sections"].items() if r["error"] is not None]
    report["wall_s"] = time.perf_counter() - T_START
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print("\n" + table(report) + f"\n\nwall time {report['wall_s']:.1f} s; wrote {args.out}", flush=True)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
