"""Engine throughput on CPU (run by hand): python bench/engine.py [--depths 4 8] [--repeats 3] [--nanochat PATH].

Workloads (float32, randomly initialised nanochat-shaped models, vocab 32768, sequence_len 2048):
- single prompt: 100-token prompt, 16 samples x 128 new tokens, temperature 1, top-k 50 (Engine.generate_batch);
- the no-cache reference (reference_generate) on a shorter run, since it is quadratic;
- RL rollout shape: 16 prompts x 16 samples x 128 tokens through one Engine.generate_many call, against an
  emulation of nanochat's pattern (chat_rl: one prompt at a time, 8 rows per call -> 32 generate_batch calls; the
  head through F.linear, as nanochat's lm_head, not the engine's oneDNN-packed head).
min_new_tokens=128 suppresses <|assistant_end|>/<|bos|> so every row runs all 128 tokens on every side.
"""
import argparse, platform, sys, time
from datetime import datetime, timezone
import torch

import nanorl.model as M
from nanorl.engine import Engine, reference_generate, sample_next_token, row_key
from nanorl.model import GPT, GPTConfig

SPECIALS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
            "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]

class BenchTokenizer:
    "Just enough tokenizer for the engine: special ids at the top of the vocabulary; text is the ids (tool calls fail)."
    def __init__(self, vocab_size): self.ids = {s: vocab_size - len(SPECIALS) + i for i, s in enumerate(SPECIALS)}
    def encode_special(self, name): return self.ids[name]
    def get_bos_token_id(self): return self.ids["<|bos|>"]
    def decode(self, ids): return " ".join(map(str, ids))
    def encode(self, text): return [int(t) for t in text.split()]

def nanochat_shaped(depth, vocab_size=32768, sequence_len=2048):
    "A randomly initialised model sized as nanochat's base_train sizes depth `depth` (head_dim 128)."
    n_embd = -(-depth * 64 // 128) * 128
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_embd // 128, n_kv_head=n_embd // 128, n_embd=n_embd)
    return GPT(cfg).eval()

def best_of(fn, repeats):
    "Best wall time of `repeats` runs (the least disturbed one on a shared machine)."
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times), times

def prompt_ids(n, vocab, seed):
    return torch.randint(0, vocab - len(SPECIALS), (n,), generator=torch.Generator().manual_seed(seed)).tolist()

def decode_step_times(model, eng, rows, repeats=15):
    """Best time of one decode step at `rows` rows: bare forward (softcapped full logits), a nanochat-style step
    (forward + sample_next_token top-k 50 + .tolist()), our step (hidden + frozen head + pick_tokens + .tolist()), and hidden states alone."""
    V = model.config.vocab_size
    one, cache = model.new_kv_cache(1, 100), model.new_kv_cache(rows, 100 + 2 * repeats * 4 + 8)
    model.hidden(torch.tensor([prompt_ids(100, V, 0)]), kv_cache=one)
    cache.prefill_rows(one, list(range(rows)))
    x, rng = torch.randint(0, V - 9, (rows, 1), generator=torch.Generator().manual_seed(1)), torch.Generator().manual_seed(0)
    keys, head = torch.tensor([row_key(0, j) for j in range(rows)]), model.frozen_unembed()
    fns = {"bare forward": lambda: model(x, kv_cache=cache)[:, -1],
           "nanochat-style step": lambda: sample_next_token(model(x, kv_cache=cache)[:, -1], rng, 1.0, 50)[:, 0].tolist(),
           "nanorl step": lambda: eng.pick_tokens(head(model.hidden(x, kv_cache=cache)[:, -1]), keys, 0, 1.0, 50).tolist(),
           "hidden states only": lambda: model.hidden(x, kv_cache=cache)}
    times = {k: [] for k in fns}
    for _ in range(repeats):                                   # interleaved, so all four see the same machine load
        for k, f in fns.items():
            t = time.perf_counter(); f(); times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}

