"""Hugging Face chat models against transformers: config layouts, logits, losses, greedy generation, chat templates."""

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from doubles import (HF_KINDS, gsm8k_chat_conversations, save_tiny_hf_model, small_run, tiny_hf_tokenizer,
                     to_transformers4_layout)
from nanorl.engine import Engine
from nanorl.chat import ChatTokenizer, message_text, template_messages
from nanorl.llama import DecoderConfig, config_from_dict, load_llama, rope_settings
from harness import ENV
from rounding import LOGITS_ATOL, assert_greedy_agrees

KINDS = ("qwen2", "qwen3", "llama")
SAVE = {"qwen2": {}, "qwen3": {"max_shard_size": "40KB"}, "llama": {"dtype": torch.bfloat16}}  # sharded; bf16 file


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    "model_type -> (folder, transformers model in float32): Qwen2 tied + biases, Qwen3 sharded, Llama 3 in bf16."
    out = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(kind)
        hf, _ = save_tiny_hf_model(kind, folder, **SAVE[kind])
        out[kind] = (folder, hf)
    return out


def sample_ids(vocab_size, n=40, seed=0):
    "A (2, n) batch of random token ids."
    return torch.randint(0, vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ config


def test_both_config_layouts_read_the_same(folders, tmp_path):
    "transformers 5's rope_parameters and 4.x's rope_theta/rope_scaling give the same config, for every family."
    for kind, (folder, _) in folders.items():
        old = shutil.copytree(folder, tmp_path / kind)
        to_transformers4_layout(old)
        cfg = json.loads((old / "config.json").read_text())
        assert "rope_parameters" not in cfg and "rope_theta" in cfg
        assert DecoderConfig.from_folder(old) == DecoderConfig.from_folder(folder)


def test_config_fields():
    "Per-family switches: Qwen2 biases, Qwen3 q/k norm and head size, Llama 3 scaling."
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    q2 = config_from_dict({**base, "model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": True})
    assert (q2.attention_bias, q2.o_proj_bias, q2.qk_norm, q2.head_dim) == (True, False, False, 16)
    assert q2.tie_word_embeddings
    q3 = config_from_dict({**base, "model_type": "qwen3", "head_dim": 32, "num_key_value_heads": 1})
    assert (q3.attention_bias, q3.qk_norm, q3.head_dim, q3.num_key_value_heads) == (False, True, 32, 1)
    ll = config_from_dict(
        {
            **base,
            "model_type": "llama",
            "attention_bias": True,
            "rope_theta": 5e5,
            "rope_scaling": {
                "type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert (ll.attention_bias, ll.o_proj_bias, ll.rope_theta, ll.rope_scaling.factor) == (True, True, 5e5, 32.0)
    assert ll.sequence_len == ll.max_position_embeddings


def test_config_errors(tmp_path):
    "Unsupported types and rope kinds, missing fields and files: errors that name the file."
    with pytest.raises(ValueError, match=r"cfg/config.json.*'gemma2'.*\('llama', 'qwen2', 'qwen3'\)"):
        config_from_dict({"model_type": "gemma2"}, "cfg/config.json")
    with pytest.raises(ValueError, match="yarn"):
        rope_settings({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_settings({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="missing"):
        config_from_dict({"model_type": "llama", "vocab_size": 3})
    with pytest.raises(FileNotFoundError, match="config.json"):
        DecoderConfig.from_folder(tmp_path)
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    assert config_from_dict({**base, "max_position_embeddings": 131072}).max_position_embeddings == 131072
    for bad in (10**12, 0, 2048.5, "2048"):            # a typo would build rotary tables for 10^12 positions
        with pytest.raises(ValueError, match=r"cfg/config.json: max_position_embeddings must be an integer"):
            config_from_dict({**base, "max_position_embeddings": bad}, "cfg/config.json")


# ------------------------------------------------------------------ the model against transformers


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_losses_match_transformers(folders, kind):
    "float32 logits within 1e-4 and equal per-token losses, for each family."
    folder, hf = folders[kind]
    model = load_llama(folder)
    ids = sample_ids(model.config.vocab_size)
    targets = ids.roll(-1, dims=1)
    targets[:, -5:] = -1
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
        per_token = model(ids, targets, loss_reduction="none")
        loss, entropy = model(ids, targets, with_entropy=True)
    assert ours.dtype == torch.float32 and ours.shape == (2, 40, model.config.vocab_size)
    assert (ours - theirs).abs().max() < LOGITS_ATOL
    ref = F.cross_entropy(theirs.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
    torch.testing.assert_close(per_token, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref[targets.flatten() != -1].mean(), atol=1e-5, rtol=1e-5)
    entropy = entropy.view(2, 40)
    assert (entropy[:, -5:] == 0).all() and (entropy[:, :-5] > 0).all()


def test_weights_layout(folders):
    "Tied Qwen2 head is the embedding; bf16 files are cast to the dtype asked for; sharded files are read."
    q2 = load_llama(folders["qwen2"][0])
    assert q2.lm_head.weight is q2.model.embed_tokens.weight
    assert q2.model.layers[0].self_attn.q_proj.bias is not None and q2.model.layers[0].self_attn.o_proj.bias is None
    assert (folders["qwen3"][0] / "model.safetensors.index.json").exists()
    q3 = load_llama(folders["qwen3"][0])
    assert q3.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    assert q3.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    llama = load_llama(folders["llama"][0], dtype=torch.bfloat16)
    assert {p.dtype for p in llama.parameters()} == {torch.bfloat16} and llama.cos.dtype == torch.float32
    assert llama(sample_ids(llama.config.vocab_size)).dtype == torch.float32
    names = set(dict(q3.named_parameters()))
    assert {
        "model.embed_tokens.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.k_norm.weight",
    } <= names


@pytest.mark.parametrize("break_it", ["rope_theta", "llama3_scaling", "rms_norm_eps"])
def test_a_wrong_setting_breaks_the_logits(folders, tmp_path, break_it):
    "The logits test can fail: a wrong rotary base, a dropped Llama 3 scaling or a wrong eps are caught."
    folder, hf = folders["llama"]
    bad = shutil.copytree(folder, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    if break_it == "rope_theta":
        cfg["rope_parameters"]["rope_theta"] = 10000.0
    elif break_it == "llama3_scaling":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    else:
        cfg["rms_norm_eps"] = 0.1
    (bad / "config.json").write_text(json.dumps(cfg))
    ids = sample_ids(cfg["vocab_size"])
    with torch.no_grad():
        assert (load_llama(bad)(ids) - hf(ids).logits).abs().max() > 1e-3


def test_weight_errors_name_the_file(folders, tmp_path):
    "Missing files and shards, shapes that disagree with config.json, missing and unexpected weights."
    folder = folders["llama"][0]
    bad = shutil.copytree(folder, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors or model.safetensors.index.json"):
        load_llama(bad)
    shutil.copy(folder / "model.safetensors", bad / "model.safetensors")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128, "head_dim": 16}))
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: model.embed_tokens.weight has shape \(600, 64\), "
        r"config.json implies \(600, 128\)",
    ):
        load_llama(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tied = load_llama(bad)  # a tied config ignores a stored head
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing from \['model.safetensors'\].*model.layers.2"):
        load_llama(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"no place for.*model.layers.1"):
        load_llama(bad)
    sharded = shutil.copytree(folders["qwen3"][0], tmp_path / "sharded")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_llama(sharded)


def test_ragged_kv_cache_rows_match_full_forwards(folders):
    "Prompts of different lengths prefilled into one cache, then decoded together: each row as its own forward."
    model = load_llama(folders["qwen3"][0])
    seqs = [[5, 17, 42, 99, 3, 8, 9], [7, 8, 300], [1, 2, 3, 4, 5]]
    cache = model.new_kv_cache(3, seq_len=12)
    with torch.no_grad():
        for r, s in enumerate(seqs):
            one = model.new_kv_cache(1, seq_len=len(s))
            model.hidden(torch.tensor([s]), kv_cache=one)
            cache.prefill_rows(one, [r])
        for step in range(3):
            col = [[10 + step], [20 + step], [30 + step]]
            got = model.unembed(model.hidden(torch.tensor(col), kv_cache=cache))[:, -1]  # (3, V)
            seqs = [s + c for s, c in zip(seqs, col)]
            want = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.cache_seqlens.tolist() == [10, 6, 8]


def test_setup_optimizers(folders):
    "AdamW groups cover every parameter once (tied head too), with initial_lr and no decay on vectors."
    model = load_llama(folders["qwen2"][0])
    opt = model.setup_optimizers(lr=2e-6, weight_decay=0.1, unembedding_lr=1e-3)
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"embedding", "matrix", "vector"}  # tied: no separate head
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()
    assert groups["vector"]["weight_decay"] == 0.0 and groups["matrix"]["weight_decay"] == 0.1
    assert all(g["initial_lr"] == g["lr"] == 2e-6 for g in opt.param_groups)
    llama = load_llama(folders["llama"][0])
    assert {g["name"]: g["lr"] for g in llama.setup_optimizers(unembedding_lr=1e-3).param_groups}["unembedding"] == 1e-3


# ------------------------------------------------------------------ generation through the engine


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_transformers(folders, kind):
    """Engine.generate_batch at temperature 0 gives transformers' generate(do_sample=False), token for token, up to a
    near tie (two logits within 2 x LOGITS_ATOL) that the two implementations' rounding may break differently; past
    such a tie the prefixes differ and nothing more is compared (tests/rounding.py)."""
    folder, hf = folders[kind]
    model, tok = load_llama(folder), ChatTokenizer.from_directory(folder)
    engine = Engine(model, tok)
    assert engine.stop_tokens <= set(tok.get_stop_token_ids())
    for conv in gsm8k_chat_conversations(3)[1:]:
        prompt = tok.render_for_completion(conv)
        seqs, masks = engine.generate_batch(prompt, num_samples=1, max_tokens=20, temperature=0.0)
        ours = seqs[0][len(prompt) :]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, len(prompt) :].tolist()
            logits = hf(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1]  # (len(ref), V): before each
        assert_greedy_agrees(ours, ref, logits, engine.stop_tokens, LOGITS_ATOL)
        assert seqs[0][: len(prompt)] == prompt and masks[0] == [0] * len(prompt) + [1] * len(ours)


# ------------------------------------------------------------------ tokenizer and chat templates


@pytest.fixture(scope="module")
def chat_folders(tmp_path_factory):
    "family -> (folder with tokenizer files, transformers tokenizer loaded back from it)."
    out = {}
    for family in ("qwen", "llama3"):
        folder = tmp_path_factory.mktemp(family)
        tiny_hf_tokenizer(family).save_pretrained(folder)
        out[family] = (folder, transformers.AutoTokenizer.from_pretrained(folder))
    return out


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_chat_template_ids_match_apply_chat_template(chat_folders, family):
    "render_conversation / render_for_completion ids equal apply_chat_template's on 56 GSM8K conversations."
    folder, hf_tok = chat_folders[family]
    tok = ChatTokenizer.from_directory(folder)
    convs = gsm8k_chat_conversations(56)
    assert sum(c["messages"][0]["role"] == "system" for c in convs) >= 10
    for conv in convs:
        messages = template_messages(conv)
        ids, mask = tok.render_conversation(conv)
        assert ids == hf_tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert len(mask) == len(ids)
        prompt = tok.render_for_completion(conv)
        assert (
            prompt == hf_tok.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)["input_ids"]
        )
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])


@pytest.mark.parametrize("family,eot", [("qwen", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_mask_is_each_assistant_content_and_its_end_of_turn(chat_folders, family, eot):
    "Mask 1 exactly on every assistant message's content and the end-of-turn token after it; 0 elsewhere."
    tok = ChatTokenizer.from_directory(chat_folders[family][0])
    conv = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And times 4?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "5 * 4 = "},
                    {"type": "python", "text": "5*4"},
                    {"type": "python_output", "text": "20"},
                    {"type": "text", "text": "20\n#### 20"},
                ],
            },
        ]
    }
    ids, mask = tok.render_conversation(conv)
    eot_id = tok.encode_special(eot)
    assert tok.encode_special("<|assistant_end|>") == eot_id
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    assert [tok.decode(r) for r in runs] == ["5" + eot, "5 * 4 = <<5*4=20>>20\n#### 20" + eot]
    assert all(r[-1] == eot_id for r in runs) and sum(i == eot_id for i in ids) >= 4  # other turns' eot: mask 0
    if family == "qwen":
        assert tok.decode(ids[-1:]) == "\n" and mask[-1] == 0  # the newline after <|im_end|>
    truncated_ids, truncated_mask = tok.render_conversation(conv, max_tokens=10)
    assert (truncated_ids, truncated_mask) == (ids[:10], mask[:10])


