"Run by tests/test_evaluate.py under torchrun: distributed pass@k (gloo) vs one process, written to a JSON file."
import json, random, sys

import torch
import torch.distributed as dist

from nanorl.evaluate import evaluate_pass_at_k


class ToyTokenizer:
    def render_for_completion(self, conversation): return [conversation["difficulty"], conversation["answer"]]
    def decode(self, ids): return "".join(str(i) for i in ids)


class ToyTask:
    def __init__(self, size): self.size = size
    def __len__(self): return self.size
    def __getitem__(self, i): return {"difficulty": i % 10, "answer": i % 7}
    def evaluate(self, conversation, text): return text == str(conversation["answer"])


class ToyEngine:
    "Right with probability difficulty/10, drawn from (prompt seed, sample index) only, as the real engine promises."
    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        seeds = seed if isinstance(seed, list) else [seed] * len(prompts)
        seqs = []
        for prompt, s in zip(prompts, seeds):
            difficulty, answer = prompt
            for j in range(num_samples):
                right = random.Random(s * 1_000_003 + j).random() < difficulty / 10
                seqs.append(prompt + [answer if right else (answer + 1) % 7])
        return seqs, [[0, 0, 1] for _ in seqs]


def main(out_path):
    dist.init_process_group("gloo")
    args = dict(num_problems=37, num_samples=6, seed=3, ks=(1, 3, 6), progress=False)
    distributed = evaluate_pass_at_k(ToyEngine(), ToyTokenizer(), ToyTask(50), prompts_per_batch=4, **args)
    if dist.get_rank() == 0:
        single = evaluate_pass_at_k(ToyEngine(), ToyTokenizer(), ToyTask(50), prompts_per_batch=5,
                                    rank=0, world_size=1, **args)
        with open(out_path, "w") as f:
            json.dump({"world_size": dist.get_world_size(),
                       "distributed": distributed.outcomes.int().tolist(), "single": single.outcomes.int().tolist(),
                       "distributed_metrics": distributed.metrics(), "single_metrics": single.metrics()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