def nanochat_engine_time(path, model, tok, prompt, repeats):
    "Time nanochat's own Engine.generate_batch on the same weights (needs a nanochat checkout at `path`)."
    sys.path.insert(0, path)
    from nanochat.gpt import GPT as NGPT, GPTConfig as NConfig
    from nanochat.engine import Engine as NEngine
    c = model.config
    with torch.device("meta"): ng = NGPT(NConfig(**c.nanochat_dict()))
    ng.to_empty(device="cpu"); ng.init_weights(); ng.load_state_dict(model.state_dict(), strict=True); ng.eval()
    eng = NEngine(ng, tok)
    run = lambda: eng.generate_batch(prompt, num_samples=16, max_tokens=128, temperature=1.0, top_k=50, seed=0)
    return best_of(run, repeats)

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference-tokens", type=int, default=32, help="new tokens per row for the (quadratic) no-cache reference")
    ap.add_argument("--skip-rl", action="store_true")
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--rl-repeats", type=int, default=1)
    ap.add_argument("--rl-tokens", type=int, default=128, help="new tokens per row for the RL-shape comparison")
    ap.add_argument("--nanochat", default=None, help="path to a nanochat checkout: also time its Engine on the same weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, float32, best of {args.repeats}")
    for depth in args.depths:
        model = nanochat_shaped(depth)
        V = model.config.vocab_size
        tok, eng = BenchTokenizer(V), Engine(model, BenchTokenizer(V))
        prompt = prompt_ids(100, V, depth)
        kw = dict(temperature=1.0, top_k=50, min_new_tokens=128)
        with torch.inference_mode():
            eng.generate_batch(prompt, 2, 4, **kw)                                   # warm-up
            steps = decode_step_times(model, eng, 16)
            print(f"d{depth} one decode step at 16 rows (best of 15): " + ", ".join(f"{k} {v * 1e3:.1f} ms = {16 / v:,.0f} tok/s" for k, v in steps.items()))
            if not args.skip_single:
                t, all_t = best_of(lambda: eng.generate_batch(prompt, 16, 128, seed=0, **kw), args.repeats)
                print(f"d{depth} ({model.num_params() / 1e6:.1f}M params) single prompt, 16 x 128, generate_batch: "
                      f"{16 * 128 / t:,.0f} tok/s  ({t:.2f}s; runs {[round(x, 2) for x in all_t]})")
                n = args.reference_tokens
                t_ref, _ = best_of(lambda: reference_generate(model, tok, prompt, 16, n, seed=0, **{**kw, "min_new_tokens": n}), 1)
                t_eng, _ = best_of(lambda: eng.generate_batch(prompt, 16, n, seed=0, **{**kw, "min_new_tokens": n}), args.repeats)
                print(f"d{depth} 16 x {n} tokens: no-cache reference {16 * n / t_ref:,.0f} tok/s, engine {16 * n / t_eng:,.0f} tok/s "
                      f"({t_ref / t_eng:.1f}x)")
                if args.nanochat:
                    t_nc, all_nc = nanochat_engine_time(args.nanochat, model, tok, prompt, args.repeats)
                    print(f"d{depth} nanochat Engine (measured, same weights): {16 * 128 / t_nc:,.0f} tok/s ({t / t_nc:.2f} time ratio)")
            if not args.skip_rl:
                N, onednn = args.rl_tokens, M.ONEDNN_LINEAR
                kw_rl = {**kw, "min_new_tokens": N}
                prompts = [prompt_ids(80 + 3 * i, V, 100 + i) for i in range(16)]
                total = 16 * 16 * N
                def nanochat_pattern():
                    M.ONEDNN_LINEAR = False                 # nanochat's lm_head is F.linear (MKL on CPU), not a packed head
                    try:
                        for i, p in enumerate(prompts):
                            for half in range(2): eng.generate_batch(p, 8, N, seed=2 * i + half, **kw_rl)
                    finally: M.ONEDNN_LINEAR = onednn
                many_times, pat_times = [], []
                for _ in range(args.rl_repeats):   # interleaved, so both sides see the same machine load
                    many_times.append(best_of(lambda: eng.generate_many(prompts, 16, N, seed=list(range(16)), **kw_rl), 1)[0])
                    stats = dict(eng.last_stats)
                    pat_times.append(best_of(nanochat_pattern, 1)[0])
                t_many, t_pat = min(many_times), min(pat_times)
                print(f"d{depth} RL shape 16 prompts x 16 samples x {N}: generate_many {total / t_many:,.0f} tok/s ({t_many:.1f}s), "
                      f"nanochat pattern (emulated: 32 generate_batch calls of 8 rows) {total / t_pat:,.0f} tok/s ({t_pat:.1f}s): "
                      f"{t_pat / t_many:.1f}x; runs many {[round(x, 1) for x in many_times]} pattern {[round(x, 1) for x in pat_times]}; stats {stats}")
        del model, eng

if __name__ == "__main__": main()
