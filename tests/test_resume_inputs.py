"""What a resume depends on is recorded and checked (the model folder's files, the problem set, the fast paths), and
flags that cannot work end in one line naming the flag."""

import json

import pytest

import os

from doubles import FIXTURES, save_tiny_hf_model
from nanorl.llama import config_from_dict
from nanorl.rundir import open_run_file
from nanorl.config import config_from_args
from nanorl.real import main as real_main
from nanorl.real import gsm8k_tasks, problem_set, real_config, task_flag
from nanorl.rewards import reference_answer
from nanorl.train import Config, main, validate


def exit_message(entry, argv) -> str:
    "The one message an entry point exits with."
    with pytest.raises(SystemExit) as e:
        entry(argv)
    return str(e.value.code)


@pytest.fixture
def real_run(tmp_path):
    "A finished one-step nanorl.real run of a tiny Qwen2 folder: (flags, model folder, run directory)."
    hf, out = tmp_path / "qwen2", tmp_path / "r"
    save_tiny_hf_model("qwen2", hf)
    run = ["--model-path", str(hf), "--num-steps", "1", "--eval-examples", "2", "--threads", "1",
           "--output-dir", str(out)]
    real_main(run)
    return run, hf, out / "chatrl_checkpoints" / "smollm2"


def test_resume_refuses_a_changed_model_folder(real_run, capsys):
    "The chat template edited in place: --resume names the file and refuses; --allow-changes lists it and goes on."
    run, hf, d = real_run
    (hf / "chat_template.jinja").write_text((hf / "chat_template.jinja").read_text() + "{# a newer revision #}")
    msg = exit_message(real_main, [*run, "--resume", "--num-steps", "2", "--allow-changes", "false"])
    assert "model file chat_template.jinja changed" in msg and "config.json" not in msg and "\n" not in msg, msg
    assert [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()] == [0]
    capsys.readouterr()
    real_main([*run, "--resume", "--num-steps", "2", "--allow-changes"])
    assert "model file chat_template.jinja changed" in capsys.readouterr().out


def test_problems_are_recorded_and_a_resume_sees_them(real_run):
    "--problems is the run's --task (a factory of nanorl.real): resuming on other problems is refused, naming both."
    run, _, _ = real_run
    msg = exit_message(real_main, [*run, "--resume", "--num-steps", "2", "--problems", "multi-step"])
    assert f"--task {task_flag('one-step')} -> {task_flag('multi-step')}" in msg and "--allow-changes" in msg, msg
    assert {problem_set(real_config("m", task=p)) for p in ("one-step", "multi-step", "gsm8k")} == {
        "one-step", "multi-step", "gsm8k"}


def test_resume_lists_a_change_of_fast_paths(real_run):
    "--no-cpu-fast-paths changes the records' rounding: a resume names it as a change."
    run, _, _ = real_run
    cfg = real_config("m")
    assert cfg.cpu_fast_paths
    msg = exit_message(main, ["--model-path", run[1], "--num-steps", "2", "--eval-examples", "2", "--output-dir",
                              run[-1], "--model-tag", "smollm2", "--task", cfg.task, "--lr", str(cfg.lr), "--resume",
                              "--no-cpu-fast-paths"])
    assert "--cpu-fast-paths True -> False" in msg, msg


def test_gsm8k_problems_read_the_real_rows_and_score_the_last_number():
    "--problems gsm8k: GSM8K's rows from --data-dir, asked with the instruction, scored by the reply's last number."
    cfg = real_config("m", task="gsm8k", data_dir=str(FIXTURES / "gsm8k"))
    train, held_out = gsm8k_tasks(cfg)
    conv = held_out[0]
    right = reference_answer(conv, nanochat_compat=False)            # the `#### N` of the row
    assert conv["messages"][0]["content"].endswith("Give the final answer as a number at the end.")
    assert held_out.evaluate(conv, f"so it is {right}.") and not held_out.evaluate(conv, f"{right} or 1234567")
    assert len(train) > 0 and cfg.model_tag == "qwen" and cfg.dtype == "bfloat16"


