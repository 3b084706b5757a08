"""Exhaustive tests of nanorl.tokenizer against nanochat's fixtures, file round trips, training and bad input."""

import copy
import json
import os
import pickle
import random
import time
import warnings
from pathlib import Path

import pytest
import tiktoken
import torch
from hypothesis import given, settings, strategies as st

from nanorl.tokenizer import (
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    MaskView,
    Tokenizer,
    bpe_encoding,
    chat_messages,
    encoding_from_json,
    encoding_to_json,
    load_pickled_encoding,
    token_byte_lengths,
)

FIXTURES = Path(__file__).parent / "fixtures"
NANOCHAT = FIXTURES / "nanochat"
RENDERING = json.loads((NANOCHAT / "rendering.json").read_text())
GSM8K_REWARD = json.loads((NANOCHAT / "gsm8k_reward.json").read_text())
SAMPLE_TEXTS = [
    "Hello world!",
    " 12345678 apples",
    "tab\tnew\nline  spaces",
    "Ünïcödé 你好 🌍",
    "",
    "<|bos|> and <|assistant_end|> are text here",
    "#### 72",
    "x" * 500,
]


def gsm8k_texts():
    "Questions and answers of the GSM8K sample, plus generated word problems."
    texts = []
    for name in ("train.jsonl", "test.jsonl"):
        for line in (FIXTURES / "gsm8k" / name).read_text().splitlines():
            row = json.loads(line)
            texts += [row["question"], row["answer"]]
    rng = random.Random(0)
    names, things = ["Ava", "Ben", "Chloe", "Dev", "Emma"], ["apples", "pencils", "marbles", "books", "stickers"]
    for _ in range(300):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        n, t = rng.choice(names), rng.choice(things)
        texts.append(
            f"{n} has {a} {t} and buys {b} more. How many {t} does {n} have now?\n"
            f"{n} has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} {t}.\n#### {a + b}"
        )
    return texts


@pytest.fixture(scope="module")
def trained():
    return Tokenizer.train_from_iterator(gsm8k_texts(), vocab_size=2048)


# ---------------------------------------------------------------- nanochat fixtures


@pytest.mark.parametrize("case", RENDERING["conversations"], ids=lambda c: c["name"])
def test_render_conversation_matches_nanochat(tok, case):
    ids, mask = tok.render_conversation(case["conversation"], max_tokens=case["max_tokens"])
    assert ids == case["ids"]
    assert mask == case["mask"]
    assert tok.decode(ids) == case["decoded"]
    assert tok.render_for_completion(case["conversation"]) == case["render_for_completion_ids"]


@pytest.mark.parametrize("example", GSM8K_REWARD["examples"], ids=lambda e: f"row{e['row']}")
def test_render_gsm8k_examples_match_nanochat(tok, example):
    ids, mask = tok.render_conversation(example["conversation"])
    assert ids == example["render_conversation_ids"]
    assert mask == example["render_conversation_mask"]
    assert tok.render_for_completion(example["conversation"]) == example["render_for_completion_ids"]


@pytest.mark.parametrize("example", RENDERING["encode_examples"], ids=lambda e: repr(e["text"])[:30])
def test_encode_matches_nanochat(tok, example):
    assert tok.encode(example["text"], prepend=example.get("prepend"), append=example.get("append")) == example["ids"]


def test_specials_match_nanochat(tok):
    assert {t: tok.encode_special(t) for t in SPECIAL_TOKENS} == RENDERING["specials"]
    assert tok.get_bos_token_id() == RENDERING["bos"]
    assert tok.get_vocab_size() == RENDERING["tokenizer_vocab_size"]
    assert tok.get_special_tokens() == set(SPECIAL_TOKENS)
    assert tok.enc._pat_str == SPLIT_PATTERN


def test_encode_batch_prepend_append_by_id(tok):
    texts = ["Hi", "there <|bos|>", ""]
    bos, end = tok.get_bos_token_id(), tok.encode_special("<|assistant_end|>")
    rows = tok.encode(texts, prepend=bos, append="<|assistant_end|>", num_threads=2)
    assert rows == [[bos] + tok.encode(t) + [end] for t in texts]
    assert tok(texts[0]) == tok.encode(texts[0])


