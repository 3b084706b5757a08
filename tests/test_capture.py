"""Captured decoding (`13a_capture`): the masked step a CUDA graph holds samples as the plain one, on a CPU; the
recorded graph does too where a GPU is present; the trainer switches it on only for its own engine on a GPU."""

import pytest
import torch
from doubles import BiasedModel, load_fixture_model, tool_bias
from rounding import assert_sampled_agrees

from nanorl.capture import CapturedDecoder, masked_decoder, use_captured_decoding
from nanorl.engine import Engine
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
    """On a GPU the replayed graph gives the masked step's tokens (the same kernels, so near ties only), across
    compactions, under autocast, and after the weights change between calls (a replay reads them afresh)."""
    prompts, kw = prompts_of(tok), dict(num_samples=4, max_tokens=24, top_k=50, seed=[1, 2, 3])
    for name, model in capture_models(tok).items():
        model.cuda()
        if isinstance(model, BiasedModel):
            model.bias = model.bias.cuda()                # a plain attribute: .cuda() leaves it behind
        eng = Engine(model, tok)
        eng.compact_fraction = 0.0
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            for _ in range(2):
                eng.decoder = CapturedDecoder
                captured = eng.generate_many(prompts, **kw)
                eng.decoder = masked_decoder
                masked = eng.generate_many(prompts, **kw)
                assert_sampled_agrees(eng, prompts, captured, masked, atol=1e-1 if dtype != torch.float32 else 1e-4,
                                      **kw)
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.01)                      # new weights: the next call must read them
        model.cpu()