@pytest.mark.parametrize("argv", [["--resume", "maybe"], ["--resume="], ["--no-cpu-fast-paths", "maybe"]])
def test_a_bad_boolean_is_a_usage_line(argv, capsys):
    "A boolean flag with a value that is no boolean: argparse's usage error (exit 2), naming the flag, no traceback."
    with pytest.raises(SystemExit) as e:
        config_from_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and argv[0].split("=")[0] in err and "expected a boolean" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["output_dir", "model_path", "data_dir"])
def test_an_empty_path_is_refused(flag):
    "`--output-dir ''` and its kin: refused, naming the flag, instead of writing or reading somewhere unsaid."
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} is empty"):
        validate(Config(**{flag: ""}))
    msg = exit_message(real_main, [f"--{flag.replace('_', '-')}", ""])
    assert f"--{flag.replace('_', '-')} is empty" in msg and "\n" not in msg


def test_mps_on_a_machine_without_it_names_the_flag():
    "--device-type mps where torch has no MPS: the flag is named, not the checkpoint."
    import torch

    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(ValueError, match="--device-type mps"):
        validate(Config(device_type="mps"))


def test_a_hard_linked_run_file_is_not_written_through(tmp_path):
    "metrics.jsonl hard-linked from a snapshot: writing it is refused naming the file; the snapshot keeps its bytes."
    run, snap = tmp_path / "metrics.jsonl", tmp_path / "snapshot.jsonl"
    run.write_text('{"step": 0}\n')
    os.link(run, snap)
    for mode in ("a", "w", "a+"):
        with pytest.raises(ValueError, match="2 hard links"):
            open_run_file(run, mode)
    assert snap.read_text() == '{"step": 0}\n' and open_run_file(run).read() == '{"step": 0}\n'   # reading is fine


def test_a_save_cut_short_names_the_files_to_delete(real_run):
    "Only an incomplete first checkpoint: a fresh start and --resume both name its files to delete."
    run, _, d = real_run
    (d / "optim_000000_rank0.pt").unlink()                    # the save was cut before the optimizer file
    for argv in (run, [*run, "--resume"]):
        msg = exit_message(real_main, argv)
        assert "incomplete checkpoint of step 0" in msg and str(d / "step_000000") in msg and "\n" not in msg, msg
        assert "optim_000000_rank0.pt" not in msg


@pytest.mark.parametrize("change, flag", [
    (dict(num_samples=100_000_000), "--num-samples"),
    (dict(examples_per_step=1_000_000_000), "--examples-per-step"),
    (dict(warmup_steps=10**12, num_steps=5), "--warmup-steps"),
    (dict(is_correction="tis", is_cap=1e-300), "--is-cap"),
    (dict(is_correction="mask", is_cap=0.5), "--is-cap"),
])
def test_settings_that_cannot_fit_or_learn_are_refused(change, flag):
    "Steps too big for the machine's memory, a warm-up longer than the run, a ratio cap under 1: named, not run."
    with pytest.raises(ValueError, match=flag):
        validate(Config(**change))


def test_a_config_too_big_for_the_machine_is_named():
    "num_hidden_layers 1,000,000 (or 0): config.json named, before any weight is allocated."
    cfg = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4)
    assert config_from_dict(cfg).num_hidden_layers == 2
    with pytest.raises(ValueError, match=r"config.json: .* parameters .* more than this machine's"):
        config_from_dict({**cfg, "num_hidden_layers": 10**12})
    with pytest.raises(ValueError, match="num_hidden_layers 0: sizes must be integers >= 1"):
        config_from_dict({**cfg, "num_hidden_layers": 0})


def test_gsm8k_offline_without_data_names_the_flag(tmp_path, monkeypatch):
    "GSM8K, the Hub off, no --data-dir: one line naming --data-dir, not the Python API alone."
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("NANORL_GSM8K_DIR", raising=False)
    msg = exit_message(main, ["--base-dir", str(FIXTURES / "demo_sft"), "--model-tag", "d3", "--num-steps", "1",
                              "--output-dir", str(tmp_path)])
    assert msg.startswith("nanorl.train: error: GSM8K") and "--data-dir DIR" in msg and "\n" not in msg, msg
