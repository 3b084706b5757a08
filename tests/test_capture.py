"""Captured decoding (`13a_capture`): the masked step a CUDA graph holds samples as the plain one, on a CPU; the
recorded graph does too where a GPU is present; the trainer switches it on only for its own engine on a GPU."""

from contextlib import contextmanager

import pytest
import torch
from doubles import BiasedModel, load_fixture_model, tool_bias
from rounding import assert_sampled_agrees

from nanorl.capture import CapturedDecoder, masked_decoder, use_captured_decoding
from nanorl.engine import Engine, plain_decoder
from nanorl.llama import DecoderConfig, Llama

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU; none here")


def qwen_like(vocab_size):
    "A tiny random Qwen2-style model (biases on q, k, v; GQA)."
    torch.manual_seed(0)
    return Llama(DecoderConfig(model_type="qwen2", vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                               max_position_embeddings=512)).eval()


def capture_models(tok):
    "The fixture GPTs of both generations, biased toward tool calls and stops, and a Qwen2-style model."
    bias = tool_bias(tok)
    return {"head": BiasedModel(load_fixture_model("head"), bias),
            "oct2025": BiasedModel(load_fixture_model("oct2025"), bias), "qwen2": qwen_like(tok.get_vocab_size())}


def prompts_of(tok):
    "Prompts of three lengths: rows at other positions in one cache."
    chat = {"messages": [{"role": "user", "content": "What is 6 times 7?"}, {"role": "assistant", "content": ""}]}
    prompt = tok.render_for_completion(chat)
    return [prompt, prompt[:5], tok.encode("Total:", prepend="<|bos|>")]


@pytest.mark.parametrize("compact", [0.0, 10.0])
def test_masked_step_samples_as_the_plain_one(tok, compact):
    """Attending over every slot of the cache, masked by each row's position, gives the plain step's tokens up to
    near ties (the softmax sums zeros for the masked slots: the same values, other reduction lengths): retired rows
    and compactions (a new decoder each time), tool calls and forced output included."""
    prompts, kw = prompts_of(tok), dict(num_samples=4, max_tokens=24, top_k=50, seed=[1, 2, 3])
    for name, model in capture_models(tok).items():
        eng = Engine(model, tok)
        eng.compact_fraction = compact
        plain = eng.generate_many(prompts, **kw)
        eng.decoder = masked_decoder
        masked = eng.generate_many(prompts, **kw)
        assert assert_sampled_agrees(eng, prompts, plain, masked, **kw).count(None) >= 9, name
        assert masked.stats == plain.stats or masked.sequences != plain.sequences, name
        if compact == 0.0 and name == "head":             # the tool-biased model retires rows early
            assert masked.stats["compactions"] > 0 and masked.stats["tool_calls"] > 0, name


ADDRESSES = ("k_cache", "v_cache", "cache_seqlens", "prev_embedding")


def addresses(cache):
    "Where the cache's tensors live: a recorded graph reads and writes there, so they may change only in place."
    return {a: getattr(cache, a).data_ptr() for a in ADDRESSES if getattr(cache, a) is not None}


@contextmanager
def no_host_sync():
    "A block in which reading a tensor's value on the host (what would stall a GPU) raises instead."
    def refuse(*args, **kwargs):
        raise AssertionError("the step read a tensor's value on the host")
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    for n in names:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


class CheckedDecoder:
    "`masked_decoder` held to what a CUDA graph needs, on a CPU: no host sync in a step, the cache's tensors kept."
    made = 0

    def __init__(self, model, cache):
        self.cache, self.step, self.where = cache, masked_decoder(model, cache), addresses(cache)
        CheckedDecoder.made += 1

    def __call__(self, x):
        with no_host_sync():
            h = self.step(x)
        assert addresses(self.cache) == self.where, "the cache's tensors moved under a decoder"
        return h


