"""Stacked products while sampling, on and off: python bench/fused_products.py [--rounds 6] [--threads 2] [--model DIR].

`packed_weights` gives each of Llama's `Fusable` modules a `FusedLinear` (`13_speedups`): under CPU bf16 autocast
q, k and v run as one packed product, gate and up as another. This times the sampling phase of the GRPO benchmark
(`trl_grpo.py`: SmolLM2-135M-Instruct, 2 prompts of 113 tokens x 8 samples x 128 new tokens, temperature 1, top-k 50,
every row running all 128 tokens) through nanorl's Engine with the fast paths on, the stacked products on against
off (each module's products apart, as in float32), alternating arms within each round on the same inputs. It prints
each round's seconds, each arm's median and best, and whether both arms drew the same tokens.
"""

import argparse, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nanorl from this tree, without installing it
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from engine import prompt_ids  # noqa: E402
from nanochat_peer import cpu_label  # noqa: E402
from nanorl import speedups  # noqa: E402
from nanorl.chat import ChatTokenizer  # noqa: E402
from nanorl.engine import Engine  # noqa: E402
from nanorl.llama import load_llama  # noqa: E402
from nanorl.real import smollm2_path  # noqa: E402

STACKED = speedups.FusedLinear.__call__


def apart(self, x):
    "The off arm: each linear's own product, as without a FusedLinear."
    return tuple(m(x) for m in self.linears)


def switch(on: bool):
    "Stacked products on or off for every FusedLinear."
    speedups.FusedLinear.__call__ = STACKED if on else apart


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="a SmolLM2 (or other Llama-family) folder; default: smollm2_path()")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or smollm2_path()
    print(f"# {cpu_label()} | {args.threads} threads | {folder.name}", flush=True)
    model = speedups.use_fast_paths(load_llama(folder).eval())
    engine = Engine(model, ChatTokenizer.from_directory(folder))
    vocab = model.config.vocab_size
    prompts = [prompt_ids(113, vocab - 100, seed) for seed in range(2)]

    def sample(tokens=128):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return engine.generate_many(prompts, 8, tokens, temperature=1.0, top_k=50, seed=0, min_new_tokens=tokens)

    drawn, seconds = {}, {"stacked": [], "apart": []}
    for on in (True, False):
        switch(on)
        drawn[on] = [str(c) for c in sample(32)]                             # warm-up, and the tokens each arm draws
    for r in range(args.rounds):
        for arm in seconds:
            switch(arm == "stacked")
            t = time.perf_counter()
            sample()
            seconds[arm].append(time.perf_counter() - t)
        print(f"round {r}: " + ", ".join(f"{a} {s[-1]:.3f} s" for a, s in seconds.items()), flush=True)
    switch(True)
    for arm, s in seconds.items():
        print(f"{arm}: median {statistics.median(s):.3f} s, best {min(s):.3f} s over {len(s)} rounds")
    ratio = statistics.median(seconds["apart"]) / statistics.median(seconds["stacked"])
    print(f"stacked products: {ratio:.3f}x the sampling speed of apart (medians); same tokens: {drawn[True] == drawn[False]}")


if __name__ == "__main__":
    main()
