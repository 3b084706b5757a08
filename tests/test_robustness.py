"""Runs that refuse what would destroy or mislead: the demo's folder, one writer per run directory, a resume that
continues the run it names, numbers checked before any work, no broken checkpoint, checksums, and named errors."""

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from doubles import FIXTURES, save_tiny_hf_model
from nanorl.checkpoint import CheckpointError, load_checkpoint, load_model, release_run_dir
from nanorl.demo import DEMO_MARK, claim_dir, record_files
from nanorl.demo import main as demo_main
from nanorl.real import main as real_main
from nanorl.real import real_parser
from nanorl.train import Config, NonFiniteError, main, sync_and_step, train, validate

DEMO_SFT = dict(device_type="cpu", model_tag="d3", task="arithmetic", examples_per_step=4, num_samples=4,
                device_batch_size=4, max_new_tokens=32, temperature=1.0, top_k=0, eval_every=100, eval_examples=8,
                eval_samples=2, save_every=1, num_steps=2, seed=3)


def flags(**settings):
    "Command-line words of `settings`."
    return [w for k, v in settings.items() for w in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture
def base(tmp_path):
    "A copy of the demo's SFT base directory (tokenizer/ and chatsft_checkpoints/d3/)."
    shutil.copytree(FIXTURES / "demo_sft", tmp_path / "base")
    return tmp_path / "base"


def run_main(argv, entry=main) -> str:
    "The message an entry point exits with (it must exit with one)."
    with pytest.raises(SystemExit) as e:
        entry(argv)
    return str(e.value.code)


def tree(d):
    "Every file under `d` with its bytes."
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- 1. never delete what a run did not write


def test_demo_refuses_a_folder_it_did_not_write(base):
    "A nanochat base directory (and a user's file in it) survives `nanorl.demo --output-dir` untouched."
    (base / "tokenizer" / "my_notes.txt").write_text("mine")
    before = tree(base)
    msg = run_main(["--output-dir", str(base), "--num-steps", "2"], demo_main)
    assert "holds files the demo did not write" in msg and str(base) in msg
    assert tree(base) == before


def test_demo_replaces_only_its_own_files(tmp_path):
    "An earlier demo's files are removed; a file added since makes it refuse, deleting nothing."
    out = tmp_path / "demo"
    claim_dir(out)
    (out / "chatsft_checkpoints" / "d3").mkdir(parents=True)
    (out / "chatsft_checkpoints" / "d3" / "model_000010.pt").write_bytes(b"weights")
    (out / "rl_curves.png").write_bytes(b"png")
    record_files(out)
    (out / "chatsft_checkpoints" / "d3" / "yours.txt").write_text("a user's file")
    with pytest.raises(ValueError, match="yours.txt"):
        claim_dir(out)
    assert (out / "rl_curves.png").exists()                       # nothing deleted
    (out / "chatsft_checkpoints" / "d3" / "yours.txt").unlink()
    claim_dir(out)
    assert sorted(p.name for p in out.rglob("*")) == sorted([DEMO_MARK, ".lock"])
    release_run_dir(out)


def test_demo_threads_checked():
    assert "threads must be >= 0" in run_main(["--threads", "-1"], demo_main)


# ---------------------------------------------------------------- 2. one writer per run directory


def hold_lock(run_dir):
    "A process that holds `run_dir`'s lock until killed."
    code = f"from nanorl.checkpoint import lock_run_dir; lock_run_dir({str(run_dir)!r}); print('held', flush=True); " \
           "import time; time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_run_on_a_directory_stops_at_once(base, tmp_path):
    "While another process writes the run directory, a run there fails before any step; once it dies, a run goes."
    out = tmp_path / "out"
    holder = hold_lock(out / "chatrl_checkpoints" / "d3")
    try:
        t0 = time.perf_counter()
        msg = run_main(flags(**DEMO_SFT, base_dir=base, output_dir=out))
        assert "is in use by another run (pid" in msg and time.perf_counter() - t0 < 60
        assert not (out / "chatrl_checkpoints" / "d3" / "metrics.jsonl").exists()
    finally:
        holder.kill()                                              # SIGKILL: the kernel drops the lock
        holder.wait()
    records = train(Config(**DEMO_SFT, base_dir=str(base), output_dir=str(out)))
    assert [r["step"] for r in records] == [0, 1]


# ---------------------------------------------------------------- 3. a resume continues the run that was started


def test_resume_refuses_changed_settings_and_applies_allowed_ones(base, tmp_path):
    "--resume with another seed or step count fails naming both values; --allow-changes applies new rates."
    out = tmp_path / "out"
    run = dict(DEMO_SFT, base_dir=base, output_dir=out, num_steps=4, save_every=2)
    first = train(Config(**{**run, "num_steps": 4, "base_dir": str(base), "output_dir": str(out)}))
    d = out / "chatrl_checkpoints" / "d3"
    for name in ("model_000003.pt", "meta_000003.json", "optim_000003_rank0.pt", "resume_000003_rank0.pt",
                 "manifest_000003_rank0.json"):
        (d / name).unlink()                                         # back to step 2: step 3 is to be redone
    msg = run_main(flags(**{**run, "seed": 4}, resume=True))
    assert "--seed 3 -> 4" in msg and "--allow-changes" in msg
    assert "--num-steps 4 -> 6" in run_main(flags(**{**run, "num_steps": 6}, resume=True))
    halved = {k: getattr(Config, k) * 0.5 for k in ("embedding_lr", "unembedding_lr", "matrix_lr")}
    main(flags(**run, **halved, resume=True, allow_changes=True))
    again = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    assert again[3]["lr"] == pytest.approx(0.5 * first[3]["lr"], rel=1e-12)   # the new rates, at the same lrm


def test_corrupt_metrics_line_is_left_out_on_resume(base, tmp_path):
    out = tmp_path / "out"
    cfg = Config(**{**DEMO_SFT, "base_dir": str(base), "output_dir": str(out), "num_steps": 3, "save_every": 1})
    train(cfg)
    d = out / "chatrl_checkpoints" / "d3"
    for name in ("model_000002.pt", "meta_000002.json", "optim_000002_rank0.pt", "resume_000002_rank0.pt",
                 "manifest_000002_rank0.json"):
        (d / name).unlink()
    lines = (d / "metrics.jsonl").read_text().splitlines()
    (d / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:20] + "\n" + lines[2] + "\n")
    with pytest.warns(UserWarning, match="line 2 is not JSON"):
        records = train(Config(**{**vars(cfg), "resume": True}))
    assert [r["step"] for r in records] == [0, 2]