def test_masked_step_keeps_what_a_graph_needs(tok):
    """Every masked step runs without a host sync and leaves the cache's tensors where they were, and the engine builds
    a new decoder after each compaction (which moves them); the plain step syncs, so the check can fail."""
    prompts, kw = prompts_of(tok), dict(num_samples=4, max_tokens=24, top_k=50, seed=[1, 2, 3])
    for name, model in capture_models(tok).items():
        eng = Engine(model, tok)
        eng.compact_fraction, eng.decoder, CheckedDecoder.made = 0.0, CheckedDecoder, 0
        out = eng.generate_many(prompts, **kw)
        assert 1 <= CheckedDecoder.made <= out.stats["compactions"] + 1, name      # built lazily: none at the end
        assert name != "head" or out.stats["compactions"] > 0
    cache = model.new_kv_cache(2, 8)
    with no_host_sync(), pytest.raises(AssertionError, match="on the host"):
        plain_decoder(model, cache)(torch.zeros(2, dtype=torch.long))


def test_captured_decoding_only_for_the_engine_on_a_gpu(tok):
    "Switched on for nanorl's Engine on a GPU with whole weights; off on a CPU, when sharded, or when not asked."
    eng = Engine(qwen_like(tok.get_vocab_size()), tok)
    assert use_captured_decoding(eng, "cpu") is False and eng.decoder is None
    assert use_captured_decoding(eng, torch.device("cuda"), sharded=True) is False and eng.decoder is None
    assert use_captured_decoding(eng, "cuda", on=False) is False and eng.decoder is None
    assert use_captured_decoding(eng, "cuda") is True and eng.decoder is CapturedDecoder
    other = object()                                      # another engine (vLLM's) is left alone
    assert use_captured_decoding(other, "cuda") is False and not hasattr(other, "decoder")


def test_captured_decoder_refuses_what_a_graph_cannot_hold(tok):
    "A cache on the CPU, or one longer than the model's rotary table, is refused by name."
    model = qwen_like(tok.get_vocab_size())
    with pytest.raises(ValueError, match="needs a GPU"):
        CapturedDecoder(model, model.new_kv_cache(2, 16))
    if torch.cuda.is_available():
        model.cuda()
        with pytest.raises(ValueError, match="rotary table"):
            CapturedDecoder(model, model.new_kv_cache(2, model.rotary_len + 1))


@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recorded_step_samples_as_the_masked_one(tok, dtype):
    """On a GPU the replayed graph gives the masked step's tokens (the same kernels: near ties at most), across
    compactions, under autocast, and again after the weights change (each call records its own graph)."""
    prompts, kw = prompts_of(tok), dict(num_samples=4, max_tokens=24, top_k=50, seed=[1, 2, 3])
    atol = 1e-1 if dtype == torch.bfloat16 else 1e-4          # bf16 logits of about 10 round by up to 0.05
    for name, model in capture_models(tok).items():
        model.cuda()
        if isinstance(model, BiasedModel):
            model.bias = model.bias.cuda()                # a plain attribute: .cuda() leaves it behind
        eng = Engine(model, tok)
        eng.compact_fraction = 0.0
        for _ in range(2):
            out = {}
            for decoder in (CapturedDecoder, masked_decoder):
                eng.decoder = decoder
                with torch.autocast("cuda", dtype=dtype, enabled=dtype == torch.bfloat16):   # casts of these weights
                    out[decoder] = eng.generate_many(prompts, **kw)
            found = assert_sampled_agrees(eng, prompts, out[CapturedDecoder], out[masked_decoder], atol=atol, **kw)
            assert found.count(None) >= 9, name
            if name == "head":
                assert out[CapturedDecoder].stats["compactions"] > 0
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.01)                          # new weights for the second round
        model.cpu()


@GPU
def test_replays_stop_at_the_end_of_the_cache(tok):
    "A replay past the cache's last slot is refused before it writes out of bounds."
    model = qwen_like(tok.get_vocab_size()).cuda()
    cache = model.new_kv_cache(2, 3)
    decode = CapturedDecoder(model, cache)
    x = torch.zeros(2, dtype=torch.long, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            decode(x)
        with pytest.raises(ValueError, match="cache is full"):
            decode(x)
