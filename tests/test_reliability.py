"""Reliability: exact resume after SIGKILL, atomic checkpoints, elastic restarts, non-finite steps, OOM halving,
clear errors on bad inputs, a fuzzed calculator and untrusted files."""

import json, os, shutil, signal, subprocess, sys, time, warnings
from pathlib import Path

import pytest
import torch

from harness import ENV, ROOT, TORCHRUN, check
from rounding import STEP_ATOL
from doubles import base_dir, records, checkpoints_of, small_run, weights
from nanorl.checkpoint import CheckpointError, load_model
from nanorl.rollout import Sampling, rollout
from nanorl.rundir import check_writable, complete_steps
from nanorl.train import (
    Config,
    NonFiniteError,
    main,
    make_tasks,
    train,
    validate,
)

FIXTURE = ROOT / "tests" / "fixtures" / "nanochat" / "head"
GSM8K_FIXTURE = ROOT / "tests" / "fixtures" / "gsm8k"
SMALL = small_run(eval_every=3, save_every=2, matrix_lr=0.05, init_lr_frac=1.0)


def train_cmd(base, *args, launcher=None):
    "Command line of `nanorl.train` on the fixture base directory, with the small settings."
    launcher = launcher or [sys.executable, "-m", "nanorl.train"]
    return [*launcher, "--base-dir", str(base), *SMALL, *args]


def assert_same_tensors(a, b, where=""):
    "Bitwise equality of nested dicts/lists of tensors and numbers."
    if isinstance(a, torch.Tensor):
        assert (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        ), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run_end(a, b, step, ranks=1):
    "Two runs end with identical weights, optimizer state (rank 0's file), every rank's resume step, and metrics."
    load = lambda base, name: torch.load(checkpoints_of(base) / name, weights_only=True)
    assert_same_tensors(load(a, f"model_{step:06d}.pt"), load(b, f"model_{step:06d}.pt"), "model")
    assert_same_tensors(load(a, f"optim_{step:06d}_rank0.pt"), load(b, f"optim_{step:06d}_rank0.pt"), "optim")
    for r in range(ranks):
        assert (
            load(a, f"resume_{step:06d}_rank{r}.pt")["step"]
            == load(b, f"resume_{step:06d}_rank{r}.pt")["step"]
            == step + 1
        )
    assert not any(
        any(checkpoints_of(x).glob("optim_*_rank1.pt")) for x in (a, b)
    ), "the optimizer state is written once, by rank 0"
    assert records(a, drop_timing=True) == records(b, drop_timing=True)


def wait_for_checkpoint(directory, proc, ranks=1, timeout=120):
    "Poll until `directory` has a complete checkpoint (all files of all ranks); returns its step."
    t0 = time.time()
    while time.time() - t0 < timeout:
        steps = complete_steps(directory, ranks)
        if steps:
            return steps[0]
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{proc.stderr.read()[-3000:]}"
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


# ---------------------------------------------------------------- exact resume after SIGKILL


