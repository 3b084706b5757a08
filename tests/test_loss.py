"Extra tests for nanorl.loss: normalizations, random splits, -inf under the mask, entropy bonus, importance weights."


import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanorl.loss import NORMALIZATIONS, count_trained, importance_weights, loss_normalizer, pg_loss
from nanorl.config import Config
from nanorl.step import Pass, Policy, backward_passes, step_normalizer
from doubles import load_fixture_model, save_tiny_hf_model


def batch(B, T, seed, equal_lengths=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((B,), T - 1) if equal_lengths else torch.randint(1, T, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, adv, mask


def whole(kind, logp, adv, mask, max_len, num_microbatches=1):
    ntok, nseq = count_trained(mask).tolist()
    norm = loss_normalizer(
        kind, num_tokens=ntok, num_sequences=nseq, num_microbatches=num_microbatches, max_len=max_len
    )
    return pg_loss(logp, adv, mask, kind, norm)


def test_relations_between_normalizations():
    "token == drgrpo * N*L / tokens; nanochat with one pass == token; equal lengths make sequence == token."
    logp, adv, mask = batch(5, 7, 0)
    ntok, nseq = count_trained(mask).tolist()
    t, d = whole("token", logp, adv, mask, 7), whole("drgrpo", logp, adv, mask, 7)
    torch.testing.assert_close(t, d * nseq * 7 / ntok)
    torch.testing.assert_close(whole("nanochat", logp, adv, mask, 7), t)
    logp, adv, mask = batch(5, 7, 1, equal_lengths=True)
    torch.testing.assert_close(whole("sequence", logp, adv, mask, 7), whole("token", logp, adv, mask, 7))
    logp, adv, mask = batch(5, 7, 2)  # unequal lengths: they must differ
    assert abs(whole("sequence", logp, adv, mask, 7) - whole("token", logp, adv, mask, 7)) > 1e-4


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 4))
def test_any_split_gives_the_whole_batch_gradient(seed, world, mb_size):
    "Random batches, any number of ranks and microbatch size: averaged rank gradients == whole-batch gradient."
    B, T = 8, 6
    logp, adv, mask = batch(B, T, seed)
    ntok, nseq = count_trained(mask).tolist()
    for kind in ("token", "sequence", "drgrpo"):
        x = logp.clone().requires_grad_()
        (g_whole,) = torch.autograd.grad(whole(kind, x, adv, mask, T), x)
        norm = loss_normalizer(kind, num_tokens=ntok, num_sequences=nseq, max_len=T, world_size=world)
        grads = []
        for r in range(world):
            rows = torch.arange(r, B, world)
            if len(rows) == 0:
                grads.append(torch.zeros_like(x))
                continue
            loss = sum(pg_loss(x[mb], adv[mb], mask[mb], kind, norm) for mb in rows.split(mb_size))
            grads.append(torch.autograd.grad(loss, x)[0])
        torch.testing.assert_close(torch.stack(grads).mean(0), g_whole)