def test_single_token_helpers(tok):
    assert tok.decode_single_token_bytes(tok.get_bos_token_id()) == b"<|bos|>"
    assert tok.id_to_token(72) == "H" and tok.decode_single_token_bytes(72) == b"H"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_roundtrip_and_specials_never_parsed(text):
    tok = Tokenizer.from_directory(NANOCHAT / "tokenizer")
    text = text + "".join(SPECIAL_TOKENS[: len(text) % 10])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not set(ids) & set(range(tok.get_vocab_size() - 9, tok.get_vocab_size()))


# ---------------------------------------------------------------- files


def test_saved_tokenizer_loads_back_identically(tok, tmp_path):
    tok.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token_bytes.pt", "tokenizer.json", "tokenizer.pkl"]
    # as nanochat loads it: a plain pickle.load of a tiktoken.Encoding
    with open(tmp_path / "tokenizer.pkl", "rb") as f:
        enc = pickle.load(f)
    assert isinstance(enc, tiktoken.Encoding) and enc.name == "rustbpe"
    assert enc._special_tokens == RENDERING["specials"]
    for loaded in (
        Tokenizer(enc),
        Tokenizer.from_directory(tmp_path),
        Tokenizer.from_ranks_file(tmp_path / "tokenizer.json"),
    ):
        assert loaded.encode(SAMPLE_TEXTS) == tok.encode(SAMPLE_TEXTS)
        assert [loaded.encode_special(t) for t in SPECIAL_TOKENS] == [tok.encode_special(t) for t in SPECIAL_TOKENS]
        assert loaded.get_vocab_size() == tok.get_vocab_size()
        assert loaded.enc._pat_str == tok.enc._pat_str


def test_saved_pickle_is_byte_identical_to_nanochat(tok, tmp_path):
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.pkl").read_bytes() == (NANOCHAT / "tokenizer" / "tokenizer.pkl").read_bytes()


def test_token_bytes_equal_nanochat_file(tok, tmp_path):
    tok.save(tmp_path)
    ours = torch.load(tmp_path / "token_bytes.pt", weights_only=True)
    theirs = torch.load(NANOCHAT / "tokenizer" / "token_bytes.pt", weights_only=True)
    assert ours.dtype == torch.int32 and ours.shape == (tok.get_vocab_size(),)
    assert torch.equal(ours, theirs)


def test_safe_loader_gives_the_pickled_encoding(tok, tmp_path):
    tok.save(tmp_path)
    (tmp_path / "tokenizer.pkl").unlink()
    safe = Tokenizer.from_directory(tmp_path, allow_pickle=False)
    n = tok.get_vocab_size()
    assert [safe.decode_single_token_bytes(i) for i in range(n)] == [tok.decode_single_token_bytes(i) for i in range(n)]
    assert safe.encode(SAMPLE_TEXTS) == tok.encode(SAMPLE_TEXTS)
    assert safe.enc._special_tokens == tok.enc._special_tokens and safe.enc.name == tok.enc.name


def test_from_directory_prefers_json_and_refuses_pickle_when_asked(tok, tmp_path):
    tok.save(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="allow_pickle=False"):
        Tokenizer.from_directory(tmp_path, allow_pickle=False)
    assert Tokenizer.from_directory(tmp_path).encode("Hi there") == tok.encode("Hi there")
    with pytest.raises(FileNotFoundError, match="tokenizer.pkl"):
        Tokenizer.from_directory(tmp_path / "missing")


class _Sneaky:
    def __reduce__(self):
        return (os.getcwd, ())


def test_restricted_unpickler_refuses_other_objects(tmp_path):
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(_Sneaky()))
    with pytest.raises(pickle.UnpicklingError, match="posix.getcwd|os.getcwd"):
        load_pickled_encoding(path)
    path.write_bytes(pickle.dumps({"name": "not an encoding"}))
    with pytest.raises(ValueError, match="tiktoken.Encoding"):
        load_pickled_encoding(path)


def test_encoding_json_rejects_other_documents():
    with pytest.raises(ValueError, match="nanorl-tokenizer"):
        encoding_from_json({"format": "something-else"})
    with pytest.raises(ValueError, match="nanorl-tokenizer"):
        encoding_from_json([1, 2])


# ---------------------------------------------------------------- training