def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    "Kill -9 after the first checkpoint, --resume: weights, optimizer state and metrics equal an unbroken run."
    steps = ["--num-steps", "8"]
    whole, cut = base_dir(tmp_path, "whole"), base_dir(tmp_path, "cut")
    check(subprocess.run(train_cmd(whole, *steps), env=ENV, capture_output=True, text=True, timeout=300))
    proc = subprocess.Popen(
        train_cmd(cut, *steps), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        killed_after = wait_for_checkpoint(checkpoints_of(cut), proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert killed_after < 7 and not (checkpoints_of(cut) / "model_000007.pt").exists()
    p = check(subprocess.run(train_cmd(cut, *steps, "--resume"), env=ENV, capture_output=True, text=True, timeout=300))
    assert "resuming at step" in p.stdout
    assert_same_run_end(whole, cut, 7)
    assert [r["step"] for r in records(cut, drop_timing=True)] == list(range(8))


# ---------------------------------------------------------------- fault tolerance under torchrun


def worker_pids(agent_pid):
    "{rank: pid} of the workers torchrun's agent process has started (read from /proc)."
    pids = {}
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            if "RANK" in env:
                pids[int(env["RANK"])] = int(pid)
    return pids


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_torchrun_restarts_a_killed_rank_and_resumes(tmp_path):
    """torchrun with restarts: SIGKILL rank 1 after the first checkpoint; the restarted group ends as an unbroken run.

    More than one restart is allowed: on a busy machine gloo's re-rendezvous after a restart sometimes refuses a
    connection, and torchrun then restarts the group once more, which must still end exactly as the unbroken run."""
    steps = ["--num-steps", "8"]
    launcher = lambda restarts: [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.2",
        "-m",
        "nanorl.train",
    ]
    whole, cut = base_dir(tmp_path, "whole"), base_dir(tmp_path, "cut")
    check(
        subprocess.run(
            train_cmd(whole, *steps, launcher=launcher(0)), env=ENV, capture_output=True, text=True, timeout=300
        )
    )
    proc = subprocess.Popen(
        train_cmd(cut, *steps, launcher=launcher(3)), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_checkpoint(checkpoints_of(cut), proc, ranks=2)
        os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"the restarted group failed:\n{out[-3000:]}\n{err[-5000:]}"
    assert "resuming at step" in out and "elastic restart" in out, out[-3000:]
    assert_same_run_end(whole, cut, 7, ranks=2)


# ---------------------------------------------------------------- in-process runs


def run_config(base, **kw):
    "The small settings as a Config (in-process runs)."
    return Config(
        **{
            "device_type": "cpu",
            "base_dir": str(base),
            "examples_per_step": 2,
            "num_samples": 4,
            "device_batch_size": 4,
            "max_new_tokens": 12,
            "eval_every": 100,
            "eval_examples": 2,
            "save_every": 1,
            "task": "doubles:toy_tasks",
            "matrix_lr": 0.05,
            "init_lr_frac": 1.0,
            "seed": 7,
            "num_steps": 3,
            **kw,
        }
    )


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    "Weights after one optimizer step of the small run (a 1-step run saves step 0), and its records."
    base = base_dir(tmp_path_factory.mktemp("one"), "base")
    recs = train(run_config(base, num_steps=1))
    return weights(base, 0), recs


# ---------------------------------------------------------------- checkpoints: partial and corrupt newest ones


def test_resume_skips_incomplete_and_corrupt_checkpoints(tmp_path):
    "A newest checkpoint missing a file, then one corrupt: --resume takes the last complete, readable step."
    base = base_dir(tmp_path, "run")
    full = train(run_config(base, num_steps=4))  # checkpoints 1, 2, 3
    d = checkpoints_of(base)
    (d / "resume_000003_rank0.pt").unlink()  # killed before its last file
    (d / "model_000002.pt").write_bytes((d / "model_000002.pt").read_bytes()[:1000])  # cut short
    assert complete_steps(d, 1) == [2, 1]
    for name in ("model_000003.pt", "meta_000003.json", "optim_000003_rank0.pt"):
        (d / name).unlink()
    with pytest.warns(UserWarning, match="cannot resume from step 2"):
        again = train(run_config(base, num_steps=4, resume=True))
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("t_")} for r in rs]
    assert strip(again) == strip(full), "resuming from step 1 must redo steps 2 and 3 exactly"


def test_load_model_takes_last_complete_checkpoint(tmp_path):
    "load_model skips a newest step whose meta is missing or whose model file is corrupt, and says so."
    base = base_dir(tmp_path, "run")
    train(run_config(base, num_steps=3))  # checkpoints 1, 2
    d = checkpoints_of(base)
    (d / "meta_000002.json").unlink()
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint step 2"):
        _, _, meta = load_model("rl", "cpu", base_dir=base)
    assert meta["nanorl"]["step"] == 1
    (d / "model_000001.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_model("rl", "cpu", base_dir=base)


def test_atomic_save_leaves_old_file_or_nothing(tmp_path, monkeypatch):
    "A crash in the middle of torch.save leaves the previous file untouched and no temporary file behind."
    from nanorl import checkpoint

    target = tmp_path / "model_000001.pt"
    checkpoint.atomic_save({"w": torch.ones(3)}, target)

    def crash(obj, f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_save({"w": torch.zeros(3)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model_000001.pt"]
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_save({"w": torch.zeros(3)}, tmp_path / "model_000002.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["model_000001.pt"]


# ---------------------------------------------------------------- non-finite steps


def test_nonfinite_step_is_skipped_and_counted(tmp_path, one_step):
    "A step whose rewards are nan is skipped (no update) and counted in `skipped`; training goes on."
    base = base_dir(tmp_path, "run")
    recs = train(run_config(base, num_steps=3, task="doubles:make_nan_step1_tasks"))
    assert [r["skipped"] for r in recs] == [0, 1, 1]
    assert [r["grad_norm"] != r["grad_norm"] for r in recs] == [False, True, False]
    assert_same_tensors(weights(base, 1), one_step[0], "weights after the skipped step")  # as after step 0
    assert weights(base, 2).keys() == one_step[0].keys() and not torch.equal(
        weights(base, 2)["lm_head.weight"], one_step[0]["lm_head.weight"]
    )


def test_too_many_nonfinite_steps_stop_with_a_clear_message(tmp_path, capsys):
    "--max-bad-steps non-finite steps in a row stop the run with a message; the records show the skipped steps."
    base = base_dir(tmp_path, "run")
    with pytest.raises(NonFiniteError, match="2 steps in a row had a non-finite loss or gradient"):
        train(run_config(base, num_steps=5, max_bad_steps=2, task="doubles:make_all_nan_tasks"))
    assert [r["skipped"] for r in records(base, drop_timing=True)] == [1, 2]
    with pytest.raises(SystemExit, match="nanorl.train: error: 2 steps in a row"):
        main(
            [
                "--base-dir",
                str(base_dir(tmp_path, "cli")),
                *SMALL,
                "--num-steps",
                "5",
                "--max-bad-steps",
                "2",
                "--task",
                "doubles:make_all_nan_tasks",
            ]
        )


# ---------------------------------------------------------------- out of memory in rollouts


def test_rollout_oom_halves_then_restores(tmp_path, monkeypatch, one_step):
    "An OOM in the first engine call halves the rows per call, the next step doubles back; the update is unchanged."
    import nanorl.step as S
    from nanorl.engine import Engine

    real, real_rollout, calls, inside = Engine.generate_many, S.rollout, [], [False]

    def flaky(self, prompts, num_samples=1, **kw):
        if inside[0]:  # rollouts only, not evaluation
            calls.append(len(prompts) * num_samples)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, prompts, num_samples=num_samples, **kw)

    def tracked(*args, **kw):
        inside[0] = True
        try:
            return real_rollout(*args, **kw)
        finally:
            inside[0] = False

    monkeypatch.setattr(Engine, "generate_many", flaky)
    monkeypatch.setattr(S, "rollout", tracked)
    base = base_dir(tmp_path, "run")
    recs = train(run_config(base, num_steps=1, rollout_rows=8))
    assert calls == [8, 4, 4] and recs[0]["rollout_rows"] == 4
    assert_same_tensors(weights(base, 0), one_step[0], "weights after a halved rollout")
    # the same samples and update; the engine's log-probs come from products over another row count, so the gap to the
    # trainer's (a rounding-level measurement) may differ in its last bits: within tests/rounding.py's bound
    gaps = ("logp_gap_max", "logp_gap_mean")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("t_") and k not in ("rollout_rows", *gaps)}
    assert strip(recs[0]) == strip(one_step[1][0])
    assert all(abs(recs[0][k] - one_step[1][0][k]) <= STEP_ATOL[k] for k in gaps)
    calls.clear()
    recs = train(run_config(base_dir(tmp_path, "two"), num_steps=3, rollout_rows=8))
    assert calls == [8, 4, 4, 4, 4, 8] and [r["rollout_rows"] for r in recs] == [
        4,
        4,
        8,
    ]  # next step at 4, then 8 again


def test_evaluation_oom_halves_and_gives_the_same_result(tmp_path, monkeypatch, one_step):
    "An OOM while sampling for evaluation retries with fewer prompts per call; pass@k and the update are unchanged."
    from nanorl.engine import Engine

    real, calls = Engine.generate_many, []

    def flaky(self, prompts, num_samples=1, **kw):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")  # the first call is the eval
        return real(self, prompts, num_samples=num_samples, **kw)

    monkeypatch.setattr(Engine, "generate_many", flaky)
    base = base_dir(tmp_path, "run")
    recs = train(run_config(base, num_steps=1, rollout_rows=8))
    assert calls[:3] == [2, 1, 1], calls  # 2 eval prompts per call, then 1 and 1
    # the same samples and update; the engine's log-probs come from products over another row count, so the gap to the
    # trainer's (a rounding-level measurement) may differ in its last bits: within tests/rounding.py's bound
    gaps = ("logp_gap_max", "logp_gap_mean")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("t_") and k not in ("rollout_rows", *gaps)}
    assert strip(recs[0]) == strip(one_step[1][0])
    assert all(abs(recs[0][k] - one_step[1][0][k]) <= STEP_ATOL[k] for k in gaps)
    assert_same_tensors(weights(base, 0), one_step[0], "weights after a halved evaluation")


def test_rollout_oom_at_one_prompt_is_a_clear_error():
    "When even one prompt's samples do not fit, the error says which settings to lower."

    class Tokenizer:
        def render_for_completion(self, conversation):
            return [1, 2, 3]

    class Engine:
        def generate_many(self, prompts, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(torch.OutOfMemoryError, match="lower --num-samples or --max-new-tokens"):
        rollout(Engine(), Tokenizer(), [{}] * 4, [0, 1, 2, 3], Sampling(4, 8, 1.0, 0), [1, 2, 3, 4], rollout_rows=16)


# ---------------------------------------------------------------- bad inputs: a clear error before any work


def cli_error(*args):
    "The message `python -m nanorl.train` exits with (run in-process through main)."
    with pytest.raises(SystemExit) as e:
        main([*SMALL, "--num-steps", "1", *args])
    assert str(e.value).startswith("nanorl.train: error: "), e.value
    return str(e.value)


def test_missing_or_empty_checkpoint_directory(tmp_path):
    assert "found no such directory" in cli_error("--base-dir", str(tmp_path / "nothing"))
    base = tmp_path / "empty"
    (base / "chatsft_checkpoints" / "d3").mkdir(parents=True)
    assert "expected model_<step>.pt files" in cli_error("--base-dir", str(base))
    assert not (base / "chatrl_checkpoints").exists(), "a failed start must not leave a run directory"


def test_corrupt_or_truncated_checkpoint(tmp_path):
    base = base_dir(tmp_path, "cut")
    model = base / "chatsft_checkpoints" / "d3" / "model_000000.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    assert "truncated or corrupt" in cli_error("--base-dir", str(base))
    model.write_bytes(b"this is not a torch file")
    assert "truncated or corrupt" in cli_error("--base-dir", str(base))


def test_tokenizer_and_model_vocab_mismatch(tmp_path):
    from nanorl.tokenizer import Tokenizer

    base = base_dir(tmp_path, "vocab")
    small = Tokenizer.train_from_iterator(["one two three four five six seven"] * 50, vocab_size=300)
    small.save(base / "tokenizer")
    assert small.get_vocab_size() != 2048
    msg = cli_error("--base-dir", str(base))
    assert f"has {small.get_vocab_size()} tokens, the model expects vocab_size=2048" in msg, msg


def data_dir(tmp_path, train_lines):
    "A GSM8K data directory with the given train.jsonl lines and the fixture's test split."
    d = tmp_path / "gsm8k"
    d.mkdir(parents=True)
    (d / "train.jsonl").write_text("\n".join(train_lines) + "\n")
    shutil.copy(GSM8K_FIXTURE / "test.jsonl", d / "test.jsonl")
    return d


def test_malformed_data_rows(tmp_path):
    "A line that is not JSON stops the run naming --data-dir; a row without '####' is left out with a warning."
    rows = (GSM8K_FIXTURE / "train.jsonl").read_text().splitlines()
    bad_json = data_dir(tmp_path / "a", [rows[0], '{"question": "cut off', rows[1]])
    msg = cli_error("--base-dir", str(base_dir(tmp_path, "base")), "--task", "gsm8k", "--data-dir", str(bad_json))
    assert "not JSON" in msg and str(bad_json) in msg
    no_marker = json.dumps({"question": "What is 2 + 2?", "answer": "It is 4."})
    with pytest.warns(UserWarning, match="1 of 3 rows are malformed"):
        train_task, _ = make_tasks(
            Config(task="gsm8k", data_dir=str(data_dir(tmp_path / "b", [rows[0], no_marker, rows[1]])))
        )
    assert len(train_task) == 2
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="has no problems"):
        make_tasks(Config(task="gsm8k", data_dir=str(data_dir(tmp_path / "c", [no_marker]))))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(examples_per_step=3), "divisible by the number of ranks"),
        (dict(num_samples=1), "--num-samples must be >= 2"),
        (dict(temperature=0.0), "use a temperature > 0"),
        (dict(device_batch_size=0), "--device-batch-size must be >= 1"),
        (dict(loss_norm="mean"), "--loss-norm must be one of"),
        (dict(source="base"), "--source must be one of"),
        (dict(num_steps=0), "--num-steps must be >= 1"),
        (dict(kl_coef=-1.0), "--kl-coef must be >= 0"),
        (dict(entropy_coef=-0.1), "--entropy-coef must be >= 0"),
        (dict(entropy_coef=float("nan")), "--entropy-coef must be >= 0"),
        (dict(task="nope"), "module:factory"),
    ],
)
def test_invalid_flag_combinations(change, message):
    with pytest.raises(ValueError, match=message):
        validate(Config(**change), world_size=2)


