"""The real SmolLM2-135M-Instruct against transformers: logits, greedy generation and its chat template.

Needs the model folder that `python bench/smollm2.py` builds (offline-readable, about 540 MB in float32): set
NANORL_SMOLLM2 to it, or build it at the default place. Skipped without it (CI has none).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from doubles import FIXTURES, gsm8k_chat_conversations, smollm2_folder
from nanorl.engine import Engine
from nanorl.chat import ChatTokenizer, template_messages
from nanorl.llama import load_llama
from nanorl.tasks import GSM8K
from rounding import LOGITS_ATOL, assert_greedy_agrees

FOLDER = smollm2_folder()
pytestmark = pytest.mark.skipif(
    not (FOLDER / "config.json").exists(),
    reason=f"no SmolLM2 folder at {FOLDER}: run `python bench/smollm2.py` " f"or set NANORL_SMOLLM2",
)


@pytest.fixture(scope="module")
def models():
    "(nanorl Llama, transformers model, ChatTokenizer, transformers tokenizer), float32 on the CPU."
    transformers.utils.logging.disable_progress_bar()
    ours = load_llama(FOLDER).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    return ours, hf, ChatTokenizer.from_directory(FOLDER), transformers.AutoTokenizer.from_pretrained(FOLDER)


@pytest.fixture(scope="module")
def gsm8k_prompt(models):
    "A GSM8K test question rendered with SmolLM2's template, ready for the assistant's answer."
    rows = [json.loads(line) for line in (FIXTURES / "gsm8k" / "test.jsonl").read_text().splitlines()]
    return models[2].render_for_completion(GSM8K.from_rows(rows, split="test")[0])


def test_logits_match_transformers(models, gsm8k_prompt):
    "float32 logits of a chat prompt within 1e-4 of transformers', at every position."
    ours, hf = models[:2]
    x = torch.tensor([gsm8k_prompt])
    with torch.no_grad():
        a, b = ours(x), hf(x).logits.float()
    assert a.shape == b.shape == (1, len(gsm8k_prompt), ours.config.vocab_size)
    assert (a - b).abs().max().item() < LOGITS_ATOL


def test_greedy_generation_matches_transformers(models, gsm8k_prompt):
    """Greedy decoding with the engine gives transformers' generate(do_sample=False) token for token (32 tokens), up to
    a near tie (two logits within 2 x LOGITS_ATOL) that the two implementations' rounding may break differently; past
    it the prefixes differ and nothing more is compared (tests/rounding.py)."""
    ours, hf, tok = models[:3]
    engine = Engine(ours, tok)
    seqs, masks = engine.generate_batch(gsm8k_prompt, num_samples=1, max_tokens=32, temperature=0.0)
    mine = seqs[0][len(gsm8k_prompt) :]
    with torch.no_grad():
        out = hf.generate(torch.tensor([gsm8k_prompt]), do_sample=False, max_new_tokens=32)
        ref = out[0, len(gsm8k_prompt) :].tolist()
        logits = hf(out).logits[0, len(gsm8k_prompt) - 1 : -1].float()  # (len(ref), V): before each of its tokens
    assert len(mine) >= 8
    assert_greedy_agrees(mine, ref, logits, engine.stop_tokens, LOGITS_ATOL)  # we stop at the end of turn
    assert masks[0][len(gsm8k_prompt) :] == [1] * len(mine)


def test_chat_template_matches_transformers(models):
    "render_for_completion and render_conversation give apply_chat_template's ids on 50 GSM8K conversations."
    tok, hf_tok = models[2:]
    convs = gsm8k_chat_conversations(50)  # every 4th with a system message of its own, the others SmolLM's
    for conv in convs:
        messages = template_messages(conv)
        want = hf_tok.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)["input_ids"]
        assert tok.render_for_completion(conv) == want
        assert tok.render_conversation(conv)[0] == hf_tok.apply_chat_template(messages, tokenize=True)["input_ids"]
