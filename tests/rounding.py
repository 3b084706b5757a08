"""How far apart two computations may land when they differ only in float rounding, and the checks built on it.

Two runs that sum the same numbers in another order (DDP's shared-prompt pass against FSDP's per-row passes, one rank
against two, transformers against nanorl) round differently, and which way a rounding goes depends on the CPU's
kernels (AVX2 or AVX-512, native bf16 or not). So the tests compare such runs exactly only where rounding cannot
reach: samples drawn from identical weights, and bit-equality where the arithmetic is the same. Everything computed
from the differing arithmetic is compared within the bounds below, each derived from float32's rounding
(unit roundoff u = 2**-24 ~ 6e-8), and samples drawn after an update (from weights that may differ in their last
bits) are not compared at all: on a tiny model one flipped token changes a reward.
"""

import math

import pytest
import torch

# A token's log-prob from two float32 forwards that sum in another order: a dot product over the width n has a
# worst-case relative error of n u (128 u ~ 7.6e-6 for the 128-wide fixture), and test_llama holds the shared-prompt
# pass to the plain forward at 1e-5 (test_shared_prompt_pass_equals_plain).
LOGP_ATOL = 1e-5
# Two implementations' float32 logits of the same tokens (nanorl against transformers or nanochat's reference numbers):
# the same maths in other kernels and orders, held within 1e-4 by test_model, test_llama and test_smollm2.
LOGITS_ATOL = 1e-4
# Per-step records: the loss weighs each token's log-prob by advantage x normalizer weight, the weights sum to at most
# 1 and |advantage| <= 1 for 0/1 rewards less the group mean, so the loss moves by at most LOGP_ATOL; the sampled
# tokens' mean NLL too. The entropy -sum p log p moves by at most (log V + 1) LOGP_ATOL (about 1.1e-4 for V = 32768).
# The engine-to-trainer log-prob gaps are differences of two log-probs, each within LOGP_ATOL.
STEP_ATOL = {
    "loss": LOGP_ATOL,
    "sampled_nll": LOGP_ATOL,
    "entropy": (math.log(32768) + 1) * LOGP_ATOL,
    "logp_gap_max": LOGP_ATOL,
    "logp_gap_mean": LOGP_ATOL,
}
# The gradient norm: its relative change is at most the gradient's relative rounding difference, about 1e-6 (8e-7
# measured between DDP and FSDP on the fixture); 1e-4 leaves room for deeper sums.
GRAD_NORM_RTOL = 1e-4
# Measurements of the evaluation that follows the last step's update: drawn from the updated weights.
EVALUATION = ("pass@", "first@")

# One optimizer step from the same weights, state and samples, two gradients that differ by float32 rounding: how far
# apart may the two updates be (|update_a - update_b| / |update_a|, Frobenius, per tensor)?
# - AdamW moves an entry by lr m / (sqrt(v) + eps), at the first step lr g / (|g| + eps): where |g| is far above its
#   own rounding error that changes by the gradient's relative rounding (~1e-6), but an entry whose gradient is a sum
#   that cancels to the rounding level can flip sign and move 2 lr the other way. A fraction f of flipped entries
#   gives 2 sqrt(f); allowing one entry in a thousand at the rounding level: 2 sqrt(1e-3) ~ 0.063. (Later steps flip
#   less: m and v carry the earlier gradients.) Measured between DDP and FSDP on the fixture: 3e-5 to 7e-5 without a
#   flip, 1.4e-2 with 7 of the head's 262,144 entries flipped (2 sqrt(7 / 262144) ~ 1.0e-2, the rest partial flips).
ADAMW_UPDATE_RTOL = 2 * math.sqrt(1e-3)
# - Muon's update is Newton-Schulz of the (momentum) gradient, in the faster matmul dtype of the machine
#   (`fast_matmul_dtype`). In float32 the 5 quintic iterations amplify the input's relative difference (~1e-6) by at
#   most a^5 = 3.4445^5 ~ 490 (the polynomial's slope at 0, for the smallest singular values): 5e-4, so 1e-3 (1.2e-5
#   measured). In bfloat16 (CPUs with native bf16, e.g. AMD Zen 4) every iteration rounds its products to bf16's
#   2**-8 ~ 3.9e-3, so inputs a rounding apart come out several bf16 units apart, amplified by the later iterations:
#   up to 4.6e-2 measured on the fixture's gradients perturbed by 1e-7 to 1e-5; 0.1 (about 26 units).
MUON_UPDATE_RTOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}