def test_special_tokens_and_encode(chat_folders):
    "nanochat's names map to the family's tokens; encode keeps special-token strings as text; eos from the configs."
    qwen = ChatTokenizer.from_directory(chat_folders["qwen"][0])
    llama = ChatTokenizer.from_directory(chat_folders["llama3"][0])
    assert qwen.get_bos_token_id() == qwen.encode_special("<|endoftext|>")  # Qwen has no bos: the separator
    assert llama.get_bos_token_id() == llama.encode_special("<|begin_of_text|>")
    assert llama.encode_special("<|bos|>") == llama.get_bos_token_id()
    assert [qwen.encode_special(t) for t in ("<|python_start|>", "<|output_end|>")] == [None, None]
    with pytest.raises(ValueError, match="<|nope|>"):
        qwen.encode_special("<|nope|>")
    text = "Sold 48 clips <|im_end|> in May."
    assert qwen.encode(text) != qwen.tk.encode(text, add_special_tokens=False).ids
    assert qwen.decode(qwen.encode(text)) == text
    assert qwen.encode([text, "ok"], prepend="<|im_start|>", append=2)[1][0] == qwen.encode_special("<|im_start|>")
    assert qwen.get_vocab_size() == 600 and qwen.eos_token_ids == []  # no generation_config.json here
    assert qwen.get_stop_token_ids() == sorted({qwen.encode_special("<|im_end|>"), qwen.get_bos_token_id()})