def test_invalid_flags_on_the_command_line(tmp_path):
    assert "--num-samples must be >= 2" in cli_error("--base-dir", str(tmp_path), "--num-samples", "1")


def test_unwritable_output_directory_fails_before_loading(tmp_path):
    "The output directory is checked before the model is loaded: the message names it, even with no checkpoint at all."
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    msg = cli_error("--base-dir", str(tmp_path / "nothing"), "--output-dir", str(blocker / "runs"))
    assert "not writable" in msg and str(blocker / "runs") in msg
    with pytest.raises(ValueError, match="not writable"):
        check_writable(blocker)
    check_writable(tmp_path / "new" / "deeper")  # creatable: fine
    assert not (tmp_path / "new").exists(), "the check must not create directories"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write to read-only directories")
def test_read_only_output_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ValueError, match="not writable"):
            check_writable(ro)
        with pytest.raises(ValueError, match="not writable"):
            check_writable(ro / "sub")
    finally:
        ro.chmod(0o755)


# ---------------------------------------------------------------- untrusted files


class Payload:
    "An object whose unpickling would create a file: what a malicious checkpoint would do."

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_bearing_weights_are_refused(tmp_path):
    "Weights, optimizer and resume states load with weights_only=True: a file carrying code is refused unrun."
    from nanorl.checkpoint import load_resume_state

    base = base_dir(tmp_path, "evil")
    marker = tmp_path / "pwned"
    d = base / "chatsft_checkpoints" / "d3"
    state = torch.load(d / "model_000000.pt", weights_only=True)
    torch.save({**state, "extra": Payload(marker)}, d / "model_000000.pt")
    with pytest.raises(CheckpointError, match="loading failed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_model("sft", "cpu", base_dir=base)
    torch.save({"step": 3, "torch_rng": Payload(marker)}, d / "resume_000000_rank0.pt")
    with pytest.raises(Exception, match="(?i)weights.only"):
        load_resume_state(d, 0)
    assert not marker.exists(), "unpickling ran code from the checkpoint"


def test_tokenizer_without_pickle(tmp_path):
    "allow_pickle=False refuses a directory with only tokenizer.pkl, and loads the plain JSON one that save() writes."
    from nanorl.tokenizer import Tokenizer

    pkl_dir = FIXTURE / "tokenizer"
    with pytest.raises(ValueError, match="allow_pickle=False"):
        Tokenizer.from_directory(pkl_dir, allow_pickle=False)
    trusted = Tokenizer.from_directory(pkl_dir)  # once, from a source you trust
    trusted.save(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.pkl").unlink()
    safe = Tokenizer.from_directory(tmp_path / "tok", allow_pickle=False)
    text = "<|user_start|>What is 12 * 7?<|user_end|> Answer: 84"
    assert safe.get_vocab_size() == trusted.get_vocab_size()
    assert safe.encode(text) == trusted.encode(text) and safe.decode(trusted.encode(text)) == text


def test_tokenizer_pickle_naming_an_encoding_is_refused_offline(tmp_path, monkeypatch):
    "A tokenizer.pkl holding tiktoken's by-name form of an encoding: refused offline in one line, no download tried."
    import pickle
    import tiktoken
    import tiktoken.registry
    from nanorl.tokenizer import Tokenizer

    base = base_dir(tmp_path, "named")
    (base / "tokenizer" / "tokenizer.json").unlink(missing_ok=True)
    enc = Tokenizer.from_directory(FIXTURE / "tokenizer").enc
    with monkeypatch.context() as m:
        m.setattr(tiktoken.Encoding, "__getstate__", lambda self: "gpt2")  # tiktoken's form for a registered encoding
        (base / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(enc))

    def download(name):
        raise AssertionError(f"tried to download the tiktoken encoding {name!r}")
    monkeypatch.setattr(tiktoken.registry, "get_encoding", download)      # no network: say it, should it be tried
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as e:
        load_model("sft", "cpu", base_dir=base)
    msg = str(e.value)
    assert "tokenizer.pkl" in msg and "'gpt2'" in msg and "tried to download" not in msg, msg


# ---------------------------------------------------------------- the calculator on arbitrary model text

from datetime import timedelta
from hypothesis import HealthCheck, given, settings, strategies as st

CALC_TOKENS = [
    "0",
    "1",
    "7",
    "9",
    "12",
    "3.5",
    "99999999999",
    "+",
    "-",
    "*",
    "**",
    "/",
    "//",
    "%",
    "(",
    ")",
    " ",
    ",",
    ".",
    "'abc'",
    '"a"',
    ".count(",
    ".upper()",
    "()",
    "[",
    "]",
    "{",
    "}",
    "__class__",
    "__import__",
    "__bases__",
    "__subclasses__",
    "__globals__",
    "os",
    "system",
    "open",
    "eval",
    "exec",
    "lambda",
    ":",
    "import",
    "getattr",
    "__builtins__",
    "print",
    "'x'*99",
    "if",
    "else",
    "in",
    "not",
    "and",
    "or",
    "\n",
    ";",
    "=",
    "e9",
    "j",
]
ALLOWED_RESULTS = (type(None), bool, int, float, complex, str, bytes, tuple, list, type(Ellipsis))  # `...`, as nanochat
CALC_BOUND_S = 2.0  # CALC_MAX_SECONDS is 0.5; the rest is parsing and slack for a busy machine
calc_texts = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(CALC_TOKENS), max_size=80).map("".join),
    st.integers(1, 600).map(lambda n: "(" * n + "1" + ")" * n),  # deep nesting
    st.tuples(st.integers(1, 12), st.integers(2, 3000)).map(
        lambda t: "*".join([str(10 ** t[0] - 1)] * t[1])
    ),  # huge products
    st.integers(1, 60).map(lambda n: "9" + "**9" * n),  # 9**9**9...
    st.integers(1, 2000).map(lambda n: "-" * n + "1"),
)


