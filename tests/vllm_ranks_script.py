"""Run by tests/test_vllm.py under torchrun: each rank its own in-process vLLM, inside the trainer's gloo group.

`torchrun --nproc_per_node=2 vllm_ranks_script.py FOLDER OUT`: rank r samples greedily from prompt r with vLLM and
with nanorl's engine; the ranks' results are gathered after the engines close, and rank 0 writes them to OUT.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from doubles import gsm8k_chat_conversations  # noqa: E402
from nanorl.checkpoint import load_model  # noqa: E402
from nanorl.engine import Engine  # noqa: E402
from nanorl.vllm_engine import VLLMEngine  # noqa: E402


def main(folder, out):
    dist.init_process_group("gloo")  # the trainer's group, made before vLLM starts
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tok, _ = load_model(folder, "cpu")
    prompt = tok.render_for_completion(gsm8k_chat_conversations(world)[rank])
    engine = VLLMEngine(folder, kv_cache_bytes=64 << 20)
    greedy = dict(num_samples=1, max_tokens=12, temperature=0.0)
    theirs, _ = engine.generate_many([prompt], **greedy)
    ours, _ = Engine(model.eval(), tok).generate_many([prompt], **greedy)
    from vllm.distributed import parallel_state

    vllm_world = parallel_state.get_world_group().world_size
    engine.close()
    results = [None] * world
    dist.all_gather_object(results, dict(rank=rank, equal=theirs == ours, completion=theirs[0][len(prompt) :],
                                         vllm_world=vllm_world, joined=engine.joined_group))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # the trainer's group still works after vLLM closed
    if rank == 0:
        Path(out).write_text(json.dumps(dict(results=results, total=total.item(), world=world)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
