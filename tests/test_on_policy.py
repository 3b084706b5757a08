"""On-policy, exactly: the engine's log-probs are the sampler's, the loss trains that distribution, the stop token
is trained, and every run measures the gap between sampler and trainer.

Tolerances. The engine computes a token's logits in a KV-cached decode step (packed weights, one row at a time), the
trainer in one forward over the whole row; in float32 the two differ by summation order only, a few 1e-7 relative on
logits of order 10, so log-probs agree to about 1e-5 (measured: at most 6e-6 on the runs below). 1e-4 is the bound
the trainer promises (`logp_gap_max`), and it is what the checks here use. Gradients are compared relative to their
largest entry at 1e-4: the from-scratch path and nanorl's differ in the order of float32 sums over the vocabulary.
"""

import json, os, shutil, subprocess, sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness import ROOT, TORCHRUN, run_checked
from doubles import FIXTURES, demo_sft, load_fixture_model, nanochat_tokenizer, save_tiny_hf_model, small_run
from nanorl.engine import Engine
from nanorl.speedups import packed_weights, use_fast_paths
from nanorl.loss import pg_loss, token_logp, token_sum
from nanorl.prefix import shared_token_logp
from nanorl.model import Sampler
from nanorl.rollout import Rollout, Sampling, collate, collate_logprobs, rollout, sample_seeds, trained_rows
from nanorl.tasks import Arithmetic
from nanorl.config import Config
from nanorl.step import Pass, Policy, backward_passes, score, step_normalizer

GAP = 1e-4  # the trainer's promise in float32 (see the module docstring)


def sampler_logp(model, seq, temperature, top_k):
    "From scratch: log-probs of seq[1:] under softmax(logits / temperature) over the top_k logits, one full forward."
    with torch.no_grad():
        z = model.unembed(model.hidden(torch.tensor([seq])))[0, :-1].double() / temperature  # (L-1, V)
    if top_k:  # exactly the k largest, as the engine keeps them (a tie at the k-th place keeps one of the pair)
        z = torch.full_like(z, float("-inf")).scatter(-1, z.topk(top_k, dim=-1).indices, z.topk(top_k, dim=-1).values)
    return z.log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)  # (L-1,)


@pytest.fixture(scope="module")
def demo():
    "The demo's SFT model (it calls the calculator and stops by itself), its tokenizer and two of its problems."
    model, tok = demo_sft()
    task = Arithmetic(n=50, seed=0, split="train")
    return model, tok, [tok.render_for_completion(task[i]) for i in (3, 7)], task