def test_train_2k_tokenizer_in_seconds(trained, tmp_path):
    t0 = time.perf_counter()
    tok = Tokenizer.train_from_iterator(gsm8k_texts(), vocab_size=2048)
    assert time.perf_counter() - t0 < 10
    V = tok.get_vocab_size()
    assert V == 2048
    assert [tok.encode_special(t) for t in SPECIAL_TOKENS] == list(range(V - 9, V))
    assert tok.get_bos_token_id() == V - 9
    assert tok.enc._pat_str == SPLIT_PATTERN
    assert [tok.decode_single_token_bytes(i) for i in range(256)] == [bytes([i]) for i in range(256)]
    for text in SAMPLE_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("How many apples does Ava have now?")) < 15  # merges were learned
    assert tok.encode(gsm8k_texts()[:20]) == trained.encode(gsm8k_texts()[:20])  # deterministic
    tok.save(tmp_path)
    back = Tokenizer.from_directory(tmp_path)
    assert back.encode(gsm8k_texts()[:50]) == tok.encode(gsm8k_texts()[:50])


def test_train_rejects_tiny_vocab_and_warns_on_tiny_corpus():
    with pytest.raises(ValueError, match="at least 265"):
        Tokenizer.train_from_iterator(["hello"], vocab_size=264)
    with pytest.warns(UserWarning, match="fewer than"):
        tok = Tokenizer.train_from_iterator(["ab ab"], vocab_size=400)
    assert [tok.encode_special(t) for t in SPECIAL_TOKENS] == list(
        range(tok.get_vocab_size() - 9, tok.get_vocab_size())
    )


def test_bpe_encoding_rejects_gaps():
    with pytest.raises(ValueError, match="without gaps"):
        bpe_encoding({bytes([i]): i for i in range(256)} | {b"ab": 300})


def test_token_byte_lengths_of_trained(trained):
    lengths = token_byte_lengths(trained.enc)
    assert lengths.shape == (2048,) and lengths.dtype == torch.int32
    assert lengths[-9:].tolist() == [0] * 9
    assert lengths[ord("a")] == 1
    for text in SAMPLE_TEXTS:  # bits per byte needs: the lengths of a text's tokens add up to its UTF-8 length
        assert sum(lengths[i].item() for i in trained.encode(text)) == len(text.encode("utf-8"))


# ---------------------------------------------------------------- rendering semantics


def conv(*messages):
    return {"messages": [{"role": r, "content": c} for r, c in messages]}


def test_render_does_not_modify_input(tok):
    for case in RENDERING["conversations"]:
        before = copy.deepcopy(case["conversation"])
        tok.render_conversation(case["conversation"])
        tok.render_for_completion(case["conversation"])
        assert case["conversation"] == before


def test_system_message_is_merged(tok):
    with_system = conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "Yo"))
    merged = conv(("user", "Be brief.\n\nHi"), ("assistant", "Yo"))
    assert tok.render_conversation(with_system) == tok.render_conversation(merged)


def test_mask_semantics(tok):
    s = tok.encode_special
    c = {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "python", "text": "1+1"},
                    {"type": "python_output", "text": "2"},
                ],
            },
        ]
    }
    ids, mask = tok.render_conversation(c)
    expected = (
        [(s("<|bos|>"), 0), (s("<|user_start|>"), 0)]
        + [(i, 0) for i in tok.encode("q")]
        + [(s("<|user_end|>"), 0), (s("<|assistant_start|>"), 0)]
        + [(i, 1) for i in tok.encode("a")]
        + [(s("<|python_start|>"), 1)]
        + [(i, 1) for i in tok.encode("1+1")]
        + [(s("<|python_end|>"), 1)]
        + [(s("<|output_start|>"), 0)]
        + [(i, 0) for i in tok.encode("2")]
        + [(s("<|output_end|>"), 0)]
        + [(s("<|assistant_end|>"), 1)]
    )
    assert list(zip(ids, mask)) == expected


@pytest.mark.parametrize("max_tokens", [0, 1, 5, 17, 10_000])
def test_truncation(tok, max_tokens):
    c = RENDERING["conversations"][3]["conversation"]
    full_ids, full_mask = tok.render_conversation(c, max_tokens=10_000)
    ids, mask = tok.render_conversation(c, max_tokens=max_tokens)
    assert ids == full_ids[:max_tokens] and mask == full_mask[:max_tokens]


