"Rollout pieces beyond the notebook: seeds, scoring with reward shaping, passes and padding."

import pytest
import torch

from nanorl.rollout import problem_seed
from nanorl.rollout import Rollout, collate, completion_text, halve_after_oom, microbatches, sample_seeds
from nanorl.step import score


def test_sample_seeds_use_the_evaluation_mixer():
    "A step's problem seeds are problem_seed of the step's seed, and differ between steps and problems."
    assert sample_seeds(3, 5, [0, 9]) == [problem_seed(problem_seed(3, 5), 0), problem_seed(problem_seed(3, 5), 9)]
    seeds = {s for step in range(50) for s in sample_seeds(0, step, range(50))}
    assert len(seeds) == 2500 and all(0 <= s < 2**31 for s in seeds)


class Chars:
    "Tokens are character codes."

    def render_for_completion(self, conversation):
        return [ord(c) for c in conversation["q"]]

    def decode(self, ids):
        return "".join(map(chr, ids))


class ShapedTask:
    "Reward terms: correct when the completion is 'ok', plus a format bonus; counts how often it judges."

    shaping_on = True

    def __init__(self):
        self.judged = 0

    def __getitem__(self, i):
        return {"q": f"q{i}"}

    def reward_terms(self, conversation, completion):
        self.judged += 1
        return {"correct": float(completion == "ok"), "format": 0.5 * float(completion.islower())}

    def reward(self, conversation, completion):
        raise AssertionError("a shaped task is judged through reward_terms once")


def test_score_with_shaping_judges_each_completion_once():
    tok, task = Chars(), ShapedTask()
    prompts = [tok.render_for_completion(task[i]) for i in (0, 1)]
    rows = [prompts[0] + [ord(c) for c in s] for s in ("ok", "KO")] + [
        prompts[1] + [ord(c) for c in s] for s in ("ok", "ok")
    ]
    texts = [completion_text(tok, r, len(prompts[k // 2])) for k, r in enumerate(rows)]    # cut rows: every token
    batch = Rollout(prompts, rows, [[1] * len(r) for r in rows], cut=[True] * 4, tool_calls=0, rollout_rows=4,
                    conversations=[task[0], task[1]], texts=texts)
    assert texts == ["ok", "KO", "ok", "ok"]
    s = score(task, batch)
    assert task.judged == 4
    assert s.rewards.tolist() == [1.5, 0.0, 1.5, 1.5]
    assert s.terms == {"correct": 3.0, "format": 1.5}
    assert s.zero_signal.tolist() == [False, True]
    assert s.advantages.tolist() == [0.75, -0.75, 0.0, 0.0]


@pytest.mark.parametrize("groups, size, dbs", [(3, 4, 4), (2, 5, 2), (1, 16, 3), (4, 2, 8)])
def test_microbatches_cover_every_row_once_within_groups(groups, size, dbs):
    passes = microbatches(groups, size, dbs)
    assert sorted(r for p in passes for r in p) == list(range(groups * size))
    assert all(len(p) <= dbs and len({r // size for r in p}) == 1 for p in passes)


def test_collate_pads_and_masks():
    inputs, targets = collate([[1, 2, 3, 4, 5], [1, 2]], [[0, 1, 1, 0, 1], [0, 1]], pad_id=9)
    assert inputs.tolist() == [[1, 2, 3, 4], [1, 2, 9, 9]]
    assert targets.tolist() == [[2, 3, -1, 5], [2, -1, -1, -1]]


def test_halve_after_oom_names_the_flags():
    err = torch.OutOfMemoryError("simulated")
    assert halve_after_oom(8, 4, err) == 4
    with pytest.raises(torch.OutOfMemoryError, match="in an evaluation; lower --eval-samples"):
        halve_after_oom(1, 4, err, "an evaluation", "--eval-samples or --eval-max-new-tokens")


def test_score_and_learn_refuse_a_rollout_without_its_records():
    "A Rollout built by hand without its texts, conversations or sampling: one line naming what is missing."
    from nanorl.step import LossSettings, Policy, Scores, learn

    batch = Rollout([[0]], [[0, 1], [0, 2]], [[0, 1], [0, 1]], cut=[True, True], tool_calls=0, rollout_rows=2)
    with pytest.raises(ValueError, match="conversations and texts"):
        score(ShapedTask(), batch)
    none = torch.zeros(2)
    scores = Scores(none, none, torch.zeros(1, dtype=torch.bool), {}, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="sampling"):
        learn(Policy(torch.nn.Linear(1, 1)), batch, scores, LossSettings())
