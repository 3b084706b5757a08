"""Tasks a random-weight model can vary the reward of, for the training tests (`--task toy_task:make_tasks`)."""
import json
from pathlib import Path

ROWS = [json.loads(l) for l in (Path(__file__).parent / "fixtures" / "gsm8k" / "train.jsonl").read_text().splitlines()]


class ToyTask:
    "GSM8K questions; a completion earns 1 when its length in characters is a multiple of 3."
    def __len__(self): return len(ROWS)
    def __getitem__(self, i):
        return {"messages": [{"role": "user", "content": ROWS[i]["question"]}, {"role": "assistant", "content": ROWS[i]["answer"]}]}
    def evaluate(self, conversation, completion): return len(completion) % 3 == 0
    def reward(self, conversation, completion): return float(self.evaluate(conversation, completion))


class NanToyTask(ToyTask):
    "The toy task, but the reward of the problems in `nan_problems` (all when None) is nan: a broken reward function."
    def __init__(self, nan_problems=None):
        self.nan_questions = None if nan_problems is None else {ROWS[i]["question"] for i in nan_problems}
    def reward(self, conversation, completion):
        q = conversation["messages"][0]["content"]
        return float("nan") if self.nan_questions is None or q in self.nan_questions else super().reward(conversation, completion)


def make_tasks(cfg):
    "(train, held-out): the same toy task."
    return ToyTask(), ToyTask()


def make_nan_step1_tasks(cfg):
    "Problems 2 and 3 (step 1 at 2 examples per step) have a nan reward."
    return NanToyTask({2, 3}), ToyTask()


def make_all_nan_tasks(cfg):
    "Every reward is nan."
    return NanToyTask(), ToyTask()


class ZeroToyTask(ToyTask):
    "The toy task with every reward 0: every group has no signal."
    def reward(self, conversation, completion): return 0.0


def make_zero_tasks(cfg):
    "Every reward is 0."
    return ZeroToyTask(), ToyTask()


class SplitToyTask:
    "The protocol's minimum, built per split as `--task toy_task:SplitToyTask` does: no evaluate, 1 for an 'ok'."
    def __init__(self, split="train"): self.rows = ROWS[:8] if split == "train" else ROWS[8:12]
    def __len__(self): return len(self.rows)
    def __getitem__(self, i):
        question = self.rows[i]["question"]
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "ok"}]}
    def reward(self, conversation, completion): return float(completion.strip() == "ok")


class NoRewardTask(SplitToyTask):
    "Misses the protocol's reward."
    reward = None
