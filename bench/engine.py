"""Engine throughput on CPU (run by hand): python bench/engine.py [--depths 4 8] [--repeats 3] [--vs-nanochat].

`--vs-nanochat` is the yardstick: nanochat's own Engine (its harness script, under its own Python; see
`nanochat_peer.py`) and nanorl's Engine on the same random d4 weights written by nanochat's code and the same
100-token prompt, 16 samples x 128 tokens, temperature 1, top-k 50, in alternating fresh processes. nanochat's side
never samples its stop or tool tokens, nanorl's suppresses stops with min_new_tokens=128: every row runs 128 tokens.

Without it, nanorl's own workloads (float32, random nanochat-shaped models, vocab 32768, sequence_len 2048):
- single prompt: 100-token prompt, 16 samples x 128 new tokens, temperature 1, top-k 50 (Engine.generate_batch);
- the no-cache reference (reference_generate) on a shorter run, since it is quadratic;
- RL rollout shape: 16 prompts x 16 samples x 128 tokens through one Engine.generate_many call, against chat_rl's
  calling pattern run on nanorl's own engine (one prompt at a time, 8 rows per call -> 32 generate_batch calls, the
  head through F.linear): what batching across prompts buys, not a measurement of nanochat.
min_new_tokens=128 suppresses <|assistant_end|>/<|bos|> so every row runs all 128 tokens on every side.
"""

import argparse, json, statistics, subprocess, sys, time
from datetime import datetime, timezone
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))  # the reference generation and nanochat's sampler
from nanochat_peer import add_peer_args, base_dir, cpu_label, last_json, peer_env, run_peer
from oracles import reference_generate, sample_next_token

import nanorl.speedups as M  # the CPU fast paths, switched on per model as the trainer does
from nanorl.engine import Engine, row_key
from nanorl.model import GPT, GPTConfig, Sampler

SPECIALS = [
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]


class BenchTokenizer:
    "Just enough tokenizer for the engine: special ids at the top of the vocabulary; text is the ids (tool calls fail)."

    def __init__(self, vocab_size):
        self.ids = {s: vocab_size - len(SPECIALS) + i for i, s in enumerate(SPECIALS)}

    def encode_special(self, name):
        return self.ids[name]

    def get_bos_token_id(self):
        return self.ids["<|bos|>"]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [int(t) for t in text.split()]


def nanochat_shaped(depth, vocab_size=32768, sequence_len=2048):
    "A randomly initialised model sized as nanochat's base_train sizes depth `depth` (head_dim 128)."
    n_embd = -(-depth * 64 // 128) * 128
    torch.manual_seed(0)
    cfg = GPTConfig(
        sequence_len=sequence_len,
        vocab_size=vocab_size,
        n_layer=depth,
        n_head=n_embd // 128,
        n_kv_head=n_embd // 128,
        n_embd=n_embd,
    )
    return GPT(cfg).eval()


def best_of(fn, repeats):
    "Best wall time of `repeats` runs (the least disturbed one on a shared machine)."
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), times


def prompt_ids(n, vocab, seed):
    return torch.randint(0, vocab - len(SPECIALS), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_step_times(model, eng, rows, repeats=15):
    """Best time of one decode step at `rows` rows: bare forward (softcapped full logits), a nanochat-style step
    (forward + sample_next_token top-k 50 + .tolist()), our step (hidden + packed head + pick_tokens + .tolist()),
    and hidden states alone.
    """
    V = model.config.vocab_size
    one, cache = model.new_kv_cache(1, 100), model.new_kv_cache(rows, 100 + 2 * repeats * 4 + 8)
    model.hidden(torch.tensor([prompt_ids(100, V, 0)]), kv_cache=one)
    cache.prefill_rows(one, list(range(rows)))
    x, rng = torch.randint(
        0, V - 9, (rows, 1), generator=torch.Generator().manual_seed(1)
    ), torch.Generator().manual_seed(0)
    pack = M.PackedLinear(model.lm_head.weight[:V])  # the head as the engine packs it per generate call
    keys, head = torch.tensor([row_key(0, j) for j in range(rows)]), lambda h: pack(h).float()
    fns = {
        "bare forward": lambda: model(x, kv_cache=cache)[:, -1],
        "nanochat-style step": lambda: sample_next_token(model(x, kv_cache=cache)[:, -1], rng, 1.0, 50)[:, 0].tolist(),
        "nanorl step": lambda: eng.pick_tokens(head(model.hidden(x, kv_cache=cache)[:, -1]), keys, 0,
                                               Sampler(1.0, 50)).tolist(),
        "hidden states only": lambda: model.hidden(x, kv_cache=cache),
    }
    times = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved, so all four see the same machine load
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}