# ---------------------------------------------------------------- 4. every number checked before any work


@pytest.mark.parametrize("changes, fragment", [
    (dict(matrix_lr=-5.0), "--matrix-lr -5.0"),
    (dict(matrix_lr=-1.0, embedding_lr=-1.0, unembedding_lr=-1.0),
     "--embedding-lr -1.0, --unembedding-lr -1.0, --matrix-lr -1.0"),
    (dict(matrix_lr=float("nan")), "--matrix-lr must be a finite number"),
    (dict(init_lr_frac=float("inf")), "--init-lr-frac must be a finite number"),
    (dict(weight_decay=-0.1), "--weight-decay -0.1"),
    (dict(device_batch_size=3, num_samples=4), "--device-batch-size 3 must divide --num-samples 4"),
    (dict(num_steps=0), "--num-steps must be >= 1"),
])
def test_bad_numbers_named(changes, fragment):
    with pytest.raises(ValueError) as e:
        validate(Config(**{**DEMO_SFT, **changes}))
    assert fragment in str(e.value)


def test_zero_rate_freezes_with_a_warning():
    with pytest.warns(UserWarning, match="--matrix-lr 0: those weights stay frozen"):
        validate(Config(**{**DEMO_SFT, "matrix_lr": 0.0}))


def test_max_new_tokens_checked_against_the_longest_prompt(base):
    "A token limit the model cannot hold beside the longest prompt fails before the first step, naming the flag."
    msg = run_main(flags(**{**DEMO_SFT, "max_new_tokens": 1270}, base_dir=base, output_dir=base / "o"))
    assert "--max-new-tokens 1270" in msg and "lower --max-new-tokens to at most" in msg
    assert not (base / "o" / "chatrl_checkpoints" / "d3" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- 5. never save a broken state


def test_update_that_breaks_the_weights_stops_before_saving():
    "Finite gradients, a rate that makes the weights non-finite: the step raises instead of carrying on."
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    for g in opt.param_groups:
        g["initial_lr"] = float("inf")
    lin(torch.ones(1, 3)).sum().backward()
    with pytest.raises(NonFiniteError, match="non-finite"):
        sync_and_step(lin, opt, 1.0, world_size=1)


def test_failed_checkpoint_write_is_named(base, tmp_path, monkeypatch):
    "A full disk at the first checkpoint: a message naming the step and folder, not a raw torch error."
    import nanorl.checkpoint as ckpt

    def full(obj, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "atomic_save", full)
    msg = run_main(flags(**DEMO_SFT, base_dir=base, output_dir=tmp_path / "out"))
    assert "writing the checkpoint of step 1" in msg and "No space left" in msg and "starts afresh" in msg


# ---------------------------------------------------------------- 6. checksums


def test_flipped_bits_in_a_checkpoint_are_named(base, tmp_path):
    out = tmp_path / "out"
    train(Config(**{**DEMO_SFT, "base_dir": str(base), "output_dir": str(out), "num_steps": 1}))
    d = out / "chatrl_checkpoints" / "d3"
    raw = bytearray((d / "model_000000.pt").read_bytes())
    for i in range(1000):
        raw[len(raw) // 3 + 7 * i] ^= 1 << (i % 8)
    (d / "model_000000.pt").write_bytes(raw)
    with pytest.raises(CheckpointError, match="model_000000.pt differs from what was written"):
        load_checkpoint(d, 0)
    with pytest.raises(CheckpointError, match="model_000000.pt differs"):
        load_model(d, "cpu")


# ---------------------------------------------------------------- named errors for bad files and tasks


def test_gsm8k_bad_lines_named(tmp_path):
    good = (FIXTURES / "gsm8k" / "train.jsonl").read_text().splitlines()[:3]
    cases = {"not JSON": [good[0], good[1], "{oops"], "not UTF-8": None, "a JSON list": [good[0], "[1, 2]"]}
    for why, lines in cases.items():
        d = tmp_path / why.replace(" ", "_")
        d.mkdir()
        for split in ("train", "test"):
            path = d / f"{split}.jsonl"
            path.write_bytes(b"\xff\xfe{" if lines is None else "\n".join(lines).encode())
        msg = run_main(["--task", "gsm8k", "--data-dir", str(d), "--base-dir", str(d)])
        assert str(d / "train.jsonl") in msg and why in msg, msg
        if why == "not JSON":
            assert "line 3" in msg


@pytest.mark.parametrize("task, fragment", [
    ("nosuchmod:Task", "No module named 'nosuchmod'"),
    ("doubles:NoSuchTask", "has no attribute 'NoSuchTask'"),
    ("test_robustness:returns_none", "returned NoneType, not (training task, held-out task)"),
    ("test_robustness:returns_one", "returned LengthTask"),
    ("test_robustness:returns_lists", "lacks reward"),
])
def test_task_errors_named(task, fragment, base):
    msg = run_main(flags(**{**DEMO_SFT, "task": task}, base_dir=base))
    assert f"--task {task}" in msg and fragment in msg, msg


def returns_none(cfg):
    return None


def returns_one(cfg):
    from doubles import LengthTask
    return LengthTask()


def returns_lists(cfg):
    return [1, 2], [3]


class TextReward:
    "A task whose reward is a string."
    def __init__(self):
        from doubles import LengthTask
        self.inner = LengthTask()

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]

    def reward(self, conversation, completion):
        return "1"


def text_reward(cfg):
    return TextReward(), TextReward()


def test_reward_that_is_not_a_number(base, tmp_path):
    msg = run_main(flags(**{**DEMO_SFT, "task": "test_robustness:text_reward"}, base_dir=base,
                         output_dir=tmp_path / "o"))
    assert "TextReward.reward returned '1' (str)" in msg


def test_bad_meta_and_truncated_files_named(base, tmp_path):
    d = base / "chatsft_checkpoints" / "d3"
    meta_path = next(d.glob("meta_*.json"))
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["vocab_size"] = "512"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="meta_.*vocab_size"):
        load_model(d, "cpu")
    meta["model_config"]["vocab_size"] = int(meta["model_config"]["vocab_size"])
    meta_path.write_text(json.dumps(meta))
    for name in ("tokenizer.pkl", "tokenizer.json"):                 # whichever the loader reads: cut short
        path = base / "tokenizer" / name
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        load_model(d, "cpu")
    hf = tmp_path / "qwen2"
    save_tiny_hf_model("qwen2", hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(hf, "cpu")


def test_real_checks_numbers_and_offers_resume(tmp_path):
    hf = tmp_path / "qwen2"
    save_tiny_hf_model("qwen2", hf)
    msg = run_main(["--model-path", str(hf), "--num-steps", "0", "--output-dir", str(tmp_path / "r")], real_main)
    assert "--num-steps must be >= 1" in msg
    assert "--threads must be >= 1" in run_main(["--model-path", str(hf), "--threads", "0"], real_main)
    assert "--resume" in [a.option_strings[0] for a in real_parser()._actions]
