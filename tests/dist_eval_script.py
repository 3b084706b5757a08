"Run by tests/test_evaluate.py under torchrun: distributed pass@k (gloo) vs one process, written to a JSON file."

import json, sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanorl.evaluate import PassAtK, evaluate_pass_at_k
from nanorl.rollout import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doubles import ToyEngine, ToyTask, ToyTokenizer  # noqa: E402


def main(out_path):
    dist.init_process_group("gloo")
    args = dict(num_problems=37, seed=3)
    six = Sampling(num_samples=6)
    distributed = evaluate_pass_at_k(ToyEngine(), ToyTokenizer(), ToyTask(50), six, prompts_per_batch=4, **args)
    distributed = PassAtK(distributed.outcomes, ks=(1, 3, 6))
    if dist.get_rank() == 0:
        single = evaluate_pass_at_k(
            ToyEngine(), ToyTokenizer(), ToyTask(50), six, prompts_per_batch=5, shard=(0, 1), **args
        )
        single = PassAtK(single.outcomes, ks=(1, 3, 6))
        with open(out_path, "w") as f:
            json.dump(
                {
                    "world_size": dist.get_world_size(),
                    "distributed": distributed.outcomes.int().tolist(),
                    "single": single.outcomes.int().tolist(),
                    "distributed_metrics": distributed.metrics(),
                    "single_metrics": single.metrics(),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
