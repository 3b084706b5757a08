"""vLLM as the rollout engine (nanorl.vllm_engine) on a tiny Qwen2 folder; skipped where vLLM does not import.

`make setup` installs vLLM's CPU build on Linux x86-64 (the extra `nanorl[vllm]`), so there these tests run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch
import torch.nn.functional as F

from nanorl.model import Sampler
from nanorl.vllm_engine import SYNC_WAYS, VLLMEngine, import_vllm

SET_NUM_THREADS = torch.set_num_threads  # before any vLLM engine starts: it must be the same function after

try:
    import_vllm()
except ImportError as e:
    pytest.skip(f"vLLM does not import here: {str(e)[:300]}", allow_module_level=True)

from doubles import gsm8k_chat_conversations, save_tiny_qwen2_head32  # noqa: E402  (needs transformers, as vLLM)
from nanorl.checkpoint import load_model  # noqa: E402
from nanorl.engine import Engine  # noqa: E402

LOGPROB_TOL = 1e-4  # float32 vLLM kernels against nanorl's forward: measured gaps are about 1e-6 on this model
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
    "Rows, prompt prefixes, masks, log-probs, cut and stats have the shapes of nanorl's Engine.generate_many."
    kw = dict(num_samples=3, max_tokens=12, temperature=1.0, top_k=50, seed=7)
    gen = engine.generate_many(prompts, **kw)
    seqs, masks = gen
    ref_seqs, ref_masks = Engine(*nano).generate_many(prompts, **kw)
    assert len(seqs) == len(masks) == len(ref_seqs) == len(ref_masks) == 9
    for r, (seq, mask) in enumerate(zip(seqs, masks)):
        prompt, cut, n = prompts[r // 3], gen.cut[r], len(seq) - len(prompts[r // 3])
        assert seq[: len(prompt)] == prompt == ref_seqs[r][: len(prompt)]
        assert mask == [0] * len(prompt) + [1] * n and ref_masks[r][: len(prompt)] == [0] * len(prompt)
        assert len(gen.logprobs[r]) == n and all(lp <= 0 for lp in gen.logprobs[r])
        assert not engine.stop_tokens & set(seq[len(prompt) : -1])  # a stop token only last
        assert (cut and n == 12 and seq[-1] not in engine.stop_tokens) or (not cut and seq[-1] in engine.stop_tokens)
    stats = gen.stats
    assert stats["tool_calls"] == 0 and stats["rows"] == 9 and stats["prompts"] == 3
    assert stats["sampled_tokens"] + stats["finished_rows"] == sum(map(sum, masks))
    assert stats["finished_rows"] == gen.cut.count(False)
    empty = engine.generate_many(prompts, num_samples=2, max_tokens=0)
    assert empty[0] == [p for p in prompts for _ in range(2)] and all(empty.cut)
    assert len(engine.generate_many(prompts[:1], max_tokens=2, top_k=10**6)[0]) == 1  # top_k >= vocabulary: all of it
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate_many(prompts, max_tokens=engine.max_model_len)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate_many([prompts[0], []])
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 \(0: greedy\), got -1.0$"):  # `Sampler.of`'s
        engine.generate_many(prompts, max_tokens=2, temperature=-1.0)


def test_greedy_equals_nanorls_engine(engine, nano, prompts):
    "At temperature 0 both engines write the same tokens on the same weights."
    ours = Engine(*nano).generate_many(prompts, max_tokens=24, **GREEDY)
    assert engine.generate_many(prompts, max_tokens=24, **GREEDY) == ours


def test_a_stop_token_ends_the_row_last_in_its_sequence(engine, nano, prompts, monkeypatch):
    "A row that samples a stop token ends there, the token last in its sequence with mask 1 and its log-prob."
    (seq,), _ = Engine(*nano).generate_many(prompts[:1], max_tokens=24, **GREEDY)
    completion = seq[len(prompts[0]) :]
    stop = completion[4]
    monkeypatch.setattr(engine, "stop_tokens", {stop})
    gen = engine.generate_many(prompts[:1], max_tokens=24, **GREEDY)
    (got,), (mask,) = gen
    end = completion.index(stop) + 1
    assert got == prompts[0] + completion[:end] and sum(mask) == end and mask[-1] == 1
    assert gen.cut == [False] and gen.stats["finished_rows"] == 1
    with torch.no_grad():  # the stop token's log-prob, at temperature 0 the log-softmax of the logits
        logits = nano[0](torch.tensor([got[:-1]]))[0, -1]  # (V,)
    assert abs(gen.logprobs[0][-1] - F.log_softmax(logits, -1)[stop].item()) < LOGPROB_TOL


def test_logprobs_are_the_sampled_distributions(engine, nano, prompts):
    "vLLM's log-probs equal log_softmax(logits / T) over nanorl's top-k logits, stop token included, at T=0.7, k=3."
    model = nano[0]
    gen = engine.generate_many(prompts, num_samples=2, max_tokens=16, temperature=0.7, top_k=3, seed=1)
    for r, seq in enumerate(gen.sequences):
        prompt = prompts[r // 2]
        completion, theirs = seq[len(prompt) :], torch.tensor(gen.logprobs[r])
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


def test_the_rl_batch_shape_runs_and_rows_do_not_depend_on_it(engine, nano):
    "16 prompts x 16 seeded samples (more prompt tokens than one step's budget) run; a prompt's rows match it alone."
    prompts = [nano[1].render_for_completion(c) for c in gsm8k_chat_conversations(16)]
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert 16 * sum(map(len, prompts)) > budget  # chunked prefill would cut a seeded row: CPU Generator offset error
    kw = dict(num_samples=16, max_tokens=8, temperature=1.0, top_k=50)
    gen = engine.generate_many(prompts, seed=list(range(16)), **kw)
    seqs, masks = gen
    assert len(seqs) == 256 and gen.stats["sampled_tokens"] + gen.stats["finished_rows"] == sum(map(sum, masks))
    alone = engine.generate_many(prompts[5:6], seed=[5], **kw)
    assert (seqs[80:96], masks[80:96]) == alone


@pytest.mark.parametrize("via", SYNC_WAYS)
def test_sync_weights_makes_vllm_sample_the_updated_model(engine, folder, prompts, via):
    "After an optimizer step and sync_weights (in memory or through files), vLLM's greedy continuation is nanorl's."
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
        seconds = engine.sync_weights(model, via=via)
        after = engine.generate_many([prompt], max_tokens=16, **GREEDY)
        assert after == Engine(model, tok).generate_many([prompt], max_tokens=16, **GREEDY)
        assert after != before
        with torch.no_grad():  # at temperature 0 vLLM reports the log-softmax of the logits
            logits = model(torch.tensor(after[0]))[0, len(prompt) - 1 : -1]  # (16, V)
        ours = F.log_softmax(logits, -1).gather(-1, torch.tensor(after[0][0][len(prompt) :])[:, None])[:, 0]
        assert (torch.tensor(after.logprobs[0]) - ours).abs().max() < LOGPROB_TOL  # head repacked, cache reset
        assert seconds > 0 and engine.last_sync["via"] == via
        assert engine.last_sync["write_seconds"] + engine.last_sync["reload_seconds"] == pytest.approx(seconds)
        assert (folder / "model.safetensors").read_bytes() == source_weights  # only vLLM's own copy changed
    finally:
        engine.sync_weights(original, via=via)  # a state dict works as well as a model
    assert engine.generate_many([prompt], max_tokens=16, **GREEDY) == before


def test_sync_weights_refuses_an_unknown_way(engine, nano):
    "A misspelt `via` is an error naming the ways, not a silent default."
    with pytest.raises(ValueError, match="memory"):
        engine.sync_weights(nano[0], via="disk")


def test_vllm_logprobs_equal_the_trainers_at_the_runs_defaults(engine, nano, prompts):
    "At temperature 1 and top-k 50 (the run's defaults), vLLM's log-probs are the trainer's Sampler's within 1e-4."
    model = nano[0]
    gen = engine.generate_many(prompts, num_samples=4, max_tokens=24, temperature=1.0, top_k=50, seed=3)
    seqs, masks = gen
    gaps = []
    for r, seq in enumerate(seqs):
        n, ids = len(prompts[r // 4]), torch.tensor([seq])  # (1, T), the stop token trained as the trainer does
        targets = torch.cat([torch.full((1, n - 1), -1), ids[:, n:]], 1)  # (1, T - 1)
        with torch.no_grad():
            nll = model(ids[:, :-1], targets=targets, loss_reduction="none", sampler=Sampler(1.0, 50))  # (T - 1,)
        theirs = torch.tensor(gen.logprobs[r])  # (T - n,)
        gaps.append((theirs + nll[n - 1 :]).abs())
    gaps = torch.cat(gaps)
    assert len(gaps) == sum(map(sum, masks))
    assert gaps.max() < LOGPROB_TOL
    assert ((gaps.exp() - 1).abs() > 0.1).sum() == 0  # no token's ratio outside [0.9, 1.1]: no correction needed


def test_the_process_is_left_as_vllm_found_it(engine, prompts):
    "vLLM's CPU worker swaps torch.set_num_threads for a no-op and draws from the global generator; both are undone."
    state = torch.get_rng_state()
    engine.generate_many(prompts, num_samples=2, max_tokens=4, temperature=1.0, top_k=50)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.set_num_threads is SET_NUM_THREADS


def test_two_ranks_each_run_their_own_vllm_in_the_trainers_group(folder, tmp_path):
    "Under torchrun each rank's vLLM joins the ranks' gloo group, samples as nanorl does, and closes leaving it up."
    out = tmp_path / "ranks.json"
    script = Path(__file__).parent / "vllm_ranks_script.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(folder), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["total"] == 3.0  # all_reduce after both engines closed
    assert [r["rank"] for r in result["results"]] == [0, 1]
    assert all(r["equal"] and r["joined"] and r["vllm_world"] == 2 for r in result["results"])
    assert result["results"][0]["completion"] != result["results"][1]["completion"]  # each rank its own prompt