def assert_same_step(a, b, after_update=()):
    """Two runs' records of one step whose samples were drawn from identical weights, computed by arithmetic that may
    round differently: the same keys; what the samples decide (rewards, lengths, pass@k before the update, counts)
    exactly equal; the loss, NLL, entropy and gradient norm within the bounds above; timings ignored. Keys starting
    with a prefix in `after_update` (an evaluation after the step's update) are only checked to be finite."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        x, y = a[k], b[k]
        if k.startswith("t_"):
            continue
        if k.startswith(tuple(after_update)):
            assert math.isfinite(x) and math.isfinite(y), (k, x, y)
        elif k == "grad_norm":
            assert y == pytest.approx(x, rel=GRAD_NORM_RTOL), (k, x, y)
        elif k in STEP_ATOL:
            assert abs(x - y) <= STEP_ATOL[k], (k, x, y, STEP_ATOL[k])
        else:
            assert x == y, f"{k}: {x!r} != {y!r} (decided by the samples, which come from identical weights)"


def update_rtol(name, muon_names, ns_dtype):
    "The bound above for the tensor `name`: Muon's (in `ns_dtype`) for the names in `muon_names`, else AdamW's."
    return MUON_UPDATE_RTOL[ns_dtype] if name in muon_names else ADAMW_UPDATE_RTOL


def nanochat_muon_names(state):
    "The tensors nanochat's optimizer setup gives to Muon: every parameter of the transformer blocks."
    return {k for k in state if k.startswith("transformer.h.")}


def assert_updates_agree(start, a, b, muon_names=(), ns_dtype=torch.float32):
    """Weights `a` and `b` after one optimizer step from the weights `start`, on the same samples, by arithmetic that
    may round differently: every tensor's update within its optimizer's bound above; at least one tensor moved.
    Returns the largest relative difference."""
    assert a.keys() == b.keys() == start.keys(), set(a) ^ set(b) ^ set(start)
    worst, moved = 0.0, False
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        da, db = a[k].float() - start[k].float(), b[k].float() - start[k].float()
        size = da.norm().item()
        if size == 0:
            assert db.norm().item() == 0, f"{k}: only one run moved it"
            continue
        moved = True
        gap = (da - db).norm().item() / size
        bound = update_rtol(k, muon_names, ns_dtype)
        assert gap <= bound, f"{k}: the updates differ by {gap:.2e} of their size, more than rounding's {bound:.2e}"
        worst = max(worst, gap)
    assert moved, "no tensor moved: the comparison would prove nothing"
    return worst


def assert_greedy_agrees(ours, theirs, logits, stops, atol):
    """Greedy continuations of one prompt by two implementations whose logits agree within `atol`: `ours` ends before
    its stop token, `theirs` is as generated (a stop token in `stops` ends it). Equal up to their first difference,
    where the two picks must be a near tie, within 2 atol in `logits` (theirs before each of their tokens, (len(theirs),
    V)), which rounding may break either way; nothing after it is compared (the prefixes differ). Returns the number
    of equal tokens."""
    cut = next((j for j, t in enumerate(theirs) if t in stops), len(theirs))
    n = 0
    while n < min(len(ours), cut) and ours[n] == theirs[n]:
        n += 1
    if n == len(ours) == cut:
        return n
    assert n < len(theirs), f"ours goes on after their last token {n}: {ours[n:]}"
    row = logits[n]  # (V,): their logits before token n
    our_pick = row[ours[n]].item() if n < len(ours) else max(row[t].item() for t in stops)  # ours stopped here
    their_pick = row[theirs[n]].item()
    assert their_pick - our_pick <= 2 * atol, (
        f"token {n}: ours {ours[n:n + 3]}, theirs {theirs[n:n + 3]}: logits {our_pick:.6f} against {their_pick:.6f}, "
        f"not a tie within 2 x {atol}"
    )
    return n


# The Gumbel noise -log(-log(u)) of a sampled token is a function of integers (seed, sample, step, token id), the same
# on both sides; only its two float32 logs round, each within an ulp or two whatever the kernel. u lies in
# [2**-25, 1 - 2**-25], so |noise| <= -log(-log(1 - 2**-25)) ~ 17.33, whose ulp is 2**-19 ~ 1.9e-6: a side's noise
# is within about 4e-6 of ours, two sides' within 8e-6; 1e-5.
NOISE_ATOL = 1e-5


def assert_sampled_agrees(engine, prompts, ours, theirs, atol=LOGITS_ATOL, num_samples=1, max_tokens=None,
                          temperature=1.0, top_k=None, seed=42, min_new_tokens=0):
    """Two generations `ours` and `theirs`, each (sequences, masks) as `generate_many(prompts, num_samples, ...,
    seed=seed)` returns them, by two computations of `engine.model`'s logits that agree within `atol` (a KV cache
    against full forwards, packed weights against plain ones, batches of other sizes). Every row must be equal, tokens
    and masks, up to its first difference; there both tokens must have been sampled (a forced tool output follows from
    the equal prefix), and the two picks must be a near tie that rounding may break either way: with the row's next
    token logits L recomputed here by one full forward over the equal prefix (within `atol` of either side's), each
    pick's score L / temperature + its Gumbel noise (the engine's: seed, sample, step and token decide it) within
    2 atol / temperature + NOISE_ATOL of the other's (at temperature 0 the logits, within 2 atol). A row that stopped
    there picked its best stop token. With top_k, a pick more than 2 atol below the k-th largest logit is in neither
    side's top k (fails), and one at most 2 atol above the (k+1)-th largest may be outside the other side's top k:
    that too is a near tie, of the top-k cut, accepted whatever the scores. Nothing after the first difference
    is compared (the prefixes differ). Returns, per row, None if the rows are equal, else the first difference's
    position among the new tokens. The remaining arguments are the generate call's."""
    from nanorl.engine import gumbel_noise, row_key, seeds_per_prompt

    (seqs_a, masks_a), (seqs_b, masks_b), seeds = ours, theirs, seeds_per_prompt(seed, len(prompts))
    assert len(seqs_a) == len(seqs_b) == len(masks_a) == len(masks_b) == len(prompts) * num_samples
    stops, model, firsts = sorted(engine.stop_tokens), engine.model, []
    for r, (sa, sb, ma, mb) in enumerate(zip(seqs_a, seqs_b, masks_a, masks_b)):
        prompt = list(prompts[r // num_samples])
        P = len(prompt)
        assert sa[:P] == sb[:P] == prompt and ma[:P] == mb[:P] == [0] * P, f"row {r}: not its prompt"
        assert len(sa) == len(ma) and len(sb) == len(mb), f"row {r}: a mask of another length"
        ga, gb, ka, kb = sa[P:], sb[P:], ma[P:], mb[P:]
        n = 0
        while n < min(len(ga), len(gb)) and ga[n] == gb[n]:
            assert ka[n] == kb[n], f"row {r}, token {n}: masks {ka[n]} and {kb[n]} of the same token"
            n += 1
        if n == len(ga) == len(gb):
            firsts.append(None)
            continue
        assert max_tokens is None or n < max_tokens, f"row {r}: longer than max_tokens"
        for g, k in ((ga, ka), (gb, kb)):
            assert n >= len(g) or k[n] == 1, f"row {r}, token {n}: forced output differs: {ga[n:n + 3]}, {gb[n:n + 3]}"
        with torch.no_grad():
            L = model(torch.tensor([sa[:P + n]], device=model.get_device()))[0, -1].float()   # (V,) softcapped
        if n < min_new_tokens:
            L[stops] = float("-inf")  # held back on both sides
        if temperature == 0:
            scores, bound = L, 2 * atol
        else:
            key = torch.tensor([row_key(seeds[r // num_samples], r % num_samples)], device=L.device)
            scores = L / temperature + gumbel_noise(key, n, engine.token_hash(L.numel(), L.device)[None])[0]
            bound = 2 * atol / temperature + NOISE_ATOL
        cut = edge = float("-inf")  # all tokens are candidates, none at the edge of the top k
        if temperature > 0 and top_k and top_k < L.numel():
            kth, next_ = L.topk(top_k + 1).values[-2:].tolist()  # the k-th and (k+1)-th largest
            cut, edge = kth - 2 * atol, next_ + 2 * atol  # below cut: in neither side's top k; up to edge: maybe not
        candidates = [t for t in stops if L[t] >= cut and L[t] > float("-inf")]
        picks = []
        for g in (ga, gb):
            if n < len(g):
                t = g[n]
            else:  # this side stopped here: with its best stop token
                assert candidates, f"row {r}, token {n}: stopped, yet no stop token could be picked"
                t = max(candidates, key=lambda s: scores[s].item())
            assert L[t] >= cut and L[t] > float("-inf"), (
                f"row {r}, token {n}: {t} could not be picked (outside the top k, or a held-back stop)"
            )
            picks.append(t)
        if any(L[t] <= edge for t in picks):
            firsts.append(n)  # a near tie of the top-k cut: the pick may be outside the other side's candidates
            continue
        a, b = (scores[t].item() for t in picks)
        assert abs(a - b) <= bound, (
            f"row {r}, token {n}: ours {ga[n:n + 3]}, theirs {gb[n:n + 3]}: scores {a:.6f} against {b:.6f}, not a "
            f"tie within {bound:.2e}"
        )
        firsts.append(n)
    return firsts
