"Tests for nanorl.checkpoint: nanochat layout, both generations, atomic saves, clear errors."

import json, shutil, warnings
from pathlib import Path
import pytest
import torch
from nanorl.checkpoint import (
    CheckpointError,
    load_model,
    save_checkpoint,
    checkpoint_steps,
    detect_generation,
    load_resume_state,
)

FIX = Path(__file__).parent / "fixtures" / "nanochat"


@pytest.mark.parametrize("name,tag,gen", [("head", "d3", "current"), ("oct2025", "d2", "oct2025")])
def test_fixture_loads_and_matches_reference(name, tag, gen, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(FIX / name))
    model, tok, meta = load_model("sft", torch.device("cpu"), model_tag=tag, step=0)
    ref = torch.load(FIX / f"reference_{name}.pt", weights_only=True)
    with torch.no_grad():
        for p in "abc":
            assert (model(ref[f"inputs_{p}"]) - ref[f"logits_{p}"]).abs().max() < 1e-4
    assert meta["nanorl"]["generation"] == gen and model.config.generation == gen
    assert tok.get_vocab_size() == 2048 and not model.training
    # a direct checkpoint directory works too, and phase='train'
    model2, _, _ = load_model(FIX / name / "chatsft_checkpoints" / tag, "cpu", phase="train")
    assert model2.training


def test_save_load_roundtrip_orig_mod_prefix_and_layout(tmp_path):
    shutil.copytree(FIX / "head" / "tokenizer", tmp_path / "tokenizer")
    model, _, _ = load_model(FIX / "head" / "chatsft_checkpoints" / "d3", "cpu")
    state = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    save_checkpoint(
        tmp_path / "chatrl_checkpoints" / "d3", 3, state, None, {"model_config": model.config}, resume_state={"step": 3}
    )
    files = sorted(p.name for p in (tmp_path / "chatrl_checkpoints" / "d3").iterdir())
    # no temp files left; the manifest (sha256 of each file) last
    assert files == ["manifest_000003_rank0.json", "meta_000003.json", "model_000003.pt", "resume_000003_rank0.pt"]
    saved = torch.load(tmp_path / "chatrl_checkpoints" / "d3" / "model_000003.pt", weights_only=True)
    fixture = torch.load(FIX / "head" / "chatsft_checkpoints" / "d3" / "model_000000.pt", weights_only=True)
    assert set(saved) == set(fixture)
    meta = json.loads((tmp_path / "chatrl_checkpoints" / "d3" / "meta_000003.json").read_text())
    assert (
        meta["model_config"]
        == json.loads((FIX / "head/chatsft_checkpoints/d3/meta_000000.json").read_text())["model_config"]
    )
    again, _, meta2 = load_model("rl", "cpu", base_dir=tmp_path)
    x = torch.randint(0, 2048, (2, 20))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    assert meta2["nanorl"]["step"] == 3 and load_resume_state(tmp_path / "chatrl_checkpoints" / "d3", 3) == {"step": 3}