@pytest.mark.parametrize("temperature, top_k", [(0.7, 3), (1.3, None), (1.0, 20), (0.0, None)])
def test_engine_logprobs_are_the_samplers(demo, temperature, top_k):
    "Every sampled token's log-prob, the stop token's included, equals a from-scratch computation of its distribution."
    model, tok, prompts, _ = demo
    eng = Engine(model, tok)
    gen = eng.generate_many(prompts, 4, 48, temperature=temperature, top_k=top_k, seed=[1, 2])
    seqs, masks = gen
    checked, stopped, forced = 0, 0, 0
    for r, (seq, m, lps, cut) in enumerate(zip(seqs, masks, gen.logprobs, gen.cut)):
        P = len(prompts[r // 4])
        assert len(lps) == len(seq) - P
        assert cut == (seq[-1] not in eng.stop_tokens) and (cut or m[-1] == 1)  # a stopped row ends with its stop
        want = sampler_logp(model, seq, temperature, top_k)[P - 1 :] if temperature else torch.zeros(len(lps))
        for g, w, s in zip(lps, want.tolist(), m[P:]):
            if s:
                assert abs(g - w) < GAP, (r, g, w)
                checked += 1
            else:
                assert g == 0.0, "forced tool output was not sampled: no log-prob"
                forced += 1
        stopped += not cut
    assert stopped > 0 and forced > 0 and checked > 100, (stopped, forced, checked)
    assert all(cut or seq[-1] == tok.encode_special("<|assistant_end|>") for seq, cut in zip(seqs, gen.cut))


def sampled_batch(model, tok, temperature=0.7, top_k=3):
    "Two rows sampled at (temperature, top_k) from the fixture model, as (inputs, targets) of a training pass."
    prompt = tok.encode("The answer is", prepend="<|bos|>")
    seqs, masks = Engine(model, tok).generate_batch(prompt, 3, 9, temperature=temperature, top_k=top_k, seed=5)
    return collate(seqs, masks, pad_id=tok.encode_special("<|assistant_end|>"))


def scratch_objective(model, inputs, targets, adv, temperature, top_k, coef):
    "The token-normalized policy-gradient loss minus coef x entropy of the sampler's distribution, plain torch ops."
    mask = targets != -1
    z = model.unembed(model.hidden(inputs)) / temperature  # (B, T, V)
    top = z.topk(top_k, dim=-1)
    z = torch.full_like(z, float("-inf")).scatter(-1, top.indices, top.values)  # exactly the k largest
    logp_all = z.log_softmax(-1)
    logp = logp_all.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # (B, T)
    entropy = -(logp_all.exp() * logp_all.masked_fill(logp_all.isinf(), 0.0)).sum(-1)  # (B, T); 0 log 0 = 0
    n = mask.sum()
    return -(adv[:, None] * logp)[mask].sum() / n - coef * entropy[mask].sum() / n


def nanorl_objective(model, inputs, targets, adv, sampler, coef):
    "The same objective through the trainer's shared_token_logp (prompt once, fused loss where switched on), pg_loss."
    mask = targets != -1
    logp, entropy = shared_token_logp(model, inputs, targets, with_entropy=True, entropy_grad=coef > 0, sampler=sampler)
    n = float(mask.sum())
    return pg_loss(logp, adv, mask, "token", n) - coef * token_sum(entropy, mask, "token", n)


@pytest.mark.parametrize("family", ["gpt", "qwen2"])
@pytest.mark.parametrize("path", ["plain", "fast"])
def test_loss_gradient_is_the_samplers(tmp_path, family, path):
    "At T = 0.7, top-k 3: the gradient of nanorl's loss (and entropy bonus) is that of the sampler's log-probs."
    if family == "gpt":
        model, tok = load_fixture_model("head"), nanochat_tokenizer()
    else:
        pytest.importorskip("transformers")
        from nanorl.checkpoint import load_model

        save_tiny_hf_model("qwen2", tmp_path / "qwen2")
        model, tok, _ = load_model(tmp_path / "qwen2", "cpu")
    inputs, targets = sampled_batch(model, tok)
    adv = torch.tensor([1.0, -0.5, 0.25])
    params = [p for p in model.parameters() if p.requires_grad]
    scratch = torch.autograd.grad(scratch_objective(model, inputs, targets, adv, 0.7, 3, 0.1), params)
    use_fast_paths(model, on=path == "fast")
    with packed_weights(model) if path == "fast" else nullcontext():
        ours = torch.autograd.grad(nanorl_objective(model, inputs, targets, adv, Sampler(0.7, 3), 0.1), params)
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(ours, scratch))
    assert worst < 1e-4, worst
    raw = torch.autograd.grad(nanorl_objective(model, inputs, targets, adv, None, 0.1), params)
    assert max((a - b).abs().max().item() for a, b in zip(raw, scratch)) > 1e-3, "the raw distribution differs"


def test_stop_token_logprob_moves_with_its_advantage(demo):
    "Rows whose only trained token is their stop: its log-prob rises with a positive advantage, falls with a negative."
    model, tok, prompts, task = demo
    sampling = Sampling(num_samples=4, max_new_tokens=48, temperature=1.0, top_k=None)
    batch = rollout(Engine(model, tok), tok, task, [3], sampling, sample_seeds(0, 0, [3]), rollout_rows=4)
    assert not any(batch.cut), "the demo model stops within 48 tokens"
    only_stop = Rollout(batch.prompts, batch.sequences, [[0] * (len(m) - 1) + [1] for m in batch.masks], batch.cut, 0,
                        4, batch.logprobs)  # the completion's own tokens untrained: the stop alone
    pad = tok.encode_special("<|assistant_end|>")
    for sign in (1.0, -1.0):
        for train_stop in (True, False):
            m = demo_sft()[0]
            m.train()
            seqs, masks, logps = trained_rows(only_stop, range(4), train_stop)
            inputs, targets = collate(seqs, masks, pad)
            cfg = Config(temperature=1.0, top_k=0, loss_norm="token", train_stop=train_stop)
            norm = step_normalizer(cfg.loss_norm, [targets], cfg.max_new_tokens, torch.device("cpu"))
            sampler_logp = collate_logprobs(logps) if train_stop else None
            passes = [Pass(inputs, targets, torch.arange(4), 0, sampler_logp)]
            stats = backward_passes(Policy(m, autocast=torch.autocast("cpu", enabled=False)), passes, torch.full((4,), sign),
                                    cfg.sampling(), cfg.loss_settings(), norm)
            if not train_stop:
                assert stats["tokens"] == 0, "nanochat's rows: no stop token, nothing trained"
                assert all(p.grad is None or p.grad.abs().max() == 0 for p in m.parameters())
                continue
            assert stats["tokens"] == 4 and stats["gap_max"] < GAP
            before = token_logp(m, inputs, targets).detach().sum(1)  # (4,): each row's stop token
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 1e-3 * p.grad
            after = token_logp(m, inputs, targets).detach().sum(1)
            assert ((after - before) * sign > 0).all(), (sign, before, after)


# ---------------------------------------------------------------- the contracts of a run: metrics.jsonl


def run(cmd, out):
    "Run a training command; its per-step records."
    run_checked(cmd)
    (metrics,) = Path(out).glob("chatrl_checkpoints/*/metrics.jsonl")
    return [json.loads(l) for l in metrics.read_text().splitlines()]


DEMO_RUN = small_run(task="arithmetic", model_tag="d3", max_new_tokens=48, temperature=0.7, top_k=20, num_steps=2)


def demo_cmd(tmp_path, name, *extra, launcher=None):
    "A short run on the demo's SFT model (it stops by itself) at temperature 0.7, top-k 20."
    base = tmp_path / name
    shutil.copytree(FIXTURES / "demo_sft", base)
    return [*(launcher or [sys.executable, "-m", "nanorl.train"]), "--base-dir", str(base), *DEMO_RUN, *extra], base


def test_run_measures_the_gap_and_trains_the_stop(tmp_path):
    "Default flags: gap <= 1e-4 and stop tokens trained; --logp model: a gap far above; --no-train-stop: none trained."
    recs = run(*demo_cmd(tmp_path, "default"))
    assert all(r["logp_gap_max"] <= GAP and 0 <= r["logp_gap_mean"] <= r["logp_gap_max"] for r in recs), recs
    assert all(r["stop_trained"] > 0 for r in recs)
    raw = run(*demo_cmd(tmp_path, "model", "--logp", "model"))
    assert all(r["logp_gap_max"] > 1e-3 for r in raw)
    assert [r["reward"] for r in raw][0] == recs[0]["reward"], "the flag changes the loss, not the first samples"
    nanochat = run(*demo_cmd(tmp_path, "nostop", "--no-train-stop"))
    assert all(r["stop_trained"] == 0 and r["logp_gap_max"] <= GAP for r in nanochat)


def test_hf_folder_run_gap(tmp_path):
    "A Hugging Face folder at temperature 0.7, top-k 20: the same bound."
    pytest.importorskip("transformers")
    save_tiny_hf_model("qwen2", tmp_path / "qwen2")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "nanorl.train", "--model-path", str(tmp_path / "qwen2"), "--output-dir", str(out),
           *small_run(max_new_tokens=10, lr="1e-3", num_steps=2, temperature=0.7, top_k=20)]
    recs = run(cmd, out)
    assert all(r["logp_gap_max"] <= GAP and r["stop_trained"] >= 0 for r in recs), recs


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_ranks_gap(tmp_path, sharding):
    "Two gloo ranks, DDP and FSDP2: the gap is the largest over both ranks and stays within the bound."
    launcher = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=0", "-m", "nanorl.train"]
    cmd, base = demo_cmd(tmp_path, "two", *sharding, launcher=launcher)
    recs = run(cmd, base)
    assert all(r["logp_gap_max"] <= GAP and r["stop_trained"] > 0 for r in recs), recs
