"""A task whose reward a random-weight model can vary: used by the training tests (`--task toy_task:make_tasks`)."""
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


def make_tasks(cfg):
    "(train, held-out): the same toy task."
    return ToyTask(), ToyTask()