@pytest.mark.parametrize("kind", KINDS)
def test_model_folder_ids_match_transformers(folders, kind):
    "Digits split as the family splits them, and the same ids as transformers' tokenizer of the model folder."
    folder, _ = folders[kind]
    ours, hf_tok = ChatTokenizer.from_directory(folder), transformers.AutoTokenizer.from_pretrained(folder)
    text = "Natalia sold 48 clips in April, 1234567 in May: $2.50 each, 3/4 of 120 = 90."
    assert ours.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    pieces = [piece for piece, _ in ours.tk.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == (["123", "456", "7"] if kind == "llama" else list("1234567"))  # Llama 3: up to 3 digits; Qwen: 1


def test_chat_errors(chat_folders, tmp_path):
    "No template, a template without a generation prompt, a rendering beyond max_position_embeddings."
    folder = shutil.copytree(chat_folders["qwen"][0], tmp_path / "tok")
    conv = gsm8k_chat_conversations(1)[0]
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 20}))
    with pytest.raises(ValueError, match=r"renders to \d+ tokens, more than the model's 20 positions"):
        ChatTokenizer.from_directory(folder).render_conversation(conv)
    (folder / "config.json").unlink()
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match="chat_template.jinja: the chat template writes no generation prompt"):
        ChatTokenizer.from_directory(folder).render_for_completion(conv)
    (folder / "chat_template.jinja").unlink()
    tok = ChatTokenizer.from_directory(folder)
    with pytest.raises(ValueError, match="no chat template"):
        tok.render_conversation(conv)
    assert tok.encode_special("<|assistant_end|>") == tok.encode_special("<|im_end|>")  # eos_token without a template
    with pytest.raises(ValueError, match="last message"):
        ChatTokenizer.from_directory(chat_folders["qwen"][0]).render_for_completion({"messages": conv["messages"][:1]})
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ChatTokenizer.from_directory(tmp_path)
    assert message_text("plain") == "plain"


