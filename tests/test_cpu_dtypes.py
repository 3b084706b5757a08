"The hot paths run in dtypes this CPU multiplies natively: no bf16 matmul where bf16 is emulated."

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanorl.speedups import use_fast_paths
import nanorl.optim as M
from nanorl.engine import Engine
from nanorl.tokenizer import Tokenizer
from test_model import FIX, fixture_model

MATMUL_WORDS = ("mm", "linear", "matmul", "attention", "dot", "conv")


class MatmulDtypes(TorchDispatchMode):
    "Records the dtype of every matrix-product op that runs inside it."

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if any(w in name for w in MATMUL_WORDS):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors:
                self.seen.add((name, tensors[0].dtype))
        return func(*args, **(kwargs or {}))


def hot_path_dtypes():
    "Matmul dtypes of one training step (forward, backward, Muon + AdamW step) and one sampled generation."
    torch.manual_seed(0)
    model = use_fast_paths(fixture_model("head").train())  # as the trainer runs on a CPU: the fast paths on
    opt = model.setup_optimizers()
    x = torch.randint(0, model.config.vocab_size, (2, 17))
    engine = Engine(model, Tokenizer.from_directory(FIX / "tokenizer"))
    M.fast_matmul_dtype("cpu")  # its one-time measurement multiplies in both dtypes: not part of the step
    with MatmulDtypes() as mode:
        model(x[:, :-1], targets=x[:, 1:]).backward()
        opt.step()
        with torch.no_grad():
            engine.generate_batch(x[0, :8].tolist(), num_samples=4, max_tokens=8, seed=0)
    return mode.seen


def emulated(fast):
    "The low-precision dtypes slower than float32 on a machine whose fastest matmul dtype is `fast`."
    return {torch.bfloat16, torch.float16} - {fast}


def test_no_emulated_dtype_on_this_cpu():
    seen = hot_path_dtypes()
    assert seen, "no matrix product was recorded"
    slow = [(op, dt) for op, dt in seen if dt in emulated(M.fast_matmul_dtype("cpu"))]
    assert not slow, f"matmuls in a dtype this CPU emulates: {slow}"


def test_no_bf16_where_bf16_is_emulated(monkeypatch):
    "On a CPU without native bf16 (simulated here on any CPU), Muon's Newton-Schulz runs in float32."
    monkeypatch.setattr(M, "fast_matmul_dtype", lambda device_type: torch.float32)
    seen = hot_path_dtypes()
    assert {dt for _, dt in seen} == {torch.float32}, sorted(map(str, seen))


def test_bf16_where_it_is_fast(monkeypatch):
    "Where bf16 is native, Newton-Schulz uses it (as torch's and nanochat's Muon), and the rest stays float32."
    monkeypatch.setattr(M, "fast_matmul_dtype", lambda device_type: torch.bfloat16)
    seen = hot_path_dtypes()
    assert {op for op, dt in seen if dt == torch.bfloat16} == {"aten::mm", "aten::addmm"}, sorted(map(str, seen))
