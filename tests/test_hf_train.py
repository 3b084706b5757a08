"""Hugging Face chat models end to end: load_model on HF hf_folders, RL training with --model-path, HF checkpoints that
transformers loads, exact resume, sharded saves, clear errors for incomplete hf_folders, the engine's stop tokens."""

import json, os, shutil, subprocess, sys
from pathlib import Path

import pytest
import torch

from doubles import save_tiny_hf_model, small_run, token_biased
from harness import ENV, ROOT
from nanorl.checkpoint import (
    SAFETENSORS_INDEX,
    CheckpointError,
    hf_checkpoint_steps,
    load_model,
    read_hf_state,
    save_hf_checkpoint,
)
from nanorl.engine import DEFAULT_MAX_NEW_TOKENS, Engine
from oracles import reference_generate
from nanorl.start import build_optimizer
from nanorl.train import Config, train

transformers = pytest.importorskip("transformers")
SMALL = small_run(lr="1e-3")
IDS = torch.randint(0, 500, (2, 23), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    "Tiny random HF hf_folders written by transformers: {model_type: (folder, transformers model)}."
    root = tmp_path_factory.mktemp("hf")
    return {kind: (root / kind, save_tiny_hf_model(kind, root / kind)[0]) for kind in ("qwen2", "qwen3", "llama")}


def hf_logits(folder, ids=IDS):
    "transformers' float32 logits of `ids` for the model in `folder`."
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def our_logits(folder, ids=IDS):
    "nanorl's logits of `ids` for the model in `folder`, loaded through load_model."
    model, _, _ = load_model(folder, "cpu")
    with torch.no_grad():
        return model(ids)


def tensors(folder):
    "Every tensor of an HF folder as saved (float32 here), tied head added back."
    return read_hf_state(folder)[0]


def assert_same(a, b, where=""):
    "Bitwise equality of nested dicts/lists of tensors and plain values."
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys differ by {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_load_model_of_hf_folder_equals_transformers(hf_folders, kind):
    folder, theirs = hf_folders[kind]
    model, tok, meta = load_model(folder, "cpu", phase="train")
    with torch.no_grad():
        assert (model(IDS) - theirs(IDS).logits).abs().max() < 1e-4
    assert model.training and meta["nanorl"] == {"format": "hf", "path": str(folder), "step": None}
    assert meta["model_config"] == json.loads((folder / "config.json").read_text())
    assert tok.get_vocab_size() <= model.config.vocab_size  # Qwen2 here: 8 rows wider, no error


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_files_are_named(hf_folders, tmp_path, missing):
    broken = tmp_path / "broken"
    shutil.copytree(hf_folders["qwen2"][0], broken)
    (broken / missing).unlink()
    with pytest.raises(CheckpointError) as e:
        load_model(broken, "cpu")
    assert missing in str(e.value) and str(broken) in str(e.value)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanorl.train",
            "--model-path",
            str(broken),
            "--output-dir",
            str(tmp_path / "out"),
            *SMALL,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "nanorl.train: error:" in p.stderr and missing in p.stderr, p.stderr[-2000:]


def test_missing_shard_is_named(hf_folders, tmp_path):
    out = save_hf_checkpoint(
        tmp_path / "sharded",
        load_model(hf_folders["llama"][0], "cpu")[0],
        hf_folders["llama"][0],
        max_shard_bytes=30_000,
    )
    shard = json.loads((out / SAFETENSORS_INDEX).read_text())["weight_map"]["lm_head.weight"]
    (out / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_model(out, "cpu")


# ---------------------------------------------------------------- saving


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_forced_sharding_round_trips_through_transformers(hf_folders, tmp_path, kind):
    source = hf_folders[kind][0]
    model, _, _ = load_model(source, "cpu")
    out = save_hf_checkpoint(tmp_path / "sharded", model, source, max_shard_bytes=30_000)
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert ("lm_head.weight" in index["weight_map"]) == (kind == "llama")  # a tied head is not written twice
    copied = {f.name for f in source.iterdir()} - {"model.safetensors"}
    assert {f.name for f in out.iterdir()} == copied | {SAFETENSORS_INDEX, *shards}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    assert_same(tensors(out), dict(model.state_dict()))
    with torch.no_grad():  # the same code on the same bits: equal; transformers' own code rounds its own way
        assert torch.equal(our_logits(out), model(IDS))
        assert (hf_logits(out) - model(IDS)).abs().max() < 1e-5
    whole = save_hf_checkpoint(tmp_path / "whole", model, source)  # default: one file
    assert (whole / "model.safetensors").is_file() and not (whole / SAFETENSORS_INDEX).exists()


def test_saving_bfloat16_sets_the_config_dtype(hf_folders, tmp_path):
    source = hf_folders["qwen3"][0]
    model, _, _ = load_model(source, "cpu")
    out = save_hf_checkpoint(tmp_path / "bf16", model, source, dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config.pop("dtype") == "bfloat16"
    assert config == {k: v for k, v in json.loads((source / "config.json").read_text()).items() if k != "dtype"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert theirs.dtype == torch.bfloat16


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_cli_trains_and_writes_an_hf_checkpoint(hf_folders, tmp_path, kind):
    source = hf_folders[kind][0]
    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanorl.train",
            "--model-path",
            str(source),
            "--output-dir",
            str(out),
            "--num-steps",
            "2",
            *SMALL,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    run = out / "chatrl_checkpoints" / kind
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in recs)
    assert recs[0]["lr"] == pytest.approx(1e-3)  # --lr, not scaled by --init-lr-frac
    assert hf_checkpoint_steps(run) == [1]
    assert {f.name for f in run.iterdir()} == {
        "step_000001",
        "optim_000001_rank0.pt",
        "resume_000001_rank0.pt",
        "manifest_000001_rank0.json",
        "metrics.jsonl",
        ".lock",
    }
    step = run / "step_000001"
    with torch.no_grad():
        theirs, ours = hf_logits(step), our_logits(step)
    assert (theirs - ours).abs().max() < 1e-5
    moved = max((tensors(step)[k] - v).abs().max().item() for k, v in tensors(source).items())
    assert moved > 1e-5, "training did not change the weights"
    assert json.loads((step / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    model, _, meta = load_model(run, "cpu")  # the run directory: its newest step
    assert meta["step"] == 1 and torch.equal(model(IDS), ours)


def hf_run_config(folder, out, **kw):
    "The small HF run, in-process: checkpoints every step, evaluation at steps 0 and 3."
    return Config(
        **{
            "model_path": str(folder),
            "output_dir": str(out),
            "task": "doubles:toy_tasks",
            "device_type": "cpu",
            "num_steps": 4,
            "examples_per_step": 2,
            "num_samples": 4,
            "device_batch_size": 4,
            "max_new_tokens": 10,
            "eval_every": 3,
            "eval_examples": 2,
            "save_every": 1,
            "lr": 1e-3,
            "seed": 5,
            **kw,
        }
    )


def test_resume_equals_an_unbroken_run_bitwise(hf_folders, tmp_path):
    source = hf_folders["qwen2"][0]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    unbroken = train(hf_run_config(source, whole))
    train(hf_run_config(source, cut))
    run = cut / "chatrl_checkpoints" / "qwen2"
    shutil.rmtree(run / "step_000003")  # killed while writing step 3's folder: its other files exist
    shutil.rmtree(run / "step_000002")  # and step 2 is gone entirely
    for f in run.glob("*_000002_*"):
        f.unlink()
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(hf_run_config(source, cut))
    resumed = train(hf_run_config(source, cut, resume=True))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    drop_t = lambda rs: [{k: v for k, v in r.items() if not k.startswith("t_")} for r in rs]
    assert drop_t(resumed) == drop_t(unbroken)
    a, b = whole / "chatrl_checkpoints" / "qwen2", run
    assert_same(tensors(a / "step_000003"), tensors(b / "step_000003"), "weights")
    load = lambda d, name: torch.load(d / name, weights_only=True)
    assert_same(load(a, "optim_000003_rank0.pt"), load(b, "optim_000003_rank0.pt"), "optim")
    assert load(b, "resume_000003_rank0.pt")["step"] == 4


def test_build_optimizer_uses_lr_for_hf_models(hf_folders):
    model, _, _ = load_model(hf_folders["qwen2"][0], "cpu", phase="train")
    opt = build_optimizer(model, Config(model_path="x", lr=2e-6, init_lr_frac=0.05, weight_decay=0.1))
    assert isinstance(opt, torch.optim.AdamW)
    assert {g["lr"] for g in opt.param_groups} == {g["initial_lr"] for g in opt.param_groups} == {2e-6}
    assert {g["name"]: g["weight_decay"] for g in opt.param_groups}["matrix"] == 0.1
    with pytest.raises(ValueError, match="--model-step"):
        train(Config(model_path="x", model_step=3))


# ---------------------------------------------------------------- the engine's stop tokens and default length


def test_engine_stops_on_generation_config_eos(hf_folders):
    "Llama 3's <|end_of_text|> is an eos of generation_config.json, neither end of turn nor bos: a row stops on it."
    model, tok, _ = load_model(hf_folders["llama"][0], "cpu")
    eos = tok.encode_special("<|end_of_text|>")
    assert eos not in (tok.encode_special("<|assistant_end|>"), tok.get_bos_token_id())
    biased = token_biased(model, eos)
    engine = Engine(biased, tok)
    assert engine.stop_tokens == set(tok.get_stop_token_ids())
    prompt = tok.render_for_completion(
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    )
    seqs, masks = engine.generate_batch(prompt, num_samples=2, max_tokens=6, seed=1)
    assert seqs == [prompt, prompt] and masks == [[0] * len(prompt)] * 2
    ref, _ = reference_generate(Engine(biased, tok), prompt, num_samples=2, max_tokens=6, seed=1)
    assert ref == seqs
    more, _ = engine.generate_batch(prompt, num_samples=2, max_tokens=6, seed=1, min_new_tokens=3)
    assert all(len(s) == len(prompt) + 3 and eos not in s[len(prompt) :] for s in more)


def test_default_max_tokens_is_capped():
    "Without max_tokens a row may grow to sequence_len, but by at most DEFAULT_MAX_NEW_TOKENS (Qwen: 32768 positions)."
    from doubles import ScriptedModel, nanochat_tokenizer

    tok = nanochat_tokenizer()
    end = tok.encode_special("<|assistant_end|>")
    long = Engine(ScriptedModel([[5]], tok.get_vocab_size(), end, sequence_len=32768), tok)
    assert long.check_request([[1, 2, 3]], 1, None, 0)[0] == DEFAULT_MAX_NEW_TOKENS == 4096
    short = Engine(ScriptedModel([[5]], tok.get_vocab_size(), end, sequence_len=256), tok)
    assert short.check_request([[1, 2, 3]], 1, None, 0)[0] == 253  # nanochat's models: unchanged
