"""vLLM as the rollout engine (nanorl.vllm_engine) on a tiny Qwen2 folder; skipped where vLLM does not import."""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch
import torch.nn.functional as F

from nanorl.vllm_engine import VLLMEngine, import_vllm

try:
    import_vllm()
except ImportError as e:
    pytest.skip(f"vLLM does not import here: {str(e)[:300]}", allow_module_level=True)

from doubles import gsm8k_chat_conversations, save_tiny_qwen2_head32  # noqa: E402  (needs transformers, as vLLM)
from nanorl.checkpoint import load_model  # noqa: E402
from nanorl.engine import Engine  # noqa: E402

LOGPROB_TOL = 1e-4  # float32 vLLM kernels against nanorl's forward: measured gaps are about 1e-5
GREEDY = dict(num_samples=1, temperature=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    "A tiny random Qwen2 folder with head_dim 32 (the CPU backend rejects 16)."
    return save_tiny_qwen2_head32(tmp_path_factory.mktemp("vllm") / "qwen2")


@pytest.fixture(scope="module")
def engine(folder):
    "One vLLM engine for the whole module (starting one takes seconds)."
    eng = VLLMEngine(folder, kv_cache_bytes=64 << 20)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def nano(folder):
    "(model, tokenizer) of the same folder, loaded by nanorl."
    model, tok, _ = load_model(folder, "cpu")
    return model.eval(), tok


@pytest.fixture(scope="module")
def prompts(nano):
    "Three chat prompts of different lengths, rendered by nanorl."
    tok = nano[1]
    return [tok.render_for_completion(c) for c in gsm8k_chat_conversations(3)]


def completions(seqs, prompts, num_samples):
    "The completion part of each row."
    return [s[len(prompts[r // num_samples]) :] for r, s in enumerate(seqs)]


def test_contract_matches_nanorls_engine(engine, nano, prompts):
    "Rows, prompt prefixes, masks, log-probs, stops and stats have the shapes of nanorl's Engine.generate_many."
    kw = dict(num_samples=3, max_tokens=12, temperature=1.0, top_k=50, seed=7)
    seqs, masks = engine.generate_many(prompts, **kw)
    ref_seqs, ref_masks = Engine(*nano).generate_many(prompts, **kw)
    assert len(seqs) == len(masks) == len(ref_seqs) == len(ref_masks) == 9
    for r, (seq, mask) in enumerate(zip(seqs, masks)):
        prompt, stop, n = prompts[r // 3], engine.last_stops[r], len(seq) - len(prompts[r // 3])
        assert seq[: len(prompt)] == prompt == ref_seqs[r][: len(prompt)]
        assert mask == [0] * len(prompt) + [1] * n and ref_masks[r][: len(prompt)] == [0] * len(prompt)
        assert len(engine.last_logprobs[r]) == n and all(lp <= 0 for lp in engine.last_logprobs[r])
        assert not engine.stop_tokens & set(seq[len(prompt) :])
        assert (stop is None and n == 12) or (stop[0] in engine.stop_tokens and stop[1] <= 0)
    stats = engine.last_stats
    assert stats["tool_calls"] == 0 and stats["rows"] == 9 and stats["prompts"] == 3
    assert stats["sampled_tokens"] == sum(map(sum, masks))
    assert stats["finished_rows"] == sum(s is not None for s in engine.last_stops)
    assert engine.generate_many(prompts, num_samples=2, max_tokens=0)[0] == [p for p in prompts for _ in range(2)]
    assert len(engine.generate_many(prompts[:1], max_tokens=2, top_k=10**6)[0]) == 1  # top_k >= vocabulary: all of it
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate_many(prompts, max_tokens=engine.max_model_len)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate_many([prompts[0], []])


def test_greedy_equals_nanorls_engine(engine, nano, prompts):
    "At temperature 0 both engines write the same tokens on the same weights."
    ours = Engine(*nano).generate_many(prompts, max_tokens=24, **GREEDY)
    assert engine.generate_many(prompts, max_tokens=24, **GREEDY) == ours


def test_a_stop_token_ends_the_row_and_leaves_the_sequence(engine, nano, prompts, monkeypatch):
    "A row that samples a stop token ends there; the token is in last_stops with its log-prob, not in the sequence."
    (seq,), _ = Engine(*nano).generate_many(prompts[:1], max_tokens=24, **GREEDY)
    completion = seq[len(prompts[0]) :]
    stop = completion[4]
    monkeypatch.setattr(engine, "stop_tokens", {stop})
    (got,), (mask,) = engine.generate_many(prompts[:1], max_tokens=24, **GREEDY)
    cut = completion.index(stop)
    assert got == prompts[0] + completion[:cut] and sum(mask) == cut
    assert engine.last_stops[0][0] == stop and engine.last_stats["finished_rows"] == 1
    with torch.no_grad():  # the stop token's log-prob, at temperature 0 the log-softmax of the logits
        logits = nano[0](torch.tensor([got]))[0, -1]  # (V,)
    assert abs(engine.last_stops[0][1] - F.log_softmax(logits, -1)[stop].item()) < LOGPROB_TOL


def test_logprobs_are_the_sampled_distributions(engine, nano, prompts):
    "vLLM's log-probs equal log_softmax(logits / T) over nanorl's top-k logits, stop token included, at T=0.7, k=3."
    model = nano[0]
    seqs, _ = engine.generate_many(prompts, num_samples=2, max_tokens=16, temperature=0.7, top_k=3, seed=1)
    for r, seq in enumerate(seqs):
        prompt, stop = prompts[r // 2], engine.last_stops[r]
        completion = seq[len(prompt) :] + ([stop[0]] if stop else [])
        theirs = torch.tensor(engine.last_logprobs[r] + ([stop[1]] if stop else []))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion]))[0, len(prompt) - 1 : -1]  # (n, V)
        vals, idx = logits.topk(3, dim=-1)  # (n, 3)
        hit = idx == torch.tensor(completion)[:, None]  # (n, 3)
        assert hit.any(-1).all(), f"row {r}: a sampled token outside nanorl's top 3"
        ours = F.log_softmax(vals / 0.7, dim=-1)[hit]  # (n,)
        assert (theirs - ours).abs().max() < LOGPROB_TOL


def test_seeds_make_rows_reproducible_and_independent_of_the_batch(engine, prompts):
    "The same seeds give the same samples; a prompt's rows do not depend on the other prompts; global RNG kept."
    kw = dict(num_samples=3, max_tokens=10, temperature=1.0, top_k=50)
    alone = engine.generate_many(prompts[1:2], seed=[11], **kw)
    state = torch.get_rng_state()
    assert engine.generate_many(prompts[1:2], seed=[11], **kw) == alone
    assert torch.equal(torch.get_rng_state(), state)
    seqs, masks = engine.generate_many(prompts, seed=[5, 11, 6], **kw)
    assert (seqs[3:6], masks[3:6]) == alone
    assert len({tuple(s) for s in alone[0]}) > 1  # the samples of one prompt differ from each other


def test_sync_weights_makes_vllm_sample_the_updated_model(engine, folder, prompts):
    "After an optimizer step and sync_weights, vLLM's greedy continuation equals nanorl's on the new weights."
    model, tok, _ = load_model(folder, "cpu")  # a copy of its own: the step must not change the other tests' model
    text = " ".join(c["messages"][0]["content"] for c in gsm8k_chat_conversations(3))
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    prompt = tok.render_for_completion({"messages": messages})
    assert len(prompt) > 128  # longer than one KV block: a stale prefix cache would show
    before = engine.generate_many([prompt], max_tokens=16, **GREEDY)
    assert before == Engine(model.eval(), tok).generate_many([prompt], max_tokens=16, **GREEDY)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    source_weights = (folder / "model.safetensors").read_bytes()
    model.train()
    optimizer = model.setup_optimizers(lr=3e-3)
    ids = torch.tensor([before[0][0]])
    model(ids[:, :-1], targets=ids[:, 1:]).backward()
    optimizer.step()
    model.eval()
    try:
        seconds = engine.sync_weights(model)
        after = engine.generate_many([prompt], max_tokens=16, **GREEDY)
        assert after == Engine(model, tok).generate_many([prompt], max_tokens=16, **GREEDY)
        assert after != before
        with torch.no_grad():  # at temperature 0 vLLM reports the log-softmax of the logits
            logits = model(torch.tensor(after[0]))[0, len(prompt) - 1 : -1]  # (16, V)
        ours = F.log_softmax(logits, -1).gather(-1, torch.tensor(after[0][0][len(prompt) :])[:, None])[:, 0]
        assert (torch.tensor(engine.last_logprobs[0]) - ours).abs().max() < LOGPROB_TOL  # no stale prompt cache
        assert seconds > 0 and set(engine.last_sync) == {"write_seconds", "reload_seconds"}
        assert (folder / "model.safetensors").read_bytes() == source_weights  # only vLLM's own copy changed
    finally:
        model.load_state_dict(original)
        engine.sync_weights(model)
    assert engine.generate_many([prompt], max_tokens=16, **GREEDY) == before
