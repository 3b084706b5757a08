"""Reference implementations the engine is held to: nanochat's sampler, and generation without a KV cache.

Slow and plain on purpose, so they live with the tests, not in the library; `06_engine` imports them as the tests do.
"""

import torch
import torch.nn.functional as F

from nanorl.calculator import use_calculator
from nanorl.engine import M32, gumbel_noise, mix32, row_key, seeds_per_prompt, stop_token_ids


def sample_next_token(logits, rng, temperature=1.0, top_k=None):
    "nanochat's sampler: ids (B, 1), argmax at temperature 0, else a softmax sample (of the top_k logits if given)."
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    if top_k is not None and top_k > 0:
        vals, idx = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)         # (B, k)
        choice = torch.multinomial(F.softmax(vals / temperature, dim=-1), 1, generator=rng)
        return idx.gather(-1, choice)
    return torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=rng)


def _reference_picks(logits, keys, step, temperature, top_k):
    "Next token ids (n,) from softcapped logits (n, V): argmax, or Gumbel-max over the top_k logits (all if None)."
    n, V = logits.shape
    if temperature == 0:
        return logits.argmax(-1)
    token_hash = mix32((torch.arange(V, device=logits.device) * 0x9E3779B1 + 0x7F4A7C15) & M32)   # (V,)
    if top_k and top_k < V:
        vals, idx = logits.topk(top_k, dim=-1)                                           # (n, k)
    else:
        vals, idx = logits, torch.arange(V, device=logits.device).expand(n, V)           # (n, V)
    scores = vals / temperature + gumbel_noise(keys, step, token_hash[idx])
    return idx.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


@torch.no_grad()
def reference_generate(engine, tokens, num_samples=1, max_tokens=16, temperature=1.0, top_k=None, seed=42,
                       min_new_tokens=0):
    "Slow reference of `engine.generate_batch`: a full forward over every row's whole sequence per step, no cache."
    model, tokenizer = engine.model, engine.tokenizer
    sp = tokenizer.encode_special
    stops = stop_token_ids(tokenizer)
    py_start, py_end = sp("<|python_start|>"), sp("<|python_end|>")
    out_start, out_end = sp("<|output_start|>"), sp("<|output_end|>")
    device, n, (seed,) = model.get_device(), num_samples, seeds_per_prompt(seed, 1)
    keys = torch.tensor([row_key(seed, j) for j in range(n)], dtype=torch.long, device=device)
    full = [list(tokens) for _ in range(n)]          # every row, also after it stopped (rows stay the same length)
    seqs, masks = [list(tokens) for _ in range(n)], [[0] * len(tokens) for _ in range(n)]
    done, forced, expr = [False] * n, [[] for _ in range(n)], [None] * n   # expr None: not inside a python block
    for step in range(max_tokens):
        if all(done):
            break
        logits = model(torch.tensor(full, device=device))[:, -1]                         # (n, V) softcapped
        if step < min_new_tokens:
            logits[:, sorted(stops)] = float("-inf")
        picks = _reference_picks(logits, keys, step, temperature, top_k)                 # (n,)
        for j, t in enumerate(picks.tolist()):
            m = 1
            if forced[j]:
                t, m = forced[j].pop(0), 0
            full[j].append(t)
            if done[j]:
                continue
            if t in stops:
                done[j] = True
                continue
            seqs[j].append(t)
            masks[j].append(m)
            if t == py_start:
                expr[j] = []
            elif t == py_end and expr[j] is not None:
                result = None
                if expr[j]:
                    result = use_calculator(tokenizer.decode(expr[j]), engine.nanochat_format)
                if result is not None:
                    forced[j] = [out_start, *tokenizer.encode(str(result)), out_end]
                expr[j] = None
            elif expr[j] is not None:
                expr[j].append(t)
    return seqs, masks
