"""Runs that refuse what would destroy or mislead: the demo's folder, one writer per run directory, a resume that
continues the run it names, numbers checked before any work, no broken checkpoint, checksums, and named errors."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from doubles import FIXTURES, save_tiny_hf_model
from nanorl.checkpoint import CheckpointError, atomic_save, load_checkpoint, load_model
from nanorl.rundir import open_run_file, release_run_dir
from nanorl.demo import DEMO_MARK, claim_dir, record_files
from nanorl.demo import main as demo_main
from nanorl.real import main as real_main
from nanorl.real import real_parser
from nanorl.rewards import TaskView
from nanorl.tasks import GSM8K
from nanorl.step import Policy, update
from nanorl.train import Config, NonFiniteError, main, train, validate

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


@pytest.mark.parametrize("listed", ["../victim.txt", "absolute", "link/victim.txt"])
def test_demo_deletes_nothing_outside_its_folder(tmp_path, listed):
    "A mark listing `../victim`, an absolute path or a file behind a linked folder: one line naming it; nothing gone."
    victim, out = tmp_path / "victim.txt", tmp_path / "demo"
    victim.write_text("precious")
    out.mkdir()
    (out / "link").symlink_to(tmp_path)
    name = str(victim) if listed == "absolute" else listed
    (out / DEMO_MARK).write_text(json.dumps({"files": [name]}))
    msg = run_main(["--output-dir", str(out), "--num-steps", "2"], demo_main)
    assert f"{out / DEMO_MARK} lists {name!r}, which is not a file inside {out}" in msg and "\n" not in msg, msg
    assert victim.read_text() == "precious" and not (out / ".lock").exists()


@pytest.mark.parametrize("content, fragment", [("{oops", "not JSON"), ("[1, 2]", "found a JSON list"),
                                               ('{"other": 1}', "found keys ['other']"),
                                               ('{"files": "a.txt"}', "'files' lists names")])
def test_demo_mark_that_is_not_its_own_is_named(tmp_path, content, fragment):
    "A mark that is not JSON, a list, or lacks `files`: one line naming it, no traceback, the folder as it was."
    out = tmp_path / "demo"
    out.mkdir()
    (out / DEMO_MARK).write_text(content)
    msg = run_main(["--output-dir", str(out), "--num-steps", "2"], demo_main)
    assert f"{out / DEMO_MARK} is not the demo's mark" in msg and fragment in msg and "\n" not in msg, msg
    assert sorted(p.name for p in out.iterdir()) == [DEMO_MARK]


def test_demo_threads_checked():
    assert "threads must be >= 0" in run_main(["--threads", "-1"], demo_main)


@pytest.mark.parametrize("argv, fragment", [
    (["--threads", "1000000000"], "--threads 1000000000 is far more than the"),    # torch's pool: an abort
    (["--seed", str(10**30)], "seed must be in [-2**63, 2**64)"),                  # torch: "Overflow when unpacking"
])
def test_demo_numbers_torch_cannot_take_are_named(tmp_path, argv, fragment):
    msg = run_main([*argv, "--output-dir", str(tmp_path / "d"), "--num-steps", "2"], demo_main)
    assert fragment in msg and "\n" not in msg and not (tmp_path / "d").exists(), msg


# ---------------------------------------------------------------- 2. one writer per run directory


def hold_lock(run_dir):
    "A process that holds `run_dir`'s lock until killed."
    code = f"from nanorl.rundir import lock_run_dir; lock_run_dir({str(run_dir)!r}); print('held', flush=True); " \
           "import time; time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_demo_on_a_folder_names_only_its_own_flag(tmp_path):
    "The demo has no --model-tag, so its in-use message offers --output-dir alone; the trainer's offers both."
    out = tmp_path / "demo"
    holder = hold_lock(out)
    try:
        msg = run_main(["--output-dir", str(out), "--num-steps", "2"], demo_main)
        assert "is in use by another run (pid" in msg and "--output-dir" in msg and "--model-tag" not in msg, msg
    finally:
        holder.kill()
        holder.wait()


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
        update(Policy(lin), opt)


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


def long_question_data(tmp_path):
    "GSM8K files whose train split has one 5 MB question, on line 3 (after a blank line)."
    good = (FIXTURES / "gsm8k" / "train.jsonl").read_text().splitlines()[:5]
    row = json.loads(good[1])
    row["question"] = "How many apples? " * 300_000
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "train.jsonl").write_text("\n".join([good[0], "", json.dumps(row), *good[2:]]) + "\n")
    (d / "test.jsonl").write_text("\n".join(good) + "\n")
    return d


def test_gsm8k_problem_names_its_file_and_line(tmp_path):
    d = long_question_data(tmp_path)
    task = GSM8K(split="train", data_dir=d, seed=0)
    i = next(i for i in range(len(task)) if len(task[i]["messages"][0]["content"]) > 10**6)
    assert task.where(i) == f"{d / 'train.jsonl'}, line 3"
    assert GSM8K.from_rows(task.rows, seed=None).where(2) == "rows, row 3"


def test_one_overlong_question_is_named(base, tmp_path):
    "A 5 MB question: the run names its file and line as too long, not '--max-new-tokens at most -N'."
    d = long_question_data(tmp_path)
    msg = run_main(flags(**{**DEMO_SFT, "task": "gsm8k", "eval_examples": 4}, data_dir=d, base_dir=base,
                         output_dir=tmp_path / "o"))
    assert f"{d / 'train.jsonl'}, line 3" in msg and "at most -" not in msg and "\n" not in msg, msg


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



def test_real_accepts_every_flag_its_messages_advise(tmp_path):
    "nanorl.real's refusals advise --resume, --model-tag and --allow-changes: each is a flag of its own, and works."
    hf, out = tmp_path / "qwen2", tmp_path / "r"
    save_tiny_hf_model("qwen2", hf)
    run = ["--model-path", str(hf), "--num-steps", "1", "--eval-examples", "2", "--threads", "1",
           "--output-dir", str(out)]
    real_main(run)
    own = {s for a in real_parser()._actions for s in a.option_strings}
    again = run_main(run, real_main)                                   # a run is there: resume it, or another tag
    changed = run_main([*run, "--resume", "--lr", "1e-4"], real_main)  # its settings changed: --allow-changes
    assert "--model-tag" in again and "--allow-changes" in changed
    for msg in (again, changed):
        advised = set(re.findall(r"--[a-z][a-z-]*", msg))
        assert advised <= own and "\n" not in msg, (advised - own, msg)
    real_main([*run, "--resume", "--lr", "1e-4", "--allow-changes"])
    real_main([*run, "--model-tag", "other"])
    assert (out / "chatrl_checkpoints" / "other" / "metrics.jsonl").is_file()

# ---------------------------------------------------------------- 7. a run's files: never through a link, never half


def linked_run_file(tmp_path, name):
    "A run directory whose `name` is a symbolic link to a victim file outside it: (output dir, run dir, victim)."
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    d = out / "chatrl_checkpoints" / "d3"
    d.mkdir(parents=True)
    victim.write_text("precious\n")
    (d / name).symlink_to(victim)
    return out, d, victim


def test_lock_that_is_a_link_or_a_fifo_is_refused_by_name(base, tmp_path):
    "A `.lock` that links to another file, or is a FIFO: one line naming it, and the linked file untouched."
    out, d, victim = linked_run_file(tmp_path, ".lock")
    msg = run_main(flags(**DEMO_SFT, base_dir=base, output_dir=out))
    assert f"{d / '.lock'} is a symbolic link" in msg and "\n" not in msg, msg
    assert victim.read_text() == "precious\n" and not (d / "metrics.jsonl").exists()
    (d / ".lock").unlink()
    os.mkfifo(d / ".lock")
    msg = run_main(flags(**DEMO_SFT, base_dir=base, output_dir=out))
    assert f"{d / '.lock'} is a FIFO" in msg and "\n" not in msg, msg


def test_open_run_file_never_follows_a_link(tmp_path):
    "Every mode refuses a link (its target untouched) and a FIFO (at once); a file is truncated or appended to."
    victim, link, fifo, f = tmp_path / "victim", tmp_path / "link", tmp_path / "fifo", tmp_path / "f"
    victim.write_text("precious\n")
    link.symlink_to(victim)
    os.mkfifo(fifo)
    for mode in ("r", "w", "a", "a+", "wb"):
        with pytest.raises(ValueError, match=f"{link} is a symbolic link"):
            open_run_file(link, mode)
        with pytest.raises(ValueError, match=f"{fifo} is a FIFO"):
            open_run_file(fifo, mode)
    assert victim.read_text() == "precious\n"
    with open_run_file(f, "w") as h:
        h.write("one\n")
    with open_run_file(f, "a") as h:
        h.write("two\n")
    with open_run_file(f, "w") as h:
        h.write("three\n")
    with open_run_file(f) as h:
        assert h.read() == "three\n"


def test_metrics_file_that_is_a_link_is_refused(base, tmp_path):
    "metrics.jsonl linking elsewhere: refused by name on a fresh run and on --resume; the linked file untouched."
    out, d, victim = linked_run_file(tmp_path, "metrics.jsonl")
    msg = run_main(flags(**DEMO_SFT, base_dir=base, output_dir=out))
    assert f"{d / 'metrics.jsonl'} is a symbolic link" in msg and victim.read_text() == "precious\n", msg
    (d / "metrics.jsonl").unlink()
    main(flags(**DEMO_SFT, base_dir=base, output_dir=out))
    (d / "metrics.jsonl").unlink()
    (d / "metrics.jsonl").symlink_to(victim)
    msg = run_main(flags(**DEMO_SFT, base_dir=base, output_dir=out, resume=True))
    assert f"{d / 'metrics.jsonl'} is a symbolic link" in msg and victim.read_text() == "precious\n", msg


@pytest.fixture
def small_disk(tmp_path):
    "A real tmpfs of 16 MiB (mounting needs root; skipped where it cannot be mounted)."
    d = tmp_path / "disk"
    d.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command here to make a size-limited tmpfs")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {p.stderr.strip() or 'mount failed'}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def fill_disk(path, leave=100_000):
    "Fill the disk under `path` to `leave` free bytes with one file."
    st = os.statvfs(path)
    with open(Path(path) / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


class DiskFiller(TaskView):
    "The demo's problems; the first reward fills the disk of the run's output folder (another program's big file)."
    where = None

    def reward(self, conversation, completion):
        if DiskFiller.where is not None:
            fill_disk(DiskFiller.where)
            DiskFiller.where = None
        return self.task.reward(conversation, completion)


def filling_tasks(cfg):
    from nanorl.start import make_tasks
    train_task, held_out = make_tasks(Config(**{**vars(cfg), "task": "arithmetic"}))
    return DiskFiller(train_task), held_out


def test_full_disk_at_a_checkpoint_is_named_and_leaves_nothing_half_written(base, small_disk):
    "A real full disk once the run is under way: the step, folder and file named in one line; no temporary file."
    DiskFiller.where = small_disk
    msg = run_main(flags(**{**DEMO_SFT, "task": "test_robustness:filling_tasks"}, base_dir=base,
                         output_dir=small_disk))
    assert "writing the checkpoint of step 1" in msg and "No space left on device" in msg, msg
    assert ".pt'" in msg and "starts afresh" in msg and "\n" not in msg, msg
    d = small_disk / "chatrl_checkpoints" / "d3"
    assert not [p.name for p in d.iterdir() if ".tmp" in p.name]
    (small_disk / "filler").unlink()
    target = d / "model_000001.pt"
    atomic_save({"w": torch.ones(3)}, target)
    fill_disk(small_disk, leave=0)
    with pytest.raises(OSError, match=f"No space left on device: '{target}'"):
        atomic_save({"w": torch.zeros(1_000_000)}, target)         # torch's RuntimeError, turned into this
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
    assert not [p.name for p in d.iterdir() if ".tmp" in p.name]


def test_temporary_file_of_a_killed_save_is_removed(base, tmp_path):
    "A save killed mid-write (SIGKILL) leaves its temporary file; the next run on the directory removes it."
    cfg = Config(**{**DEMO_SFT, "base_dir": str(base), "output_dir": str(tmp_path / "out")})
    train(cfg)
    d = tmp_path / "out" / "chatrl_checkpoints" / "d3"
    code = ("import time\nfrom nanorl.checkpoint import atomic_save\n"
            "class Stall:\n    def __reduce__(self):\n        print('writing', flush=True)\n        time.sleep(120)\n"
            f"atomic_save({{'w': Stall()}}, {str(d / 'model_000002.pt')!r})")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait()
    left = [f.name for f in d.iterdir() if ".tmp" in f.name]
    assert left == [f".model_000002.pt.tmp{p.pid}"]
    with pytest.warns(UserWarning, match=f"interrupted save left in {d}: {left[0]}"):
        train(Config(**{**vars(cfg), "resume": True}))
    assert not [f.name for f in d.iterdir() if ".tmp" in f.name]


# ---------------------------------------------------------------- 8. a step without its manifest is damage


def test_missing_manifest_is_damage_in_a_run_that_writes_them(base, tmp_path):
    "Step 2's manifest deleted and its model swapped: loading and resuming warn and fall back to step 1."
    out = tmp_path / "out"
    cfg = Config(**{**DEMO_SFT, "base_dir": str(base), "output_dir": str(out), "num_steps": 3})
    train(cfg)
    d = out / "chatrl_checkpoints" / "d3"
    shutil.copytree(base / "tokenizer", out / "tokenizer")
    (d / "manifest_000002_rank0.json").unlink()
    shutil.copy(d / "model_000001.pt", d / "model_000002.pt")       # another step's weights under step 2's name
    with pytest.warns(UserWarning, match="manifest_000002_rank0.json is missing"):
        _, _, meta = load_model(d, "cpu")
    assert meta["nanorl"]["step"] == 1
    with pytest.warns(UserWarning, match="cannot resume from step 2.*manifest_000002_rank0.json is missing"):
        records = train(Config(**{**vars(cfg), "resume": True}))
    assert [r["step"] for r in records] == [0, 1, 2]
    (d / "manifest_000001_rank0.json").write_text(json.dumps({"sha256": ["model_000001.pt"]}))
    msg = run_main(flags(**DEMO_SFT, source="rl", model_step=1, base_dir=out, output_dir=tmp_path / "o2"))
    assert f"{d / 'manifest_000001_rank0.json'}" in msg and "'sha256' as a list" in msg and "\n" not in msg, msg


# ---------------------------------------------------------------- 9. a resume continues on the run's own data


def test_resume_refuses_other_or_changed_data(base, tmp_path, capsys):
    "Another --data-dir, or a data file changed in place: refused in one line, nothing else touched; allowed: listed."
    first, other = tmp_path / "gsm_a", tmp_path / "gsm_b"
    for d in (first, other):
        shutil.copytree(FIXTURES / "gsm8k", d)
    out = tmp_path / "out"
    run = dict(DEMO_SFT, task="gsm8k", eval_examples=4, num_steps=3, data_dir=first, base_dir=base,
               output_dir=out)
    main(flags(**run))
    d = out / "chatrl_checkpoints" / "d3"
    for name in ("model_000002.pt", "meta_000002.json", "optim_000002_rank0.pt", "resume_000002_rank0.pt",
                 "manifest_000002_rank0.json"):
        (d / name).unlink()                                         # back to step 1: step 2 is to be redone
    outside = lambda: {k: v for k, v in tree(tmp_path).items() if not k.startswith("out/")}
    before = outside()
    msg = run_main(flags(**{**run, "data_dir": other}, resume=True))
    assert f"--data-dir {first} -> {other}" in msg and "--allow-changes" in msg and "\n" not in msg, msg
    assert outside() == before
    lines = (first / "train.jsonl").read_text().splitlines()
    (first / "train.jsonl").write_text("\n".join(lines[:-1]) + "\n")    # one problem fewer, in place
    before = outside()
    msg = run_main(flags(**run, resume=True))
    assert "data file train.jsonl changed" in msg and "test.jsonl" not in msg and "\n" not in msg, msg
    assert outside() == before and not (d / "model_000002.pt").exists()
    capsys.readouterr()
    main(flags(**run, resume=True, allow_changes=True))
    assert "nanorl: --allow-changes: data file train.jsonl changed" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


# ---------------------------------------------------------------- 10. no silent no-op: a run that cannot learn


@pytest.mark.parametrize("changes, fragment", [
    (dict(top_k=1), "--top-k 1 keeps only the likeliest token"),
    (dict(temperature=1e-6), "--temperature 1e-06 draws a token even one logit below the likeliest"),
    (dict(temperature=0.05), "use a temperature above 1 / (24 ln 2) = 0.0601"),
])
def test_greedy_sampling_is_refused(base, tmp_path, changes, fragment):
    "Samples that are all the same make every advantage 0: refused before any work, as --temperature 0 is."
    msg = run_main(flags(**{**DEMO_SFT, **changes}, base_dir=base, output_dir=tmp_path / "o"))
    assert fragment in msg and "every advantage is 0" in msg and "\n" not in msg, msg
    assert not (tmp_path / "o").exists()
    validate(Config(**{**DEMO_SFT, "temperature": 0.07, "top_k": 2}))          # just above: accepted


@pytest.mark.parametrize("changes", [dict(kl_coef=1e300), dict(task="doubles:make_all_nan_tasks")])
def test_run_whose_every_update_was_skipped_fails(base, tmp_path, changes):
    "Every step non-finite (fewer than --max-bad-steps): an error counting them, and no final checkpoint."
    msg = run_main(flags(**{**DEMO_SFT, **changes}, base_dir=base, output_dir=tmp_path / "o"))
    assert "every update was skipped: all 2 of 2 steps" in msg and "\n" not in msg, msg
    d = tmp_path / "o" / "chatrl_checkpoints" / "d3"
    assert not list(d.glob("model_*.pt")) and len((d / "metrics.jsonl").read_text().splitlines()) == 2


# ---------------------------------------------------------------- 11. flag values that overflowed, named


@pytest.mark.parametrize("changes, fragment", [
    (dict(matrix_lr=1e308), "--matrix-lr 1e+308 x --init-lr-frac 1.0 = 1e+308"),
    (dict(init_lr_frac=1e308), "--embedding-lr 0.2 x --init-lr-frac 1e+308"),
    (dict(lr=1e308), "--lr 1e+308"),
    (dict(dist_timeout_min=1e308), "--dist-timeout-min must be between 1/60 (a second) and 14400"),
    (dict(dist_timeout_min=1e-9), "--dist-timeout-min must be between"),
    (dict(task=":x"), "--task must be gsm8k, countdown, arithmetic or module:factory"),
    (dict(model_step=-1), "--model-step must be >= 0"),
])
def test_overflowing_flags_are_named(base, tmp_path, changes, fragment):
    msg = run_main(flags(**{**DEMO_SFT, "init_lr_frac": 1.0, **changes}, base_dir=base, output_dir=tmp_path / "o"))
    assert msg.startswith("nanorl.train: error: ") and fragment in msg and "\n" not in msg, msg


class BadLength(TaskView):
    "The demo's problems, claiming `size` of them."
    size = 10**30

    def __len__(self):
        return self.size


def huge_tasks(cfg):
    from nanorl.start import make_tasks
    train_task, held_out = make_tasks(Config(**{**vars(cfg), "task": "arithmetic"}))
    return BadLength(train_task), held_out


def negative_tasks(cfg):
    train_task, held_out = huge_tasks(cfg)
    train_task.size = -1
    return train_task, held_out


@pytest.mark.parametrize("factory", ["huge_tasks", "negative_tasks"])
def test_task_length_that_is_no_length_is_named(base, tmp_path, factory):
    msg = run_main(flags(**{**DEMO_SFT, "task": f"test_robustness:{factory}"}, base_dir=base,
                         output_dir=tmp_path / "o"))
    assert f"the training task of --task test_robustness:{factory} (BadLength) has no usable length" in msg, msg
    assert "\n" not in msg


def test_task_module_that_exits_on_import_is_an_error(base, tmp_path, monkeypatch):
    "A --task module calling sys.exit(0) as it is imported: an error naming it, not a silent exit 0."
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = run_main(flags(**{**DEMO_SFT, "task": "exits_on_import:tasks"}, base_dir=base, output_dir=tmp_path / "o"))
    assert msg.startswith("nanorl.train: error: --task exits_on_import:tasks: sys.exit(0)") and "\n" not in msg, msg
    assert "importing exits_on_import" in msg


def test_meta_sequence_len_beyond_the_weights_is_named(base, tmp_path):
    "A meta claiming sequence_len 1e9 (rotary tables of terabytes): refused naming the file, before any allocation."
    meta_path = next((base / "chatsft_checkpoints" / "d3").glob("meta_*.json"))
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["sequence_len"] = 10**9
    meta_path.write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        msg = run_main(flags(**DEMO_SFT, base_dir=base, output_dir=tmp_path / "o"))
    assert f"{meta_path}: the meta's sequence_len 1000000000" in msg and "fix it in the meta" in msg, msg
    assert "\n" not in msg
