"Run by tests/test_fsdp.py under torchrun: what one rank holds with DDP or FSDP, as JSON (quoted in `14_scale`)."

import json, sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanorl.model import GPT, GPTConfig
from nanorl.scale import gathered, held_bytes, memory_per_rank, peak_memory, reset_peak_memory, shard_model, shard_units
from nanorl.step import Policy, update
from nanorl.config import Config
from nanorl.start import build_optimizer

SHAPE = GPTConfig(sequence_len=128, vocab_size=16384, n_layer=4, n_head=2, n_kv_head=2, n_embd=256)  # 20M parameters


def train_step(model, optimizer, ids, world):
    "One forward, backward and update on `ids` (B, T); returns the bytes held after the backward, before the update."
    model(ids[:, :-1], targets=ids[:, 1:]).backward()
    held = held_bytes(model, optimizer)
    update(Policy(model, world_size=world), optimizer)
    return held


def resident_bytes():
    "This process's resident set now (Linux)."
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:"))


def main(mode, out_dir):
    dist.init_process_group("gloo")
    rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    reset_peak_memory(device)
    baseline = resident_bytes()  # the interpreter, torch and gloo, before any model
    torch.manual_seed(0)
    model = GPT(SHAPE)
    size = lambda m: sum(p.numel() for p in m.parameters())
    params, units = size(model), [size(u) for u in shard_units(model)]
    muon = sum(p.numel() for n, p in model.named_parameters() if n.startswith("transformer.h."))
    if mode == "fsdp":
        shard_model(model, device, torch.float32)
    optimizer = build_optimizer(model, Config())
    ids = torch.randint(0, SHAPE.vocab_size, (4, 65), generator=torch.Generator().manual_seed(rank))  # (B, T + 1)
    train_step(model, optimizer, ids, world)  # the optimizer state exists from here on
    reset_peak_memory(device)
    with gathered(model), torch.no_grad():
        model(ids[:, :-1])  # the rollout phase: whole weights
    peak_rollout = peak_memory(device)
    reset_peak_memory(device)
    held = train_step(model, optimizer, ids, world)
    peak_train = peak_memory(device)
    held["optimizer"] = held_bytes(model, optimizer)["optimizer"]
    formula = memory_per_rank(params, world, mode == "fsdp", muon, max(units + [params - sum(units)]))
    record = dict(
        held=held,
        formula=formula,
        params=params,
        baseline=baseline,
        peak_rollout=peak_rollout - baseline,
        peak_train=peak_train - baseline,
    )
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