def test_template_in_tokenizer_config(chat_folders, tmp_path):
    "A chat_template string (or a list of named templates) inside tokenizer_config.json is read too."
    folder = shutil.copytree(chat_folders["llama3"][0], tmp_path / "tok")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    conv = gsm8k_chat_conversations(1)[0]
    want = ChatTokenizer.from_directory(chat_folders["llama3"][0]).render_conversation(conv)
    for entry in (template, [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]):
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": entry}))
        assert ChatTokenizer.from_directory(folder).render_conversation(conv) == want


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_shared_prompt_pass_equals_plain(tmp_path, model_type):
    "The speed room's shared-prompt pass (the prompt once, in a GraphKVCache) gives the plain path's values and grads."
    from nanorl.checkpoint import load_model
    from nanorl.loss import token_logp
    from nanorl.prefix import shared_prefix_len, shared_token_logp

    save_tiny_hf_model(model_type, tmp_path)
    model, tok, _ = load_model(tmp_path, "cpu")
    torch.manual_seed(0)
    B, P, S = 4, 30, 20
    prompt = torch.randint(0, tok.get_vocab_size(), (1, P)).expand(B, P)
    inputs = torch.cat([prompt, torch.randint(0, tok.get_vocab_size(), (B, S))], dim=1)  # (B, T)
    targets = torch.roll(inputs, -1, 1)
    targets[:, : P - 1] = -1
    targets[:, -1] = -1
    assert shared_prefix_len(inputs, targets) == P - 1
    runs = []
    for fn in (token_logp, shared_token_logp):
        model.zero_grad()
        logp = fn(model, inputs, targets)
        logp.sum().backward()
        runs.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, g_plain), (shared, g_shared) = runs
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_shared[name], g, atol=1e-5 * (g.abs().max().item() + 1e-12), rtol=0)


