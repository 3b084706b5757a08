"""nanorl's policy-gradient loss against TRL's GRPOTrainer on the same batch: which normalizations agree, exactly.

TRL is not a dependency of nanorl: this module skips where it is not installed. The venv of `bench/trl_grpo.py`
(bench/results/venv-trl, made by `python bench/trl_grpo.py --setup`) has it, with pytest:

    bench/results/venv-trl/bin/python -m pytest tests/test_trl_loss.py -q

Each case saves a tiny random Hugging Face model (Llama 3 or Qwen2), loads it in nanorl (`load_llama`) and in TRL's
`GRPOTrainer`, samples 2 prompts x 4 completions with nanorl's engine, cuts them to different lengths, and feeds the
same tokens and advantages to both losses, in two passes of 4 rows, 2 of each prompt (TRL: gradient accumulation over
2 micro-batches, whose rows it shuffles across prompts). nanorl's side is what its trainer runs: `collate`,
`step_normalizer` and `backward_passes` (`token_logp` and `pg_loss`, one backward per pass). TRL's side is
`GRPOTrainer._compute_loss` on the inputs dict its generation step would have built.

On fresh samples TRL optimizes the ratio exp(logp - logp.detach()) * advantage, whose value is the advantage (the
ratio is 1) and whose gradient is REINFORCE's; nanorl's default optimizes logp * advantage. So the gradients of the
two are compared as they are, and the values with nanorl's ratio form (`pg_loss(..., clip=(logp.detach(), 0.2))`).
"""


import pytest

pytest.importorskip("trl")

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from doubles import gsm8k_chat_conversations, save_tiny_hf_model
from nanorl.engine import Engine
from nanorl.chat import ChatTokenizer
from nanorl.llama import load_llama
from nanorl.loss import pg_loss, token_logp
from nanorl.rollout import collate
from nanorl.config import Config
from nanorl.step import Pass, Policy, backward_passes, step_normalizer

GROUPS, GROUP_SIZE, MAX_NEW = 2, 4, 12  # 2 prompts x 4 samples, completions of at most 12 tokens
CUT = [12, 3, 7, 12, 5, 9, 1, 12]  # each row's completion is cut to this length: the passes differ in tokens
MATCHES = [("dapo", "token"), ("bnpo", "nanochat"), ("grpo", "sequence"), ("dr_grpo", "drgrpo")]
MISMATCHES = [("bnpo", "token"), ("dapo", "nanochat"), ("grpo", "token"), ("dr_grpo", "token")]
RTOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2"], name="batch")
def same_step_batch(request, tmp_path_factory):
    "The model folder, and the step's rows: prompts, completions and advantages, the same for both sides."
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_hf_model(request.param, folder, seed=3)
    model, tok = load_llama(folder), ChatTokenizer.from_directory(folder)
    prompts = [tok.render_for_completion(conv) for conv in gsm8k_chat_conversations(GROUPS, system_every=2)]
    seqs, _ = Engine(model, tok).generate_many(prompts, GROUP_SIZE, MAX_NEW, 1.0, None, seed=[11, 12])
    rows = []
    for r, seq in enumerate(seqs):
        prompt = prompts[r // GROUP_SIZE]
        rows.append((prompt, seq[len(prompt) :][: CUT[r]]))
    assert len({len(c) for _, c in rows}) > 3, "the completions must differ in length"
    advantages = torch.randn(len(rows), generator=torch.Generator().manual_seed(5))
    passes = [[0, 1, 4, 5], [2, 3, 6, 7]]  # two rows of each prompt per pass: TRL left-pads the shorter prompt
    return dict(folder=folder, rows=rows, advantages=advantages, passes=passes, pad=0)  # any pad: targets -1 there


def nanorl_step(batch, kind, old_from=None):
    """nanorl's loss of the whole step as its trainer computes it (one backward per pass), and the gradients.

    old_from(logp, mask, rows) -> old_logp switches on the ratio form; returns (loss, {name: grad})."""
    model = load_llama(batch["folder"])
    model.train()
    passes = []
    for rows in batch["passes"]:
        seqs = [batch["rows"][r][0] + batch["rows"][r][1] for r in rows]
        masks = [[0] * len(batch["rows"][r][0]) + [1] * len(batch["rows"][r][1]) for r in rows]
        passes.append((rows, *collate(seqs, masks, batch["pad"])))
    cfg = Config(loss_norm=kind, max_new_tokens=MAX_NEW, top_k=0)  # TRL: log_softmax(logits / T), every token
    norm = step_normalizer(cfg.loss_norm, [t for _, _, t in passes], cfg.max_new_tokens, torch.device("cpu"))
    if old_from is None:  # the trainer's own passes
        step = [Pass(inputs, targets, torch.tensor(rows), 0) for rows, inputs, targets in passes]
        total = backward_passes(Policy(model), step, batch["advantages"], cfg.sampling(), cfg.loss_settings(), norm)["loss"]
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}
    total = 0.0
    for rows, inputs, targets in passes:  # the ratio form, which the trainer never needs (its samples are fresh)
        mask = targets != -1
        logp = token_logp(model, inputs, targets)  # (b, T)
        old = old_from(logp.detach(), mask, rows)
        loss = pg_loss(logp, batch["advantages"][rows], mask, kind, norm, clip=(old, 0.2))
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def trl_trainer(batch, loss_type, tmp_path):
    "A GRPOTrainer on the same folder: 4 rows per micro-batch, 2 micro-batches per optimizer step, no KL."
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 autocast; nanorl computes in float32 on CPU
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=GROUP_SIZE,
        gradient_accumulation_steps=GROUPS,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW,
        loss_type=loss_type,
        beta=0.0,
        scale_rewards="none",
        epsilon=0.2,
    )
    data = Dataset.from_dict({"prompt": ["unused"] * GROUPS * GROUP_SIZE})
    trainer = GRPOTrainer(
        model=str(batch["folder"]),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=data,
    )
    trainer.current_gradient_accumulation_steps = GROUPS  # set by the training loop: micro-batches per step
    trainer.model.train()
    return trainer


