"Fixture and property tests for nanorl.model (nanochat GPT, both generations)."

import json
from pathlib import Path
import pytest
import torch
from nanorl.model import GPT, GPTConfig, KVCache

FIX = Path(__file__).parent / "fixtures" / "nanochat"
CKPT = {"head": ("head/chatsft_checkpoints/d3", "current"), "oct2025": ("oct2025/chatsft_checkpoints/d2", "oct2025")}


def fixture_model(name):
    "The fixture checkpoint loaded directly (bf16 -> fp32), without nanorl.checkpoint."
    d, gen = CKPT[name]
    cfg = json.loads((FIX / d / "meta_000000.json").read_text())["model_config"]
    cfg.setdefault("window_pattern", "L")
    model = GPT(GPTConfig(**cfg, generation=gen)).eval()
    sd = torch.load(FIX / d / "model_000000.pt", map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model


@pytest.fixture(scope="module", params=["head", "oct2025"])
def model_ref(request):
    return fixture_model(request.param), torch.load(FIX / f"reference_{request.param}.pt", weights_only=True)


@torch.no_grad()
def test_logits_match_reference(model_ref):
    model, ref = model_ref
    for part in "abc":
        err = (model(ref[f"inputs_{part}"]) - ref[f"logits_{part}"]).abs().max().item()
        assert err < 1e-4, (part, err)


@torch.no_grad()
def test_losses_match_reference(model_ref):
    model, ref = model_ref
    x, y = ref["loss_inputs"], ref["loss_targets"]
    none = model(x, targets=y, loss_reduction="none")
    assert none.shape == ref["loss_none"].shape
    assert (none - ref["loss_none"]).abs().max() < 1e-4
    assert (none[y.view(-1) == -1] == 0).all()
    assert abs(model(x, targets=y).item() - ref["loss_mean"].item()) < 1e-4
    assert abs(model(x, targets=y, loss_reduction="sum").item() - ref["loss_sum"].item()) < 1e-3


@torch.no_grad()
def test_hidden_unembed_softcap(model_ref):
    model, ref = model_ref
    x = ref["inputs_a"]
    raw = model.unembed(model.hidden(x), softcap=False)
    assert torch.equal(model.unembed(model.hidden(x)), model(x))
    assert torch.allclose(model.softcap * torch.tanh(raw / model.softcap), model(x))
    assert raw.dtype == torch.float32 and raw.shape[-1] == model.config.vocab_size


@torch.no_grad()
def test_kv_cache_decode_matches_full_forward(model_ref):
    model, ref = model_ref
    ids, full = ref["inputs_c"], ref["logits_c"]  # 192 tokens: past the head model's 128 window
    cache = model.new_kv_cache(1)
    outs = [model(ids[:, :7], kv_cache=cache)]
    outs += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(7, ids.shape[1])]
    assert (torch.cat(outs, 1) - full).abs().max() < 1e-4
    assert cache.get_pos() == ids.shape[1]


@torch.no_grad()
def test_kv_cache_rows_at_different_positions(model_ref):
    model, ref = model_ref
    ids = ref["inputs_c"]
    full = model(ids)[0]
    lens = [5, 140]
    cache = model.new_kv_cache(2)
    for row, n in enumerate(lens):
        single = model.new_kv_cache(1)
        model(ids[:, :n], kv_cache=single)
        cache.prefill_rows(single, [row])
    for s in range(40):
        col = torch.tensor([[ids[0, n + s]] for n in lens])
        out = model(col, kv_cache=cache)
        for row, n in enumerate(lens):
            assert (out[row, 0] - full[n + s]).abs().max() < 1e-4
    # chunked multi-token step with rows at different positions
    out = model(torch.stack([ids[0, n + 40 : n + 43] for n in lens]), kv_cache=cache)
    for row, n in enumerate(lens):
        assert (out[row] - full[n + 40 : n + 43]).abs().max() < 1e-4
    cache.select_rows([1])
    assert cache.cache_seqlens.tolist() == [lens[1] + 43] and cache.batch_size == 1


def test_masked_loss_is_differentiable_and_equals_plain(model_ref):
    model, ref = model_ref
    x, y = ref["loss_inputs"], ref["loss_targets"]
    model.zero_grad()
    fast = model(x, targets=y, loss_reduction="none")
    logits = model(x)
    plain = torch.nn.functional.cross_entropy(
        logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1, reduction="none"
    )
    assert (fast - plain).abs().max() < 1e-5
    w = torch.rand_like(fast)
    (fast * w).sum().backward()
    g_fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (plain * w).sum().backward()
    for a, p in zip(g_fast, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def test_padded_vocab_is_sliced():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=64))
    assert model.lm_head.weight.shape[0] == 128 and model.transformer.wte.weight.shape[0] == 128
    x = torch.randint(0, 100, (2, 9))
    assert model(x).shape == (2, 9, 100)
    with pytest.raises(ValueError, match="loss_reduction"):
        model(x, targets=x, loss_reduction="avg")


def test_patched_methods_stay_out_of_all():
    import nanorl.model as m

    for name in ("forward", "hidden", "unembed", "init_weights", "new_kv_cache", "setup_optimizers"):
        assert name not in m.__all__ and hasattr(GPT, name)


def test_init_constants_come_from_the_generation_table(monkeypatch):
    import dataclasses
    from nanorl import model as m

    calls = []
    orig = GPT.init_rotary
    monkeypatch.setattr(GPT, "init_rotary", lambda self, device=None: (calls.append(1), orig(self, device))[1])
    cfg = GPTConfig(sequence_len=64, vocab_size=4096, n_layer=1, n_head=2, n_kv_head=2, n_embd=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert calls == [1]  # rotary tables built once
    assert abs(model.transformer.wte.weight.std().item() - m.GENERATIONS["current"].wte_std) < 0.01
    s = 3**0.5 / 256**0.5
    assert abs(model.transformer.h[0].mlp.c_fc.weight.abs().max().item() - 0.4 * s) < 0.01 * s
    monkeypatch.setitem(
        m.GENERATIONS, "current", dataclasses.replace(m.GENERATIONS["current"], wte_std=0.1, fc_scale=1.0)
    )
    model = GPT(cfg)
    assert abs(model.transformer.wte.weight.std().item() - 0.1) < 0.01
    assert abs(model.transformer.h[0].mlp.c_fc.weight.abs().max().item() - s) < 0.01 * s