# ---------------------------------------------------------------- broken folders and hostile templates: one line each


def train_error(folder, tmp_path) -> str:
    "The one-line message `python -m nanorl.train --model-path folder` exits with."
    from nanorl.train import main

    with pytest.raises(SystemExit) as e:
        main(["--model-path", str(folder), "--output-dir", str(tmp_path / "out"), *small_run(num_steps=1)])
    return str(e.value.code)


@pytest.mark.parametrize("name, damage, fragment", [
    ("model.safetensors", None, "is not readable safetensors"),
    ("config.json", "{oops", "is not JSON"),
    ("tokenizer_config.json", "{oops", "is not JSON"),
    ("tokenizer.json", None, "is not a readable tokenizer"),
])
def test_broken_hf_file_is_named(tmp_path, name, damage, fragment):
    "A cut-short weight or tokenizer file, a config that is not JSON: the file and what is wrong, in one line."
    from nanorl.checkpoint import CheckpointError, load_model

    folder = tmp_path / "qwen2"
    save_tiny_hf_model("qwen2", folder)
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if damage is None else damage.encode())
    with pytest.raises(CheckpointError, match=f"{path} {fragment}"):
        load_model(folder, "cpu")
    msg = train_error(folder, tmp_path)
    assert f"{path} {fragment}" in msg and "\n" not in msg, msg


GENERATION_PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TEMPLATE_TRAPS = {
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
                      "over its budget (loops over more than 1,000,000 items of `range`)"),
    "a huge text": ("{{ 'x' * 100000000 }}", "over its budget (a text of more than"),
    "the sandbox": ("{{ messages.append(1) }}", "SecurityError: access to attribute 'append'"),
}


@pytest.mark.parametrize("trap", TEMPLATE_TRAPS)
def test_hostile_template_is_one_line_in_seconds(tmp_path, trap):
    "Loops each under the sandbox's range cap (hours unchecked), a huge text, a sandbox refusal: a line naming it."
    folder = tmp_path / "qwen2"
    save_tiny_hf_model("qwen2", folder)
    source, fragment = TEMPLATE_TRAPS[trap]
    (folder / "chat_template.jinja").write_text(source + GENERATION_PROMPT)
    t0 = time.perf_counter()
    msg = train_error(folder, tmp_path)
    assert f"{folder / 'chat_template.jinja'}: " in msg and fragment in msg and "\n" not in msg, msg
    assert time.perf_counter() - t0 < 60


def test_template_past_its_time_is_named(tmp_path, monkeypatch):
    "A template whose loops stay under every count but run past the time budget (here 0.2 s) stops, named."
    import nanorl.chat

    folder = tmp_path / "qwen2"
    save_tiny_hf_model("qwen2", folder)
    loops = "{% for i in range(900) %}{% for j in range(900) %}{% if messages[0].role == 'x' %}{% endif %}"
    (folder / "chat_template.jinja").write_text(loops + "{% endfor %}{% endfor %}" + GENERATION_PROMPT)
    monkeypatch.setattr(nanorl.chat, "RENDER_SECONDS", 0.2)
    tok = ChatTokenizer.from_directory(folder)
    with pytest.raises(ValueError, match=r"chat_template.jinja: rendering the chat template went over its budget "
                                         r"\(more than 0.2 s\)"):
        tok.render_for_completion(gsm8k_chat_conversations(1)[0])


def test_template_out_of_memory_is_one_line(tmp_path):
    "A template that fills memory (a process capped at 1 GiB more than it holds): a line naming it, no traceback."
    folder = tmp_path / "qwen2"
    save_tiny_hf_model("qwen2", folder)
    grow = "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = ns.l + [[i] * 30000000] %}"
    (folder / "chat_template.jinja").write_text(grow + "{% endfor %}" + GENERATION_PROMPT)
    code = ("import resource, sys\nfrom nanorl.train import main\n"
            "vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize')) * 1024\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))\n"
            "main(sys.argv[1:])")
    argv = ["--model-path", str(folder), "--output-dir", str(tmp_path / "out"), *small_run(num_steps=1)]
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"{folder / 'chat_template.jinja'}: the chat template failed (out of memory)" in p.stderr, p.stderr[-900:]
