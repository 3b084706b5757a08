"""The speed room is dispatched, not patched: importing it changes no class, a model takes the fast paths only once
switched on, off restores the plain path, a non-CPU model is refused, and plain and fast agree within rounding.

Tolerances (tests/rounding.py): the fused loss sums the same float32 products in another order (chunks, a packed
head), so a token's log-prob moves by at most LOGP_ATOL, its entropy by (log V + 1) LOGP_ATOL, logits by LOGITS_ATOL,
and a gradient, relative to its largest entry, by GRAD_NORM_RTOL.
"""

import math, subprocess, sys

import pytest, torch

from doubles import load_fixture_model
from rounding import GRAD_NORM_RTOL, LOGITS_ATOL, LOGP_ATOL
import nanorl.speedups as speedups
from nanorl.model import GPT, GPTConfig

CLASSES = {"nanorl.model": ["GPT", "Linear", "KVCache"], "nanorl.llama": ["Llama"], "nanorl.engine": ["Engine"]}
IMPORT_CHECK = f"""
import importlib
classes = {CLASSES!r}
def snapshot():
    return {{(m, c): dict(vars(getattr(importlib.import_module(m), c))) for m, cs in classes.items() for c in cs}}
before = snapshot()
import nanorl.speedups, nanorl.train
after = snapshot()
changed = [(k, name) for k in before for name in set(before[k]) | set(after[k])
           if before[k].get(name, None) is not after[k].get(name, None)]
print(changed)
"""


def test_importing_the_speed_room_changes_no_class():
    "In a fresh process: every attribute of GPT, Linear, KVCache, Llama and Engine is the same object after the import."
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    from nanorl import llama, model

    assert model.GPT.forward is model.forward and llama.Llama.forward is model.forward  # 02_model's own function


def objective(m, ids, targets):
    "Per-token losses, entropies and every parameter's gradient of a weighted loss minus an entropy bonus."
    m.zero_grad()
    loss, entropy = m(ids, targets=targets, loss_reduction="none", with_entropy=True, entropy_grad=True)
    weights = torch.linspace(0.5, 1.5, loss.numel())
    ((loss * weights).sum() - 0.3 * entropy.sum()).backward()
    return loss.detach(), entropy.detach(), [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("gen", ["head", "oct2025"])
def test_plain_and_fast_agree_and_off_restores_plain(gen, monkeypatch):
    model = load_fixture_model(gen)
    assert model.fast_paths is None  # plain unless switched on
    torch.manual_seed(0)
    V = model.config.vocab_size
    ids, targets = torch.randint(0, V, (3, 24)), torch.randint(0, V, (3, 24))
    targets[:, :9] = -1  # a prompt: not trained
    plain = objective(model, ids, targets)
    with torch.no_grad():
        plain_logits = model(ids)
    monkeypatch.setattr(speedups, "onednn_pays", lambda out_features, in_features: True)  # pack the tiny shapes too
    speedups.use_fast_paths(model)
    with speedups.packed_weights(model):
        fast = objective(model, ids, targets)
        with torch.no_grad():
            fast_logits = model(ids)
    assert (fast[0] - plain[0]).abs().max() <= LOGP_ATOL
    assert (fast[1] - plain[1]).abs().max() <= (math.log(V) + 1) * LOGP_ATOL
    assert (fast_logits - plain_logits).abs().max() <= LOGITS_ATOL
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(fast[2], plain[2]))
    assert worst <= GRAD_NORM_RTOL, worst
    wrong = [g * 1.01 for g in plain[2]]  # the bound can fail: a 1% error in every gradient is caught
    assert max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(wrong, plain[2])) > 1e-3

    def refuse(*args, **kwargs):
        raise AssertionError("the fused loss ran")

    monkeypatch.setattr(speedups, "softcapped_nll", refuse)  # from here on the fused loss would fail
    with pytest.raises(AssertionError, match="fused loss ran"):
        objective(model, ids, targets)
    speedups.use_fast_paths(model, on=False)
    assert model.fast_paths is None
    again = objective(model, ids, targets)  # off: the plain loss, never the fused one
    assert (again[0] - plain[0]).abs().max() <= LOGP_ATOL


def test_fast_paths_stay_off_a_gpu():
    assert speedups.fast_paths_for("cpu") and speedups.fast_paths_for(torch.device("cpu"))
    assert not speedups.fast_paths_for("cuda") and not speedups.fast_paths_for(torch.device("cuda", 0))
    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=2, n_kv_head=2, n_embd=64,
                       generation="oct2025")
    with torch.device("meta"):  # stands in for a GPU: any device but the CPU
        model = GPT(config)
    with pytest.raises(ValueError, match="CPU tricks"):
        speedups.use_fast_paths(model)
    assert model.fast_paths is None
    assert speedups.use_fast_paths(model, on=False).fast_paths is None  # switching off is always allowed


@pytest.mark.skipif(not speedups.ONEDNN_LINEAR, reason="this torch build has no oneDNN linear ops")
def test_onednn_training_falls_back_when_the_private_ops_refuse(monkeypatch):
    """With oneDNN's private ops refusing (a torch build that dropped or changed them), the trained product, its
    gradients and the no-gradient product are F.linear's, and the copy stops using oneDNN. Tolerance: 256-term float32
    sums in another order, relative 1e-5 of the largest entry."""
    torch.manual_seed(0)
    W, b = torch.randn(64, 256, requires_grad=True), torch.randn(64, requires_grad=True)
    x = torch.randn(3, 5, 256, requires_grad=True)
    plain = torch.nn.functional.linear(x, W, b)
    plain.pow(2).sum().backward()
    want = [plain.detach()] + [t.grad.clone() for t in (x, W, b)]
    for t in (x, W, b):
        t.grad = None

    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn::_linear_pointwise: not supported here")

    pack = speedups.PackedLinear(W, b)
    assert pack.packed is not None                     # packed before the ops start refusing
    monkeypatch.setattr(speedups, "_onednn", refuse)
    out = pack.trained(x, W, b)
    out.pow(2).sum().backward()
    for got, ref in zip([out.detach()] + [t.grad for t in (x, W, b)], want):
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert not pack.onednn and pack.packed is None     # F.linear from now on
    with torch.no_grad():
        again = speedups.PackedLinear(W, b)
        assert (again(x) - plain.detach()).abs().max() <= 1e-5 * plain.abs().max()


@pytest.mark.skipif(not speedups.ONEDNN_LINEAR, reason="this torch build has no oneDNN linear ops")
def test_a_weight_changed_inside_a_block_is_repacked():
    "A packed model whose weights change inside one block (twice) computes with the new weights each time."
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=3, n_head=2, n_kv_head=2, n_embd=512))
    model.init_weights()
    with torch.no_grad():                                           # zero-initialized projections would hide it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ids = torch.randint(0, 64, (2, 8))
    with speedups.packed_weights(model), torch.no_grad():
        w = model.transformer.h[0].mlp.c_fc.weight
        assert model.transformer.h[0].mlp.c_fc.pack.onednn         # 2048 x 512 weights: packed
        for _ in range(2):
            model(ids)
            w.add_(0.05 * torch.randn_like(w))                      # an update inside the block
            with speedups.packed_weights(model):                    # nested: the same copies
                fast = model(ids)
            model.transformer.h[0].mlp.c_fc.pack, saved = None, model.transformer.h[0].mlp.c_fc.pack
            plain = model(ids)                                      # F.linear on the weight as it is now
            model.transformer.h[0].mlp.c_fc.pack = saved
            assert (fast - plain).abs().max() <= 1e-4 * plain.abs().max()