def trl_inputs(batch, rows, num_items, pad_id, old=None):
    "The inputs dict of one micro-batch, as TRL's generation step builds it: prompts left-padded, completions right."
    prompts = [batch["rows"][r][0] for r in rows]
    completions = [batch["rows"][r][1] for r in rows]
    P, C = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad_id] * (C - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in completions])
    inputs = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=batch["advantages"][rows],
        num_items_in_batch=torch.tensor(num_items),
    )
    if old is not None:
        inputs["old_per_token_logps"] = old
    return inputs


def trl_step(batch, trainer, olds=None):
    "TRL's loss of the whole step (one backward per micro-batch) and its gradients."
    pad_id = trainer.processing_class.pad_token_id
    num_items = sum(len(c) for _, c in batch["rows"])  # every completion token of the generation batch
    total = 0.0
    for i, rows in enumerate(batch["passes"]):
        loss = trainer._compute_loss(trainer.model, trl_inputs(batch, rows, num_items, pad_id, olds and olds[i]))
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def to_completion_layout(batch, rows, x):
    "nanorl's (b, T) per-target tensor as TRL's (b, C): each row's completion tokens, right-padded with 0."
    C = max(len(batch["rows"][r][1]) for r in rows)
    out = torch.zeros(len(rows), C, dtype=x.dtype)
    for i, r in enumerate(rows):
        start, n = len(batch["rows"][r][0]) - 1, len(batch["rows"][r][1])  # target t predicts token t + 1
        out[i, :n] = x[i, start : start + n]
    return out


def grad_gap(ours, theirs):
    "Relative distance between two gradient dicts over the same parameter names."
    assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)
    diff = torch.cat([(ours[n] - theirs[n]).flatten() for n in ours]).norm()
    return (diff / torch.cat([theirs[n].flatten() for n in theirs]).norm()).item()


@pytest.mark.parametrize("loss_type, kind", MATCHES)
def test_on_policy_step_matches(batch, loss_type, kind, tmp_path):
    "Fresh samples, as both trainers run them: the same gradient, and the same value in nanorl's ratio form."
    trainer = trl_trainer(batch, loss_type, tmp_path)
    theirs, their_grads = trl_step(batch, trainer)
    _, our_grads = nanorl_step(batch, kind)  # REINFORCE: what nanorl's trainer optimizes
    ours, ratio_grads = nanorl_step(batch, kind, old_from=lambda logp, mask, rows: logp)
    assert ours == pytest.approx(theirs, rel=RTOL)
    assert grad_gap(our_grads, their_grads) < RTOL
    assert grad_gap(ratio_grads, their_grads) < RTOL


def test_clipped_ratio_matches(batch, tmp_path):
    "Samples from an older policy (log-probs moved by up to 0.6): PPO's clipped ratio, value and gradient agree."
    noise = torch.Generator().manual_seed(7)
    olds, clipped = [], []

    def older(logp, mask, rows):
        shift = torch.empty(logp.shape).uniform_(-0.6, 0.6, generator=noise) * mask
        olds.append(to_completion_layout(batch, rows, logp + shift))
        clipped.append(int((shift.abs() > 0.25).sum()))  # ratio outside [0.78, 1.28]: clipped on one side
        return logp + shift

    ours, our_grads = nanorl_step(batch, "token", old_from=older)
    assert sum(clipped) > 10, "the case must clip"
    trainer = trl_trainer(batch, "dapo", tmp_path)
    theirs, their_grads = trl_step(batch, trainer, olds=olds)
    assert ours == pytest.approx(theirs, rel=RTOL)
    assert grad_gap(our_grads, their_grads) < RTOL


@pytest.mark.parametrize("loss_type, kind", MISMATCHES)
def test_other_pairs_differ(batch, loss_type, kind, tmp_path):
    "The test has teeth: on this batch (passes of 29 and 32 tokens) the other pairings give other gradients."
    trainer = trl_trainer(batch, loss_type, tmp_path)
    _, their_grads = trl_step(batch, trainer)
    _, our_grads = nanorl_step(batch, kind)
    assert grad_gap(our_grads, their_grads) > 1e-2