def test_count_trained_all_reduce_shape():
    "Counts add over microbatches, and rows without trained tokens are not counted as sequences."
    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]]).bool()
    torch.testing.assert_close(count_trained(mask), torch.tensor([3.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(count_trained(mask[:1]) + count_trained(mask[1:]), count_trained(mask))


@pytest.mark.parametrize("kind", NORMALIZATIONS)
def test_inf_under_the_mask_is_harmless(kind):
    "-inf log-probs at masked positions leave the value and the gradient finite and unchanged."
    logp, adv, mask = batch(4, 6, 3)
    dirty = torch.where(mask, logp, torch.full_like(logp, -float("inf"))).requires_grad_()
    clean = logp.clone().requires_grad_()
    kw = dict(clip=(logp.detach() - 0.1, 0.2), kl=(logp.detach() + 0.2, 0.05), weights=torch.rand_like(logp))
    a = pg_loss(dirty, adv, mask, kind, 3.0, **kw)
    b = pg_loss(clean, adv, mask, kind, 3.0, **kw)
    (ga,) = torch.autograd.grad(a, dirty)
    (gb,) = torch.autograd.grad(b, clean)
    assert torch.isfinite(a) and torch.isfinite(ga).all()
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)


def test_integer_mask_equals_bool_mask():
    logp, adv, mask = batch(3, 5, 4)
    torch.testing.assert_close(
        pg_loss(logp, adv, mask.long(), "sequence", 3.0), pg_loss(logp, adv, mask, "sequence", 3.0)
    )


def test_clip_high_only_affects_positive_side():
    "A (low, high) clip_eps widens the upper bound: a ratio of 1.25 is clipped at 0.2 but not at 0.28."
    logp = torch.zeros(1, 1, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.25]]))
    m, adv = torch.ones(1, 1, dtype=torch.bool), torch.ones(1)
    (g_low,) = torch.autograd.grad(pg_loss(logp, adv, m, clip=(old, 0.2)), logp)
    (g_high,) = torch.autograd.grad(pg_loss(logp, adv, m, clip=(old, (0.2, 0.28))), logp)
    assert g_low.item() == 0 and g_high.item() == pytest.approx(-1.25)


def analytic_entropy_head_grad(model, inputs, mask, scale):
    "d(scale * sum of trained positions' entropies) / d(head weight), by hand: sum over positions of (dH/du) h^T."
    with torch.no_grad():
        h = model.hidden(inputs)[mask]  # (N, d)
        z = model.unembed(h)  # (N, V), softcapped for nanochat's models
        logp = torch.log_softmax(z, dim=-1)
        H = -(logp.exp() * logp).sum(-1, keepdim=True)  # (N, 1)
        dH_dz = -logp.exp() * (logp + H)  # (N, V)
        dz_du = 1 - (z / model.softcap) ** 2 if model.softcap else 1.0
        return scale * (dH_dz * dz_du).T @ h  # (V, d)


@pytest.mark.parametrize("family", ["nanochat", "llama"])
@pytest.mark.parametrize("coef", [0.0, 0.05])
def test_entropy_bonus_gradient_is_analytic(family, coef, tmp_path):
    "The entropy bonus alone (zero advantages) through the trainer's passes: the head's gradient is the formula."
    if family == "nanochat":
        model = load_fixture_model("head")  # softcapped, through the CPU fast paths (nanorl.train imports them)
    else:
        from nanorl.checkpoint import load_model

        save_tiny_hf_model("llama", tmp_path / "m")  # untied head, no softcap
        model = load_model(tmp_path / "m", "cpu")[0]
    model.train()
    V = model.unembed(model.hidden(torch.zeros(1, 1, dtype=torch.long))).shape[-1]
    g = torch.Generator().manual_seed(0)
    B, P, S = 4, 12, 10
    inputs = torch.cat(
        [torch.randint(0, V, (1, P), generator=g).expand(B, P), torch.randint(0, V, (B, S), generator=g)], 1
    )
    targets = torch.roll(inputs, -1, 1)
    targets[:, : P - 1] = -1
    for r, n in enumerate([10, 4, 7, 1]):
        targets[r, P - 1 + n :] = -1  # ragged completions
    for norm in ("token", "sequence"):
        cfg = Config(entropy_coef=coef, loss_norm=norm, logp="model")  # the formula is the full softmax's
        normalizer = step_normalizer(cfg.loss_norm, [targets], cfg.max_new_tokens, torch.device("cpu"))
        model.zero_grad()
        stats = backward_passes(
            Policy(model), [Pass(inputs, targets, torch.arange(B), 0)], torch.zeros(B), cfg.sampling(),
            cfg.loss_settings(), normalizer
        )
        grad = model.lm_head.weight.grad[:V]
        mask = targets != -1
        if norm == "token":
            expected = analytic_entropy_head_grad(model, inputs, mask, -coef / normalizer)
        else:  # each row's mean entropy
            expected = sum(
                analytic_entropy_head_grad(
                    model, inputs[r : r + 1], mask[r : r + 1], -coef / normalizer / mask[r].sum()
                )
                for r in range(B)
            )
        assert stats["tokens"] == int(mask.sum())
        if coef == 0:
            assert grad is None or grad.abs().max() == 0, "no bonus, no advantage: no gradient"
            continue
        rel = ((grad - expected).abs().max() / expected.abs().max()).item()
        assert rel < 1e-4, (norm, rel)


