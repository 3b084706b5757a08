"""A decode step's attention, four ways: python bench/decode_attention.py [--threads 2] [--rows 16] [--group 8].

One layer of SmolLM2-135M-Instruct's attention at a GRPO step's decode (9 query heads, 3 key/value heads, head size 64;
16 rows = 2 groups of 8 replies to one 113-token prompt; the KV cache in bf16 as the engine keeps it under autocast),
at 1, 56 and 113 reply tokens so far. Microseconds per call (best of 5 rounds of 100), and each arm's largest gap
to the first:
1. engine: what nanorl runs, `cpu_sdpa` under bf16 autocast (the cache cast to float32, CPU flash attention, GQA);
2. matmul: the same in float32 as two batched products and a softmax, each key/value head's queries together;
3. shared prefix: the prompt's keys and values read once per group (the group's 8 x 3 queries of each key/value head
   at once), each row's own reply tokens apart (its 3 queries of a key/value head at once), the two merged by their
   log-sum-exp: the shared-prefix decode, built from torch's own CPU kernels;
4. bf16 matmul: arm 2 on the bf16 cache without the cast (scores rounded to bf16: not the trainer's numbers).
"""

import argparse, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nanorl from this tree, without installing it
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from decode_tricks import best_us  # noqa: E402
from nanochat_peer import cpu_label  # noqa: E402
from nanorl.speedups import cpu_sdpa  # noqa: E402

H, H_KV, D, PROMPT = 9, 3, 64, 113     # SmolLM2-135M's heads and head size; the GRPO bench's mean prompt
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu     # (out, log-sum-exp, ...)


def engine(q, keys, values):
    "nanorl's decode attention: q (B, 1, H, D), cache slices (B, L, H_kv, D) bf16 -> (B, 1, H, D) float32."
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = cpu_sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), enable_gqa=True)
    return y.transpose(1, 2)


def matmul(q, keys, values, dtype=torch.float32):
    "The same as two batched products: each key/value head's G queries against its keys, (B, 1, H, D)."
    B, L, G = q.size(0), keys.size(1), H // H_KV
    k = keys.to(dtype).transpose(1, 2).reshape(B * H_KV, L, D)                  # (B*H_kv, L, D)
    v = values.to(dtype).transpose(1, 2).reshape(B * H_KV, L, D)
    scores = torch.bmm(q.to(dtype).view(B * H_KV, G, D), k.transpose(1, 2)).float() * D ** -0.5   # (B*H_kv, G, L)
    return torch.bmm(scores.softmax(-1).to(dtype), v).float().view(B, 1, H, D)


def shared_prefix(q, keys, values, group):
    "The prompt once per group, each row's reply tokens apart, merged by log-sum-exp: (B, 1, H, D)."
    B, G = q.size(0), H // H_KV
    n = B // group
    kp = keys[::group, :PROMPT].float().transpose(1, 2)                          # (n, H_kv, P, D): one row a group
    vp = values[::group, :PROMPT].float().transpose(1, 2)
    qg = q.float().view(n, group, H_KV, G, D).transpose(1, 2).reshape(n, H_KV, group * G, D)
    o1, l1 = FLASH(qg, kp, vp)[:2]                                               # (n, H_kv, group*G, D), (.., group*G)
    o1 = o1.view(n, H_KV, group, G, D).transpose(1, 2).reshape(B, H, D)
    l1 = l1.view(n, H_KV, group, G).transpose(1, 2).reshape(B, H)
    if keys.size(1) == PROMPT:
        return o1.view(B, 1, H, D)
    ks = keys[:, PROMPT:].float().transpose(1, 2)                                # (B, H_kv, S, D)
    vs = values[:, PROMPT:].float().transpose(1, 2)
    o2, l2 = FLASH(q.float().view(B, H_KV, G, D), ks, vs)[:2]                    # (B, H_kv, G, D), (B, H_kv, G)
    o2, l2 = o2.reshape(B, H, D), l2.reshape(B, H)
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp()[..., None], (l2 - top).exp()[..., None]            # (B, H, 1) each
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).view(B, 1, H, D)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--group", type=int, default=8, help="replies to one prompt (the rows sharing its cache prefix)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_label(), f"{args.threads} threads", flush=True)
    gen = torch.Generator().manual_seed(0)
    room = PROMPT + 128
    k_cache = torch.randn(args.rows, room, H_KV, D, generator=gen).bfloat16()  # (B, T_max, H_kv, D)
    v_cache = torch.randn(args.rows, room, H_KV, D, generator=gen).bfloat16()
    for cache in (k_cache, v_cache):                                           # each group's prompt, copied per row
        cache[:, :PROMPT] = cache[::args.group, :PROMPT].repeat_interleave(args.group, 0)
    q = torch.randn(args.rows, 1, H, D, generator=gen).bfloat16()              # (B, 1, H, D)
    arms = {"engine": engine, "matmul": matmul,
            "shared prefix": lambda q, k, v: shared_prefix(q, k, v, args.group),
            "bf16 matmul": lambda q, k, v: matmul(q, k, v, torch.bfloat16)}
    for reply in (1, 56, 113):
        keys, values = k_cache[:, :PROMPT + reply], v_cache[:, :PROMPT + reply]  # the engine's slices of its cache
        ref = engine(q, keys, values)
        cells = []
        for name, arm in arms.items():
            gap = (arm(q, keys, values) - ref).abs().max().item()
            us = best_us(lambda: arm(q, keys, values), calls=100)
            cells.append(f"{name} {us:6.0f} us (gap {gap:.1e})")
        print(f"{args.rows} rows, {PROMPT} + {reply:3d} keys: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