def nanorl_side(args):
    "nanorl's half of --vs-nanochat, in its own process: generate_batch on the base dir's d4 and nanochat's prompt."
    import os

    os.environ["NANOCHAT_BASE_DIR"] = str(args.nanorl_side)
    from nanorl.checkpoint import load_model

    model, tok, _ = load_model("sft", "cpu", model_tag="d4", step=0)
    M.use_fast_paths(model)  # as the trainer runs on a CPU
    ref = Path(args.nanorl_side) / "chatsft_checkpoints" / "d4" / "reference_000000.pt"
    prefix = torch.load(ref, weights_only=True)["prefix"]  # the prompt nanochat's side uses
    eng, kw = Engine(model, tok), dict(temperature=1.0, top_k=50, min_new_tokens=128)
    with torch.inference_mode():
        eng.generate_batch(prefix, 16, 128, seed=0, **kw)  # warm-up, as nanochat's side
        times = []
        for i in range(args.repeats):
            t = time.perf_counter()
            eng.generate_batch(prefix, 16, 128, seed=42 + i, **kw)
            times.append(time.perf_counter() - t)
    print(json.dumps({"tok_s": [16 * 128 / t for t in times], "prefix": len(prefix)}))


def vs_nanochat(args):
    "One prompt x 16 samples x 128 tokens: nanochat's Engine and nanorl's on the same weights, alternating processes."
    base = base_dir(args)
    now = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    print(f"# {now} | {cpu_label()} | isa {args.isa} | {args.threads} threads", flush=True)
    best = {"nanochat": [], "nanorl": []}
    for _ in range(args.rounds):
        nc = run_peer(
            args,
            "nanochat_engine_bench.py",
            "--nanochat-root",
            args.nanochat_src,
            "--ckpt-dir",
            base,
            "--depths",
            4,
            "--modes",
            "raw",
            "--runs",
            args.repeats,
            "--threads",
            args.threads,
        )
        runs = [r["tok_s"] for r in nc["models"]["d4"]["raw"]["runs"]]
        cmd = [sys.executable, __file__, "--nanorl-side", str(base), "--repeats", str(args.repeats)]
        ours = last_json(subprocess.run(cmd, check=True, capture_output=True, text=True, env=peer_env(args)).stdout)
        best["nanochat"].append(max(runs))
        best["nanorl"].append(max(ours["tok_s"]))
        print(
            f"nanochat Engine {[round(x) for x in runs]} tok/s | "
            f"nanorl Engine {[round(x) for x in ours['tok_s']]} tok/s",
            flush=True,
        )
    nc, ours = statistics.median(best["nanochat"]), statistics.median(best["nanorl"])
    print(
        f"best run per round, median over {args.rounds} rounds: nanochat {nc:,.0f} tok/s, nanorl {ours:,.0f} tok/s: "
        f"{ours / nc:.2f}x"
    )
    print(
        json.dumps(
            {
                "isa": args.isa,
                "threads": args.threads,
                "cpu": cpu_label(),
                "nanochat_tok_s": nc,
                "nanorl_tok_s": ours,
                "ratio": ours / nc,
            }
        )
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--reference-tokens", type=int, default=32, help="new tokens per row for the (quadratic) no-cache reference"
    )
    ap.add_argument("--skip-rl", action="store_true")
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--rl-repeats", type=int, default=1)
    ap.add_argument("--rl-tokens", type=int, default=128, help="new tokens per row for the RL-shape comparison")
    ap.add_argument(
        "--vs-nanochat",
        action="store_true",
        help="only the side-by-side: nanochat's own Engine and nanorl's on the same weights and prompt",
    )
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of --vs-nanochat")
    ap.add_argument("--nanorl-side", default=None, help=argparse.SUPPRESS)
    add_peer_args(ap)
    args = ap.parse_args()
    if args.nanorl_side:
        return nanorl_side(args)
    if args.vs_nanochat:
        return vs_nanochat(args)
    torch.set_num_threads(args.threads)
    print(
        f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC | {cpu_label()} | "
        f"{args.threads} threads, float32, best of {args.repeats}"
    )
    for depth in args.depths:
        model = M.use_fast_paths(nanochat_shaped(depth))  # as the trainer runs on a CPU
        V = model.config.vocab_size
        tok, eng = BenchTokenizer(V), Engine(model, BenchTokenizer(V))
        prompt = prompt_ids(100, V, depth)
        kw = dict(temperature=1.0, top_k=50, min_new_tokens=128)
        with torch.inference_mode():
            eng.generate_batch(prompt, 2, 4, **kw)  # warm-up
            steps = decode_step_times(model, eng, 16)
            print(
                f"d{depth} one decode step at 16 rows (best of 15): "
                + ", ".join(f"{k} {v * 1e3:.1f} ms = {16 / v:,.0f} tok/s" for k, v in steps.items())
            )
            if not args.skip_single:
                t, all_t = best_of(lambda: eng.generate_batch(prompt, 16, 128, seed=0, **kw), args.repeats)
                print(
                    f"d{depth} ({model.num_params() / 1e6:.1f}M params) single prompt, 16 x 128, generate_batch: "
                    f"{16 * 128 / t:,.0f} tok/s  ({t:.2f}s; runs {[round(x, 2) for x in all_t]})"
                )
                n = args.reference_tokens
                slow = Engine(model, tok)
                t_ref, _ = best_of(
                    lambda: reference_generate(slow, prompt, 16, n, seed=0, **{**kw, "min_new_tokens": n}), 1
                )
                t_eng, _ = best_of(
                    lambda: eng.generate_batch(prompt, 16, n, seed=0, **{**kw, "min_new_tokens": n}), args.repeats
                )
                print(
                    f"d{depth} 16 x {n} tokens: no-cache reference {16 * n / t_ref:,.0f} tok/s, "
                    f"engine {16 * n / t_eng:,.0f} tok/s "
                    f"({t_ref / t_eng:.1f}x)"
                )
            if not args.skip_rl:
                N, onednn = args.rl_tokens, M.ONEDNN_LINEAR
                kw_rl = {**kw, "min_new_tokens": N}
                prompts = [prompt_ids(80 + 3 * i, V, 100 + i) for i in range(16)]
                total = 16 * 16 * N

                def nanochat_pattern():
                    M.ONEDNN_LINEAR = False  # nanochat's lm_head is F.linear (MKL on CPU), not a packed head
                    try:
                        for i, p in enumerate(prompts):
                            for half in range(2):
                                eng.generate_batch(p, 8, N, seed=2 * i + half, **kw_rl)
                    finally:
                        M.ONEDNN_LINEAR = onednn

                many_times, pat_times = [], []
                for _ in range(args.rl_repeats):  # interleaved, so both sides see the same machine load
                    made = []  # the call's Completions, for its counters
                    many_times.append(
                        best_of(lambda: made.append(eng.generate_many(prompts, 16, N, seed=list(range(16)), **kw_rl)), 1)[0]
                    )
                    stats = dict(made[-1].stats)
                    pat_times.append(best_of(nanochat_pattern, 1)[0])
                t_many, t_pat = min(many_times), min(pat_times)
                print(
                    f"d{depth} RL shape 16 prompts x 16 samples x {N}: "
                    f"generate_many {total / t_many:,.0f} tok/s ({t_many:.1f}s), "
                    f"one prompt per call (chat_rl's pattern on nanorl's engine: 32 calls of 8 rows) "
                    f"{total / t_pat:,.0f} tok/s ({t_pat:.1f}s): "
                    f"{t_pat / t_many:.1f}x; runs many {[round(x, 1) for x in many_times]} "
                    f"pattern {[round(x, 1) for x in pat_times]}; stats {stats}"
                )
        del model, eng


if __name__ == "__main__":
    main()