def constructed_batch():
    "Two rows of four tokens whose trainer / sampler ratios are known; the last token of row 1 is not trained."
    ratios = torch.tensor([[0.5, 1.0, 1.5, 3.0], [0.95, 1.05, 2.0, 7.0]], dtype=torch.float64)
    sampler_logp = -torch.rand(2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    return ratios, sampler_logp, sampler_logp + ratios.log(), mask


def test_importance_weights_on_a_constructed_batch():
    "tis = min(ratio, cap), mask = 1 where ratio <= cap, none = ones; detached."
    ratios, sampler_logp, logp, mask = constructed_batch()
    logp.requires_grad_()
    tis = importance_weights(logp, sampler_logp, "tis", cap=2.0)
    torch.testing.assert_close(tis, ratios.clamp(max=2.0))
    assert torch.equal(importance_weights(logp, sampler_logp, "mask", cap=2.0), (ratios <= 2.0).double())
    assert torch.equal(importance_weights(logp, sampler_logp, "none"), torch.ones_like(ratios))
    assert not tis.requires_grad
    with pytest.raises(ValueError, match="mode must be one of"):
        importance_weights(logp, sampler_logp, "clip")
    with pytest.raises(ValueError, match="sampler_logp must be"):
        importance_weights(logp, sampler_logp[:, :3])


@pytest.mark.parametrize("kind", NORMALIZATIONS)
def test_weights_scale_each_tokens_gradient(kind):
    "pg_loss with weights w: each token's gradient is w times the unweighted one; a dropped token (w = 0) gets none."
    ratios, sampler_logp, logp, mask = constructed_batch()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    for mode in ("tis", "mask"):
        w = importance_weights(logp, sampler_logp, mode, cap=2.0)
        x = logp.clone().requires_grad_()
        (g_plain,) = torch.autograd.grad(pg_loss(x, adv, mask, kind, 7.0), x)
        (g_weighted,) = torch.autograd.grad(pg_loss(x, adv, mask, kind, 7.0, weights=w), x)
        torch.testing.assert_close(g_weighted, torch.where(mask, w * g_plain, 0.0))
        assert (g_plain[mask] != 0).all() and not torch.equal(g_weighted, g_plain)


def test_truncated_is_recovers_the_on_policy_gradient():
    "Answers drawn from mu, weighted by importance_weights: the estimate hits grad E_pi[r]; unweighted it misses."
    g = torch.Generator().manual_seed(1)
    theta = torch.tensor([0.5, -0.3, 1.0, 0.0, -1.0], dtype=torch.float64)
    r = torch.tensor([1.0, 0.0, 0.3, 1.0, 0.0], dtype=torch.float64)
    pi = torch.softmax(theta, -1)
    mu = torch.softmax(theta + torch.tensor([0.4, 0.0, -0.5, -0.3, 0.2], dtype=torch.float64), -1)
    exact = pi * (r - (pi * r).sum())
    N = 100_000
    y = torch.multinomial(mu, N, replacement=True, generator=g)
    w = importance_weights(pi.log()[y][:, None], mu.log()[y][:, None], "tis", cap=10.0)[:, 0]  # cap never reached
    assert w.max() < 10.0
    hits = {}
    for name, weight in (("weighted", w), ("unweighted", torch.ones_like(w))):
        terms = (weight * r[y])[:, None] * (torch.nn.functional.one_hot(y, 5).double() - pi)  # (N, K)
        est, se = terms.mean(0), terms.std(0) / N**0.5
        hits[name] = bool(((est - exact).abs() <= 4 * se).all())  # 4 standard errors: 6e-5 per component by chance
    assert hits == {"weighted": True, "unweighted": False}