def test_conversation_ending_with_user_renders(tok):
    ids, mask = tok.render_conversation(conv(("user", "Hi")))
    assert ids == [tok.get_bos_token_id()] + tok.encode("Hi", prepend="<|user_start|>", append="<|user_end|>")
    assert mask == [0] * len(ids)


BAD_CONVERSATIONS = {
    "not a dict": (["hi"], "'messages' list"),
    "no messages key": ({"turns": []}, "'messages' list"),
    "empty": ({"messages": []}, "empty conversation"),
    "system only": (conv(("system", "s")), "user message after the system"),
    "system then assistant": (conv(("system", "s"), ("assistant", "a")), "user message after the system"),
    "non-str system": (conv(("system", ["s"]), ("user", "u")), "system content"),
    "starts with assistant": (conv(("assistant", "a")), "should be 'user'"),
    "two users": (conv(("user", "a"), ("user", "b")), "should be 'assistant'"),
    "unknown role": (conv(("user", "a"), ("tool", "b")), "found 'tool'"),
    "message without content": ({"messages": [{"role": "user"}]}, "'role' and 'content'"),
    "non-str user content": (conv(("user", ["a"])), "user content"),
    "non-str/list assistant content": (conv(("user", "a"), ("assistant", 3)), "str or a list of parts"),
    "unknown part type": (conv(("user", "a"), ("assistant", [{"type": "image", "text": "x"}])), "found 'image'"),
    "part without type": (conv(("user", "a"), ("assistant", [{"text": "x"}])), "found None"),
    "part not a dict": (conv(("user", "a"), ("assistant", ["x"])), "found str"),
    "part missing text": (conv(("user", "a"), ("assistant", [{"type": "python"}])), "str 'text'"),
    "part text not str": (conv(("user", "a"), ("assistant", [{"type": "text", "text": 5}])), "str 'text'"),
}


@pytest.mark.parametrize("name", BAD_CONVERSATIONS)
def test_render_conversation_errors(tok, name):
    bad, message = BAD_CONVERSATIONS[name]
    with pytest.raises(ValueError, match=message):
        tok.render_conversation(bad)


@pytest.mark.parametrize(
    "bad",
    [
        conv(("user", "a")),
        conv(("user", "a"), ("assistant", "b"), ("user", "c")),
        {"messages": []},
        {"turns": []},
        "text",
    ],
)
def test_render_for_completion_needs_final_assistant(tok, bad):
    with pytest.raises(ValueError, match="last message"):
        tok.render_for_completion(bad)


def test_render_for_completion_reports_inner_problems(tok):
    with pytest.raises(ValueError, match="should be 'user'"):
        tok.render_for_completion(conv(("assistant", "a"), ("assistant", "b")))


def test_chat_messages_returns_copy():
    c = conv(("system", "s"), ("user", "u"), ("assistant", "a"))
    messages = chat_messages(c)
    messages[0]["content"] = "changed"
    assert c["messages"][1]["content"] == "u"


# ---------------------------------------------------------------- encode errors and the view


@pytest.mark.parametrize("text", [None, 5, b"bytes", ["ok", 3]])
def test_encode_rejects_non_text(tok, text):
    with pytest.raises(ValueError, match="str or a list of str"):
        tok.encode(text)


@pytest.mark.parametrize(
    "token, message",
    [("<|eot|>", "special token"), (5000, r"\[0, 2048\)"), (-1, r"\[0, 2048\)"), (1.5, "special-token name or an id")],
)
def test_encode_rejects_bad_prepend(tok, token, message):
    with pytest.raises(ValueError, match=message):
        tok.encode("hi", prepend=token)
    with pytest.raises(ValueError, match=message):
        tok.encode("hi", append=token)


def test_mask_view(tok):
    ids, mask = tok.render_conversation(RENDERING["conversations"][3]["conversation"])
    view = tok.visualize(ids, mask)
    page = view._repr_html_()
    assert page.count("<span") == len(ids)
    assert page.count('mask 1"') == sum(mask) and page.count('mask 0"') == len(mask) - sum(mask)
    assert "&lt;|python_start|&gt;" in page
    rows = str(view).split("\n")
    assert "".join(rows[1::3]).split() == [str(m) for m in mask]
    assert all(len(r) <= view.width for r in rows)
    with pytest.raises(ValueError, match="one length"):
        MaskView(["a", "b"], [1, 2], [0])
