"""The compiled decode attention (`13b_kernel`): torch's float32 attention to a rounding per key wherever it is built,
the calls it declines go to `cpu_sdpa` unchanged, and a model decodes through it only when asked and built."""

import pytest
import torch
import torch.nn.functional as F

from nanorl.kernel import decode_kernel, decodes, kernel_sdpa, use_decode_kernel
from nanorl.llama import DecoderConfig, Llama
from nanorl.speedups import cpu_sdpa, use_fast_paths

BUILT = pytest.mark.skipif(decode_kernel() is None,
                           reason="the decode kernel is not built here (no AVX-512, torch held to AVX2, or no compiler)")
BF16 = torch.bfloat16


def decode_case(D, groups, L, B=3, H_kv=2, seed=0):
    "A decode step's q (B, H, 1, D) and a bf16 cache sliced as the model reads it: k, v (B, H_kv, L, D), strided."
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * groups, 1, D, generator=g).to(BF16)
    cache = (torch.randn(2, B, L + 5, H_kv, D, generator=g) * 2).to(BF16)
    k, v = (c[:, :L].transpose(1, 2) for c in cache)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    return q, k, v, (torch.arange(L) < lengths[:, None])[:, None, None]            # mask (B, 1, 1, L)


@BUILT
@pytest.mark.parametrize("D,groups,L", [(32, 1, 1), (64, 3, 241), (64, 7, 113), (128, 8, 64), (128, 2, 700),
                                         (32, 4, 50), (64, 5, 9), (32, 6, 300)])
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_is_torchs_attention(D, groups, L, masked):
    "Each output within (L + 8) roundings of |v|max of torch's float32 SDPA: the sums' orders differ, nothing else."
    q, k, v, mask = decode_case(D, groups, L)
    mask = mask if masked else None
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    with torch.autocast("cpu", dtype=BF16), torch.no_grad():
        assert decodes(q, k, v, mask, False, True)
        got = kernel_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= (L + 8) * 2**-24 * v.abs().max().item()


@BUILT
def test_kernel_takes_any_layout_and_scale():
    "q, k and v each laid out otherwise (a transposed copy), a batch-1 mask and an explicit scale: torch's numbers."
    q, k, v, mask = decode_case(64, 3, 40, B=4)
    q = q.transpose(1, 3).contiguous().transpose(1, 3)                              # (B, H, 1, D), other strides
    v = v.transpose(0, 2).contiguous().transpose(0, 2)                              # (B, H_kv, L, D), other strides
    one = mask[:1]                                                                  # (1, 1, 1, L): every row alike
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=one, enable_gqa=True, scale=0.3)
    with torch.autocast("cpu", dtype=BF16), torch.no_grad():
        assert decodes(q, k, v, one, False, True)
        got = kernel_sdpa(q, k, v, attn_mask=one, enable_gqa=True, scale=0.3)
    assert (got - want).abs().max().item() <= 48 * 2**-24 * v.abs().max().item()


@BUILT
def test_kernel_refuses_what_it_is_not_built_for():
    "A head size or a group it has no code for raises a clear error instead of reading past the rows."
    kernel = decode_kernel()
    q, k, v, _ = decode_case(64, 3, 10)
    with pytest.raises(RuntimeError, match="head sizes"):
        kernel.decode_attention(torch.randn(3, 6, 48), k[..., :48].contiguous(), v[..., :48].contiguous(), None, 1.0)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.decode_attention(q.float().reshape(3, 6, 64), k.float(), v.float(), None, 1.0)


def test_declined_calls_are_cpu_sdpa():
    "A prefill, a float32 cache, a causal step over many keys or a call needing gradients: `cpu_sdpa`'s own result."
    q, k, v, mask = decode_case(64, 3, 20)
    prefill, per_head = torch.randn(3, 6, 20, 64).to(BF16), mask.expand(3, 6, 1, 20)
    calls = [(prefill, k, v, dict(is_causal=True)), (q.float(), k.float(), v.float(), dict(attn_mask=mask)),
             (q, k, v, dict(is_causal=True)), (q.float().requires_grad_(), k, v, dict(attn_mask=mask)),
             (q, k.detach().requires_grad_(), v, dict(attn_mask=mask)), (q, k, v, dict(attn_mask=per_head)),
             (q, k, v[..., :32], dict(attn_mask=mask))]                          # values of another head size
    with torch.autocast("cpu", dtype=BF16):
        for qq, kk, vv, kw in calls:
            assert not decodes(qq, kk, vv, kw.get("attn_mask"), kw.get("is_causal", False), True)
            want = cpu_sdpa(qq, kk, vv, enable_gqa=True, **kw)
            assert torch.equal(kernel_sdpa(qq, kk, vv, enable_gqa=True, **kw), want)
    assert not decodes(q, k, v, mask, False, True)                                  # outside autocast: float32 rules


def tiny_qwen():
    "A Qwen2-style model of 6 query and 2 key/value heads of 32, the fast paths on."
    torch.manual_seed(0)
    return use_fast_paths(Llama(DecoderConfig(model_type="qwen2", vocab_size=256, hidden_size=192,
                                              intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
                                              num_key_value_heads=2, attention_bias=True,
                                              max_position_embeddings=128)).eval())


def test_switch_follows_the_build():
    "use_decode_kernel switches the attention only where the kernel runs, and back; a model without fast paths: no."
    model = tiny_qwen()
    attention = [m for m in model.modules() if "sdpa" in m.__dict__]
    assert use_decode_kernel(model) == (decode_kernel() is not None)
    assert all(m.sdpa is (kernel_sdpa if decode_kernel() else cpu_sdpa) for m in attention)
    assert not use_decode_kernel(model, on=False) and all(m.sdpa is cpu_sdpa for m in attention)
    assert not use_decode_kernel(use_fast_paths(tiny_qwen(), on=False))


@BUILT
def test_decode_step_logits_agree(monkeypatch):
    "One cached decode step after a prompt, bf16 autocast: logits within a bf16 rounding or two, the kernel called."
    model, out, calls, kernel = tiny_qwen(), {}, [], decode_kernel()
    compiled = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *args: calls.append(1) or compiled(*args))
    ids = torch.randint(0, 256, (3, 12))
    for on in (False, True):
        use_decode_kernel(model, on)
        cache = model.new_kv_cache(3, 16, dtype=BF16)
        with torch.autocast("cpu", dtype=BF16), torch.no_grad():
            model(ids, kv_cache=cache)                                          # the prompt: torch's attention
            out[on] = model(ids[:, -1:], kv_cache=cache).float()               # one decode step: the kernel's
    assert len(calls) == 2                                                      # one call a layer
    gap, scale = (out[True] - out[False]).abs().max().item(), out[False].abs().max().item()
    assert gap <= 2**-6 * scale, (gap, scale)