from contextlib import contextmanager


@contextmanager
def no_code_execution():
    "Fail loudly if anything inside calls eval, exec, os.system or starts a process."
    import builtins, subprocess as sp

    targets = [(builtins, "eval"), (builtins, "exec"), (os, "system"), (os, "popen"), (sp, "Popen")]
    saved, calls = [getattr(m, n) for m, n in targets], []

    def trap(name):
        def called(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called")

        return called

    for m, n in targets:
        setattr(m, n, trap(n))
    try:
        yield calls
    finally:
        for (m, n), f in zip(targets, saved):
            setattr(m, n, f)
    assert not calls, f"the calculator called {calls}"


@settings(max_examples=400, deadline=timedelta(seconds=3), suppress_health_check=[HealthCheck.too_slow])
@given(text=calc_texts)
def test_calculator_fuzz_never_raises_is_bounded_and_only_computes(text):
    from nanorl.engine import use_calculator

    for nanochat_format in (False, True):
        t0 = time.perf_counter()
        with no_code_execution():
            result = use_calculator(text, nanochat_format=nanochat_format)  # must not raise
        assert time.perf_counter() - t0 < CALC_BOUND_S, f"{text[:80]!r} took too long"
        assert isinstance(result, ALLOWED_RESULTS), f"{text[:80]!r} gave a {type(result).__name__}"


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('echo pwned')",
        "().__class__.__bases__[0].__subclasses__()",
        "open('/etc/passwd').read()",
        "eval('1+1')",
        "(lambda: 1)()",
        "9**9**9",
        "'a'.__class__",
        "[].__class__.__mro__",
        "globals()",
        "1;import os",
        "print(1)",
        "'x'.count('x').__class__",
    ],
)
def test_calculator_refuses_code(text):
    from nanorl.engine import use_calculator

    with no_code_execution():
        assert use_calculator(text) is None
    assert use_calculator("12 * 7") == 84 and use_calculator("'strawberry'.count('r')") == 3
