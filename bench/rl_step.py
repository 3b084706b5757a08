"""Seconds per RL step on CPU, split into rollout, reward, training and eval (run by hand).

The workload of the trainer's issue: a nanochat-shaped depth-4 model (n_embd 256, 2 heads, vocab 32768,
random weights, so samples run to the token limit), 100-token prompts, and
`--examples-per-step 2 --num-samples 8 --device-batch-size 8 --max-new-tokens 64`, float32, 2 threads.
It runs the real `nanorl.train.train` loop and reads the timings it logs to metrics.jsonl.

`--pattern nanochat` runs the same loop the way chat_rl spends its time, as a same-machine baseline built from
nanorl's parts (an emulation, not nanochat's code): one prompt per engine call (8 rows), logits and
cross-entropy at every position of every row, the prompt recomputed for every sample, dense embedding
gradients, the head through `F.linear` (MKL, not oneDNN), and no entropy diagnostic. It is kind to nanochat:
its sampler and optimizer are nanorl's.
`--compare N` alternates N runs of each pattern in fresh processes, so both see the same machine load.

    python bench/rl_step.py [--steps 8] [--threads 2] [--pattern nanorl|nanochat] [--compare N]
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

import torch
import torch.nn.functional as F

from nanorl.checkpoint import save_checkpoint
from nanorl.model import GPT, GPTConfig
from nanorl.tokenizer import Tokenizer, bpe_encoding
from nanorl.train import Config, train

VOCAB, PROMPT_TOKENS = 32768, 100
LETTERS = [chr(c) for c in range(0x100, 0x100 + 200)]  # 200 letters of Latin Extended: 2 UTF-8 bytes each


def synthetic_tokenizer(vocab_size=VOCAB) -> Tokenizer:
    "A tokenizer of exactly `vocab_size` ids: the 256 bytes, then letters and letter pairs, then the 9 specials."
    ranks = {bytes([b]): b for b in range(256)}
    pieces = [a.encode() for a in LETTERS] + [(a + b).encode() for a in LETTERS for b in LETTERS]
    for p in pieces:
        if len(ranks) == vocab_size - 9: break
        ranks.setdefault(p, len(ranks))
    return Tokenizer(bpe_encoding(ranks))


class PromptTask:
    "Problems whose prompt renders to exactly PROMPT_TOKENS tokens; no completion is ever right (random weights)."
    def __init__(self, tokenizer, n=64):
        self.questions = [self._question(tokenizer, i) for i in range(n)]

    @staticmethod
    def _question(tokenizer, i):
        "A run of letters, grown until the rendered prompt has PROMPT_TOKENS tokens."
        text = ""
        while True:
            conv = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]}
            if len(tokenizer.render_for_completion(conv)) >= PROMPT_TOKENS: return text
            text += LETTERS[(7 * i + 3 * len(text)) % len(LETTERS)]

    def __len__(self): return len(self.questions)
    def __getitem__(self, i):
        return {"messages": [{"role": "user", "content": self.questions[i]}, {"role": "assistant", "content": "#### 1"}]}
    def evaluate(self, conversation, completion): return "#### 1" in completion
    def reward(self, conversation, completion): return float(self.evaluate(conversation, completion))


def make_tasks(cfg):
    "The (train, held-out) pair for the benchmark's --task."
    tok = synthetic_tokenizer()
    return PromptTask(tok), PromptTask(tok)


def write_base_dir(base: Path, seed=0):
    "A nanochat base dir with the synthetic tokenizer and a random depth-4 model as its SFT checkpoint."
    tok = synthetic_tokenizer()
    tok.save(base / "tokenizer")
    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=2048, vocab_size=VOCAB, n_layer=4, n_head=2, n_kv_head=2, n_embd=256)
    model = GPT(config); model.init_weights()
    save_checkpoint(base / "chatsft_checkpoints" / "d4", 0, model.state_dict(), None, {"model_config": config})
    return tok


def full_logits_logp(model, inputs, targets, share_prefix=False, with_entropy=False):
    "chat_rl's log-probs: softcapped logits at every position (B, T, V), then cross-entropy with ignore_index -1 (no entropy)."
    logits = model.unembed(model.hidden(inputs))                                # (B, T, V)
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
    logp = -nll.view_as(targets)
    return (logp, torch.zeros_like(logp)) if with_entropy else logp


def use_nanochat_pattern() -> dict:
    "Swap the trainer's shortcuts for chat_rl's way of spending time; returns the Config overrides it needs."
    import nanorl.model as M, nanorl.train as T
    M.ONEDNN_LINEAR = False                                                     # the head through F.linear (MKL), as nanochat
    T.token_logp = full_logits_logp
    T.use_sparse_embedding_grads = lambda model: None
    return {"rollout_rows": 8}                                                  # one prompt (8 samples) per engine call


def compare(args):
    "Alternate runs of both patterns in fresh processes and print each run's medians and the ratio."
    results = {"nanorl": [], "nanochat": []}
    for _ in range(args.compare):
        for pattern in results:
            cmd = [sys.executable, __file__, "--steps", str(args.steps), "--threads", str(args.threads),
                   "--pattern", pattern, "--json"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[pattern].append(json.loads(out.strip().splitlines()[-1]))
            r = results[pattern][-1]
            print(f"{pattern:8s} {r['step']:.3f} s/step = rollout {r['t_rollout']:.3f} + training {r['t_train']:.3f}", flush=True)
    ours, theirs = (statistics.median(r["step"] for r in results[k]) for k in ("nanorl", "nanochat"))
    print(f"median of {args.compare} runs: nanorl {ours:.3f} s/step, nanochat pattern {theirs:.3f} s/step: {theirs / ours:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="RL steps (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-examples", type=int, default=16, help="problems in the one timed evaluation")
    ap.add_argument("--pattern", choices=["nanorl", "nanochat"], default="nanorl", help="whose way of spending time")
    ap.add_argument("--compare", type=int, default=0, help="alternate N runs of each pattern and report the ratio")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the medians")
    args = ap.parse_args()
    if args.compare: return compare(args)
    overrides = use_nanochat_pattern() if args.pattern == "nanochat" else {}
    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        tok = write_base_dir(base)
        prompt = tok.render_for_completion(make_tasks(None)[0][0])
        cfg = Config(base_dir=str(base), device_type="cpu", task="rl_step:make_tasks", examples_per_step=2, num_samples=8,
                     device_batch_size=8, max_new_tokens=64, num_steps=args.steps, eval_every=args.steps - 1,
                     eval_examples=args.eval_examples, save_every=10_000, top_k=50, **overrides)
        t0 = time.perf_counter()
        records = train(cfg)
        wall = time.perf_counter() - t0
    steady = [r for r in records[1:] if "t_eval" not in r]
    med = {k: statistics.median(r[k] for r in steady) for k in ("t_rollout", "t_reward", "t_train")}
    total = sum(med.values())
    ev = [r for r in records if "t_eval" in r][-1]
    print(f"prompt {len(prompt)} tokens; mean completion {statistics.mean(r['seq_len'] for r in records):.1f} tokens; "
          f"{len(steady)} steady-state steps; torch {torch.__version__}, {args.threads} threads")
    print(f"median seconds per step: {total:.3f} = rollout {med['t_rollout']:.3f} + reward {med['t_reward']:.4f} "
          f"+ training {med['t_train']:.3f}")
    print(f"first step (warm-up): rollout {records[0]['t_rollout']:.3f} + training {records[0]['t_train']:.3f}")
    print(f"one evaluation: {args.eval_examples} problems x 8 samples x 64 tokens in {ev['t_eval']:.2f} s; whole run {wall:.1f} s")
    if args.json: print(json.dumps({"step": total, **med, "first": records[0]["t_rollout"] + records[0]["t_train"]}))


if __name__ == "__main__":
    main()
