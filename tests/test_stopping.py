"""Stopping, seen and handled: stop_rate / truncated_frac / stop_adv per step, the held-out stop rate, the policy for
replies cut by the token limit (--truncated keep|mask|zero) and the learning-rate warm-up."""

import json

import pytest
import torch

from doubles import FIXTURES, SMALL_RUN, base_dir, demo_sft
from nanorl.engine import Engine
from nanorl.evaluate import PassAtK, sample_outcomes
from nanorl.rollout import Rollout, Sampling, completion_text, problem_seed, rollout
from nanorl.step import LossSettings, score
from nanorl.tasks import Arithmetic
from nanorl.train import Config, lr_multiplier, main, train, validate

DEMO_SFT = dict(device_type="cpu", base_dir=str(FIXTURES / "demo_sft"), model_tag="d3", task="arithmetic",
                examples_per_step=4, num_samples=4, device_batch_size=4, max_new_tokens=32, temperature=1.0, top_k=0,
                eval_every=2, eval_examples=8, eval_samples=2, save_every=100, num_steps=2, seed=3)


def cut_batch():
    "Two problems x 2 samples, limit 3: row 0 ran to the limit, row 1 stopped early, row 2 stopped on the limit."
    prompts = [[1, 2], [1, 2, 3]]
    sequences = [[1, 2, 5, 6, 7], [1, 2, 5, 9], [1, 2, 3, 5, 6, 9], [1, 2, 3, 5, 6, 7]]   # 9: the stop token
    masks = [[0] * len(p) + [1] * (len(s) - len(p)) for s, p in zip(sequences, [prompts[0]] * 2 + [prompts[1]] * 2)]
    cut = [True, False, False, True]
    texts = [completion_text(CharDecoder(), s, len(prompts[r // 2]), stopped=not cut[r]) for r, s in enumerate(sequences)]
    return Rollout(prompts, sequences, masks, cut, 0, 4, conversations=[AllRight()[0], AllRight()[1]], texts=texts)


def test_lengths_leave_the_stop_token_out():
    "A row's length counts its reply, the stop token not: a row stopped on the limit is as long as a cut one."
    assert cut_batch().lengths() == [3, 1, 2, 3]


class AllRight:
    "Every reply is right."

    def __getitem__(self, i):
        return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}

    def reward(self, conversation, completion):
        return 1.0


class CharDecoder:
    def decode(self, ids):
        return "".join(map(str, ids))


@pytest.mark.parametrize("policy", ["keep", "mask", "zero"])
def test_score_truncation_policy(policy):
    "zero: a cut reply earns 0 and the group's advantages follow; keep and mask: rewards as the task gave them."
    s = score(AllRight(), cut_batch(), LossSettings(truncated=policy))
    assert s.cut.tolist() == [True, False, False, True]
    if policy == "zero":
        assert s.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
        assert s.advantages.tolist() == [-0.5, 0.5, 0.5, -0.5]     # stopping is now what earns the reward
    else:
        assert s.rewards.tolist() == [1.0] * 4 and s.advantages.tolist() == [0.0] * 4


def test_warmup_multiplier():
    "The multiplier rises linearly over the warm-up, then follows the decay; no warm-up is the plain decay."
    n = 20
    plain = [lr_multiplier(s, n) for s in range(n)]
    warm = [lr_multiplier(s, n, warmup=4) for s in range(n)]
    assert plain[0] == 1.0 and warm[0] == pytest.approx(1 / 5)
    assert all(w == pytest.approx(p * (s + 1) / 5) for s, (w, p) in enumerate(zip(warm[:4], plain)))
    assert warm[4:] == plain[4:]
    assert all(a < b for a, b in zip(warm[:4], warm[1:5]))


def test_bad_stopping_flags():
    "--truncated outside its choices and a negative --warmup-steps fail before any work, naming the flag."
    with pytest.raises(ValueError, match="--truncated must be one of"):
        validate(Config(truncated="drop"))
    with pytest.raises(ValueError, match="--warmup-steps must be >= 0"):
        validate(Config(warmup_steps=-1))


def test_eval_stop_rate():
    "The held-out stop rate is the fraction of samples that ended before the limit; absent when nothing recorded it."
    stopped = torch.tensor([[True, False], [True, True]])
    assert PassAtK(torch.zeros(2, 2, dtype=torch.bool), stopped=stopped).metrics()["eval_stop_rate"] == 0.75
    assert "eval_stop_rate" not in PassAtK(torch.zeros(2, 2, dtype=torch.bool)).metrics()


def test_every_step_record_carries_stopping(tmp_path):
    "Every record of `python -m nanorl.train` has stop_rate and truncated_frac in [0, 1], evaluations eval_stop_rate."
    # the demo's SFT model stops on some rows and runs into the limit on others at 32 tokens
    flags = [w for k, v in DEMO_SFT.items() for w in (f"--{k.replace('_', '-')}", str(v))]
    main(flags + ["--output-dir", str(tmp_path)])
    recs = [json.loads(line) for line in (tmp_path / "chatrl_checkpoints" / "d3" / "metrics.jsonl").open()]
    assert len(recs) == 2
    for r in recs:
        assert 0 <= r["stop_rate"] <= 1 and 0 <= r["truncated_frac"] <= 1
        assert r["stop_rate"] + r["truncated_frac"] == pytest.approx(1)
        assert r["stop_trained"] == round(r["stop_rate"] * 16)   # the default trains every sampled stop token
        assert abs(r["stop_adv"]) <= 1
        assert 0 <= r["eval_stop_rate"] <= 1
    assert 0 < sum(r["stop_rate"] for r in recs) / 2 < 1, "the test needs rows that stop and rows that are cut"


def test_mask_truncated_trains_no_cut_row(tmp_path):
    "--truncated mask: when every reply is cut no token is trained: loss 0 and the update of a step without signal."
    def final_weights(name, **changes):
        base = base_dir(tmp_path, name)
        recs = train(Config(**{**SMALL_RUN, "base_dir": str(base), "num_steps": 1, **changes}))
        assert recs[0]["truncated_frac"] == 1, "the small run's random model never stops within 12 tokens"
        ckpt = sorted((base / "chatrl_checkpoints" / "d3").glob("model_*.pt"))[-1]
        return recs[0], torch.load(ckpt, weights_only=True)

    masked, w_mask = final_weights("mask", truncated="mask")
    _, w_none = final_weights("nosignal", task="doubles:make_zero_tasks")      # zero gradients everywhere
    kept, w_keep = final_weights("keep", truncated="keep")
    assert masked["loss"] == 0 and masked["grad_norm"] == 0 and kept["grad_norm"] > 0
    assert all(torch.equal(w_mask[k], w_none[k]) for k in w_none)
    assert any(not torch.equal(w_keep[k], w_none[k]) for k in w_none)


def test_evaluation_and_training_agree_on_stopping_and_text():
    """One rollout read twice: training's stop rate (1 - truncated_frac) and evaluation's eval_stop_rate come from the
    engine's `cut`, and both judge the text without the stop token, so the same samples give the same numbers."""
    model, tok = demo_sft()
    task, indices = Arithmetic(n=64, seed=0, split="train"), list(range(6))
    sampling = Sampling(num_samples=4, max_new_tokens=24, temperature=1.0, top_k=None)
    seeds = [problem_seed(42, i) for i in indices]  # evaluation's seeds, so the engine draws the same samples
    batch = rollout(Engine(model, tok), tok, task, indices, sampling, seeds, rollout_rows=64)
    scores = score(task, batch)
    evaluated = sample_outcomes(Engine(model, tok), tok, task, indices, sampling, seed=42, prompts_per_batch=6)
    assert 0 < scores.cut.sum() < len(batch.sequences), "the test needs rows that stop and rows that are cut"
    assert torch.equal(evaluated.stopped.flatten(), ~scores.cut)
    assert evaluated.metrics()["eval_stop_rate"] == pytest.approx(1 - scores.cut.sum().item() / 24)  # stop_rate
    assert torch.equal(evaluated.outcomes.flatten().float(), scores.rewards)  # the same texts, judged the same
    texts = [completion_text(tok, s, len(batch.prompts[batch.group(r)]), stopped=not c)
             for r, (s, c) in enumerate(zip(batch.sequences, batch.cut))]
    assert not any("<|assistant_end|>" in t for t in texts) and all(s[-1] == tok.encode_special("<|assistant_end|>")
                                                                  for s, c in zip(batch.sequences, batch.cut) if not c)
