"""The compiled decode attention while sampling, on and off: python bench/decode_kernel.py [--rounds 4] [--threads 2].

`13b_kernel`'s `kernel_sdpa` runs a bf16 decode step's attention in a compiled kernel; off, `13_speedups`'s
`cpu_sdpa` casts the cache to float32 for torch's flash attention. This times the sampling phase of the GRPO
benchmark (`trl_grpo.py`: SmolLM2-135M-Instruct, 2 prompts of 113 tokens x 8 samples x 128 new tokens, temperature 1,
top-k 50, every row running all 128 tokens) through nanorl's Engine with the fast paths on, under bf16 autocast,
alternating arms within each round on the same inputs; then one layer's attention at that step's shape (16 rows, 9
query and 3 key/value heads of 64) at 114 and 241 keys, best of 5 x 100 calls. It prints each round's seconds, each
arm's median and best, how many rows drew the same tokens, and the layer's microseconds.
"""

import argparse, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nanorl from this tree, without installing it
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from engine import prompt_ids  # noqa: E402
from nanochat_peer import cpu_label  # noqa: E402
from nanorl.chat import ChatTokenizer  # noqa: E402
from nanorl.engine import Engine  # noqa: E402
from nanorl.kernel import decode_kernel, kernel_sdpa, use_decode_kernel  # noqa: E402
from nanorl.llama import load_llama  # noqa: E402
from nanorl.real import smollm2_path  # noqa: E402
from nanorl.speedups import cpu_sdpa, use_fast_paths  # noqa: E402


def layer_us(sdpa, keys: int) -> float:
    "Microseconds of one attention call at the GRPO decode shape over `keys` cached keys (best of 5 x 100)."
    q = torch.randn(16, 9, 1, 64).bfloat16()
    cache = torch.randn(2, 16, keys + 15, 3, 64).bfloat16()
    k, v = (c[:, :keys].transpose(1, 2) for c in cache)
    best = float("inf")
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(100):
                sdpa(q, k, v, enable_gqa=True)
            best = min(best, (time.perf_counter() - t) / 100)
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="a SmolLM2 (or other Llama-family) folder; default: smollm2_path()")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if decode_kernel() is None:
        sys.exit("the decode kernel is not built on this machine (no AVX-512, or no compiler): nothing to compare")
    folder = args.model or smollm2_path()
    print(f"# {cpu_label()} | {args.threads} threads | {folder.name}", flush=True)
    model = use_fast_paths(load_llama(folder).eval())
    engine = Engine(model, ChatTokenizer.from_directory(folder))
    prompts = [prompt_ids(113, model.config.vocab_size - 100, seed) for seed in range(2)]

    def sample(tokens=128):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return engine.generate_many(prompts, 8, tokens, temperature=1.0, top_k=50, seed=0, min_new_tokens=tokens)

    drawn, seconds = {}, {"kernel": [], "torch": []}
    for arm in seconds:
        use_decode_kernel(model, arm == "kernel")
        drawn[arm] = sample().sequences                                 # warm-up, and the tokens each arm draws
    for r in range(args.rounds):
        for arm in seconds:
            use_decode_kernel(model, arm == "kernel")
            t = time.perf_counter()
            sample()
            seconds[arm].append(time.perf_counter() - t)
        print(f"round {r}: " + ", ".join(f"{a} {s[-1]:.3f} s" for a, s in seconds.items()), flush=True)
    for arm, s in seconds.items():
        print(f"{arm}: median {statistics.median(s):.3f} s, best {min(s):.3f} s over {len(s)} rounds")
    ratio = statistics.median(seconds["torch"]) / statistics.median(seconds["kernel"])
    alike = sum(a == b for a, b in zip(drawn["kernel"], drawn["torch"]))
    rows = len(drawn["torch"])
    print(f"kernel: {ratio:.3f}x the sampling speed of torch's attention (medians); rows alike {alike}/{rows}")
    for keys in (114, 241):
        kernel_us, torch_us = layer_us(kernel_sdpa, keys), layer_us(cpu_sdpa, keys)
        print(f"one layer, {keys} keys: kernel {kernel_us:.0f} us, torch {torch_us:.0f} us")


if __name__ == "__main__":
    main()