def test_corrupt_last_step_is_skipped_and_explicit_step_errors(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(FIX / "head" / "chatsft_checkpoints" / "d3", d)
    (d / "model_000005.pt").write_bytes(b"not a checkpoint")
    shutil.copy(d / "meta_000000.json", d / "meta_000005.json")
    (d / "model_000006.pt").write_bytes((d / "model_000000.pt").read_bytes())  # no meta -> incomplete
    assert checkpoint_steps(d)[-1] == 6
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        _, _, meta = load_model(d, "cpu", base_dir=FIX / "head")
    assert meta["nanorl"]["step"] == 0
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(d, "cpu", step=5, base_dir=FIX / "head")
    with pytest.raises(CheckpointError, match="meta_000006.json"):
        load_model(d, "cpu", step=6, base_dir=FIX / "head")


def test_errors_missing_dir_empty_dir_keys_vocab(tmp_path):
    with pytest.raises(CheckpointError, match="existing directory"):
        load_model(tmp_path / "absent", "cpu")
    (tmp_path / "chatsft_checkpoints" / "d4").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="found none"):
        load_model("sft", "cpu", base_dir=tmp_path)
    sd = torch.load(FIX / "head/chatsft_checkpoints/d3/model_000000.pt", weights_only=True)
    meta = json.loads((FIX / "head/chatsft_checkpoints/d3/meta_000000.json").read_text())
    bad = dict(sd)
    del bad["lm_head.weight"]
    save_checkpoint(tmp_path / "chatsft_checkpoints" / "d4", 0, bad, None, meta)
    shutil.copytree(FIX / "head" / "tokenizer", tmp_path / "tokenizer")
    with pytest.raises(CheckpointError, match=r"missing keys \['lm_head.weight'\]"):
        load_model("sft", "cpu", step=0, base_dir=tmp_path)
    meta["model_config"]["vocab_size"] = 2000  # 2000 pads to 2048: weights fit, tokenizer does not
    save_checkpoint(tmp_path / "chatsft_checkpoints" / "d4", 0, sd, None, meta)
    with pytest.raises(CheckpointError, match="vocab_size=2000"):
        load_model("sft", "cpu", step=0, base_dir=tmp_path)


def test_intermediate_generation_is_refused():
    sd = torch.load(FIX / "head/chatsft_checkpoints/d3/model_000000.pt", weights_only=True)
    for k in ("smear_lambda", "backout_lambda", "smear_gate.weight"):
        del sd[k]
    with pytest.raises(CheckpointError, match="Jan-Mar 2026"):
        detect_generation(sd)


def test_tokenizer_json_or_pickle_and_allow_pickle(tmp_path):
    "load_model reads tokenizer.json or tokenizer.pkl as Tokenizer.from_directory does; allow_pickle passes through."
    from nanorl.tokenizer import Tokenizer

    ck = FIX / "head" / "chatsft_checkpoints" / "d3"
    tok_dir = tmp_path / "tokenizer"
    shutil.copytree(FIX / "head" / "tokenizer", tok_dir)  # nanochat's: tokenizer.pkl only
    want = Tokenizer.from_directory(tok_dir).encode("Natalia sold 48 clips.")
    with pytest.raises(CheckpointError, match="allow_pickle=False"):
        load_model(ck, "cpu", base_dir=tmp_path, allow_pickle=False)
    assert load_model(ck, "cpu", base_dir=tmp_path)[1].encode("Natalia sold 48 clips.") == want
    Tokenizer.from_directory(tok_dir).save(tok_dir)
    (tok_dir / "tokenizer.pkl").write_bytes(b"not a pickle")  # JSON is preferred: the pickle is never read
    assert load_model(ck, "cpu", base_dir=tmp_path)[1].encode("Natalia sold 48 clips.") == want
    (tok_dir / "tokenizer.pkl").unlink()
    assert load_model(ck, "cpu", base_dir=tmp_path, allow_pickle=False)[1].encode("Natalia sold 48 clips.") == want
    (tok_dir / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="found neither"):
        load_model(ck, "cpu", base_dir=tmp_path)


def test_get_base_dir_semantics(tmp_path, monkeypatch):
    from nanorl.checkpoint import get_base_dir

    monkeypatch.setenv("NANOCHAT_BASE_DIR", "")
    assert get_base_dir() == Path.home() / ".cache" / "nanochat"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    assert get_base_dir() == tmp_path and get_base_dir(tmp_path / "x") == tmp_path / "x"


def test_rl_checkpoint_keeps_fp32_embeddings(tmp_path):
    model, _, _ = load_model(FIX / "head" / "chatsft_checkpoints" / "d3", "cpu")
    save_checkpoint(tmp_path / "d3", 1, model.state_dict(), None, {"model_config": model.config})
    saved = torch.load(tmp_path / "d3" / "model_000001.pt", weights_only=True)
    assert {v.dtype for v in saved.values()} == {torch.float32}
