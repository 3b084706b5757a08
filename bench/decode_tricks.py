"""Two decode-step tricks measured before building them: python bench/decode_tricks.py [--threads 2] [--model DIR].

On SmolLM2-135M-Instruct's shapes, as the CPU fast paths sample it (bf16 weights packed for oneDNN, bf16 autocast):
1. Fused products: q, k, v as one (960 x 576) product and gate, up as one (3072 x 576), against the separate packed
   products the model runs now, at 16 and 32 rows (best of 5 rounds of 200 calls each, microseconds a layer).
2. The KV cache's dtype: the engine keeps the cache in bf16 under autocast, and the CPU attention casts it to float32
   at every step; a float32 cache skips the cast but reads twice the bytes. Whole decode steps (16 rows after a
   113-token prompt, 113 steps, the head included) alternate between the two, on the same inputs; the hidden states
   must agree exactly (the cache holds bf16-rounded values either way).
"""

import argparse, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nanorl from this tree, without installing it
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from nanochat_peer import cpu_label  # noqa: E402
from nanorl import llama  # noqa: E402
from nanorl.model import attention_mask  # noqa: E402
from nanorl.real import smollm2_path  # noqa: E402
from nanorl.speedups import packed_weights, use_fast_paths  # noqa: E402


def best_us(fn, calls=200, rounds=5):
    "Microseconds per call of fn: the best of `rounds` rounds of `calls` calls after 20 warm-up calls."
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def fused_products(d=576, rows=(16, 32)):
    "Separate against fused packed bf16 products of one SmolLM2 layer: q, k, v and gate, up."
    packed = torch.ops.mkldnn._reorder_linear_weight
    def linear(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    for n in rows:
        x = torch.randn(n, d).bfloat16()                                         # (n, d)
        for name, outs in (("q, k, v", [576, 192, 192]), ("gate, up", [1536, 1536])):
            ws = [torch.randn(o, d).bfloat16() for o in outs]
            apart, together = [packed(w) for w in ws], packed(torch.cat(ws))
            sep = best_us(lambda: [linear(x, w) for w in apart])
            fus = best_us(lambda: linear(x, together).split(outs, -1))
            print(f"{name:8s} {n:2d} rows: separate {sep:6.1f} us, fused {fus:6.1f} us: {sep / fus:.2f}x", flush=True)


def attend_in_cache_dtype(self, q, k, v, kv_cache, ctx, window=None):
    "GPT's `attend` without a window, q cast to the cache's dtype (not the cache to q's): the float32 cache's arm."
    keys, values = kv_cache.update(self.layer_idx, k, v, ctx)                  # (B, k_len, H_kv, D)
    q = q.to(keys.dtype)
    if ctx["fresh"]:
        return self._sdpa(q, keys, values, None, is_causal=True)
    if ctx["uniform"] and q.size(1) == 1:
        return self._sdpa(q, keys, values, None, is_causal=False)
    return self._sdpa(q, keys, values, attention_mask(ctx["positions"], ctx["k_len"]), is_causal=False)


def cache_dtypes(folder, rows=16, prompt=113, steps=113, rounds=3):
    "Decode steps (ms) with a bf16 against a float32 KV cache, alternating, same inputs; exact agreement checked."
    model = use_fast_paths(llama.load_llama(folder).eval())
    llama.Attention.attend = attend_in_cache_dtype                             # bf16 cache: a no-op cast of q
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40000, (rows, prompt), generator=gen)              # (B, T)
    x = torch.randint(0, 40000, (rows, 1), generator=gen)                     # (B, 1)
    def run(dtype):
        cache = model.new_kv_cache(rows, prompt + steps, dtype=dtype)
        model.hidden(ids, kv_cache=cache)
        t = time.perf_counter()
        for _ in range(steps - 1):
            h = model.hidden(x, kv_cache=cache)[:, -1]                         # (B, d)
            model.unembed(h)
        return (time.perf_counter() - t) / (steps - 1) * 1e3, h
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_weights(model):
        for _ in range(rounds):
            (low, h_low), (full, h_full) = run(torch.bfloat16), run(torch.float32)
            same = torch.equal(h_low, h_full)
            print(f"decode step, {rows} rows: bf16 cache {low:.1f} ms, float32 cache {full:.1f} ms "
                  f"(hidden states {'identical' if same else 'DIFFER'})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="SmolLM2's folder (default: bench/smollm2.py's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_label(), f"{args.threads} threads", flush=True)
    fused_products()
    cache_dtypes(smollm2_path(args.model))


if __name__ == "__main__":
    main()
