"Engine and calculator checks against nanochat's fixtures and the no-cache reference (tiny models, a few seconds)."

import ast, hashlib, json, math, random, threading
from pathlib import Path

import pytest, torch
from doubles import BiasedModel, ScriptedModel, load_fixture_model, tool_bias
from rounding import LOGITS_ATOL, assert_greedy_agrees, assert_sampled_agrees
import nanorl.speedups as speedups  # the CPU fast paths: a test switches its model on where it wants them

from nanorl.engine import Engine, use_calculator, row_key, gumbel_noise
from oracles import reference_generate, sample_next_token
from nanorl.model import Sampler

FIX = Path(__file__).parent / "fixtures" / "nanochat"
# ---------------------------------------------------------------- calculator
CALC = json.loads((FIX / "calculator.json").read_text())["cases"]


def _expr(case):  # the fixture's own recipe for long expressions (test data, not model output)
    return case["expr"] if case["expr"] is not None else eval(case["expr_construction"])


@pytest.mark.parametrize("nanochat_format", [True, False])
def test_calculator_matches_nanochat_fixture(nanochat_format):
    for case in CALC:
        e = _expr(case)
        assert hashlib.sha256(e.encode()).hexdigest() == case["expr_sha256"]
        got = use_calculator(e, nanochat_format=nanochat_format, max_seconds=30)   # a loaded machine: no deadline
        if case.get("str_error"):  # nanochat returns an int it cannot print (its Engine crashes); we return None
            assert got is None
        elif not nanochat_format and case["result_type"] == "float" and float(case["repr"]).is_integer():
            assert repr(got) == case["repr"][:-2] and isinstance(got, int), e  # 10.0 -> 10
        else:
            assert (None if got is None else repr(got)) == case["repr"], e


def test_calculator_quirks_and_limits():
    assert use_calculator("'a,b,c'.count(',')") == 4 and use_calculator("'aaa'.count('a', 1)") is None
    assert use_calculator("()") == () and use_calculator("...") is Ellipsis
    assert use_calculator("'1+' * 3") is None and use_calculator("2**3") is None
    assert use_calculator("'a'.zfill(99999999999).count('a')") is None
    assert use_calculator("'abc'.count('a').real") is None
    assert use_calculator("1" * 10_001) is None and use_calculator(b"1+1") is None and use_calculator(None) is None
    # deeper than the recursion limit; ~50 ms on a quiet core: a roomy deadline keeps a loaded machine from failing it
    assert use_calculator("1+" * 2000 + "1", max_seconds=30) == 2001
    assert use_calculator("-".join(["9" * 4000] * 2), max_seconds=30) == 0
    assert use_calculator("1 or 1/0".replace(" or ", "+0*")) is None  # 1+0*1/0 -> ZeroDivisionError
    assert use_calculator("'ab'.count('a') or 'x'.count(1)") == 1  # short-circuit like Python
    assert use_calculator("'x'.count('y') or 'ab'.upper().count('A')") == 1
    assert use_calculator("12/60") == 0.2 and use_calculator("0.2*50") == 10 and use_calculator("0.2*50", True) == 10.0
    assert str(use_calculator("-0.5*2")) == "-1"


def test_string_arithmetic_is_refused():
    "nanochat's string form has no + or *; our evaluator refuses them too (unbounded growth). Never raises."
    from nanorl.calculator import FAILED, _evaluate

    for e in [
        "('ab'+'cd').count('a')",
        "('ab'*3).count('a')",
        "'x'.count('x') + 1",
        "('a'*99999999999).count('a')",
        "'ab'+'cd'",
    ]:
        assert use_calculator(e) is None and use_calculator(e, nanochat_format=True) is None, e
    for e in ["('ab'+'cd').count('a')", "('ab'*3).count('a')", "('a'*99999999999).count('a')", "'ab'+'cd'", "3*'ab'"]:
        assert _evaluate(ast.parse(e, mode="eval"), float("inf")) is FAILED, e  # refused even past the character rules


def test_calculator_in_threads():
    out = {}
    ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, use_calculator(f"{i}*{i}"))) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == {i: i * i for i in range(4)}


def test_calculator_random_arithmetic_against_python():
    rnd = random.Random(1)

    def gen(d=0):
        if d > 4 or rnd.random() < 0.3:
            return rnd.choice(["3", "0", "17", "2.5", ".5", "1,234", "(8)", "-6", "1."])
        return gen(d + 1) + rnd.choice(["+", " - ", "*", "/", "//"]) + gen(d + 1)

    for _ in range(1000):
        e = gen()
        try:
            want = eval(e.replace(",", ""), {"__builtins__": {}})  # oracle on our own generated strings
        except ZeroDivisionError:
            want = None
        got = use_calculator(e, nanochat_format=True)
        assert got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got)), e


# ---------------------------------------------------------------- sampling
def test_sample_next_token_contract():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 5.0]])
    assert sample_next_token(logits, None, temperature=0.0).tolist() == [[1], [0]]
    out = sample_next_token(logits, torch.Generator().manual_seed(0), temperature=1.0, top_k=1)
    assert out.shape == (2, 1) and out.tolist() == [[1], [0]]
    with pytest.raises(ValueError):
        sample_next_token(logits, None, temperature=-1.0)


def _unmix32(y):
    "The inverse of `mix32` (each xor-shift undoes itself; each odd multiplier has an inverse mod 2^32)."
    inv = pow(0x45D9F3B, -1, 2**32)
    y = (y >> 16) ^ y
    y = (y * inv) & 0xFFFFFFFF
    y = (y >> 16) ^ y
    y = (y * inv) & 0xFFFFFFFF
    return (y >> 16) ^ y

def test_gumbel_noise_finite_at_the_top_of_its_range():
    "The candidate whose 24 random bits are all ones gets finite noise, the largest; the others are unchanged."
    from nanorl.engine import mix32, step_key
    keys, step = torch.tensor([row_key(3, 0)]), 5
    row = int(mix32(keys ^ step_key(step))[0])
    assert all(mix32(_unmix32(x)) == x for x in (0, 1, row, 0xFFFFFFFF))
    tops = [_unmix32(b) ^ row for b in (0xFFFFFFFF, 0xFFFFFE00, 0xFFFFFD00)]     # bits >> 8: 2^24 - 1, - 2, - 3
    token_hash = torch.tensor([tops + [7, 11]])
    noise = gumbel_noise(keys, step, token_hash)[0]
    assert torch.isfinite(noise).all()
    # the top value gets -log(-log(1 - 2^-24)) = 16.64; the next two share 1 - 2^-23 (float32's spacing below 1)
    assert abs(noise[0].item() - 16.6355) < 1e-3 and noise[0] > noise[1] == noise[2] > noise[3:].max()

def test_gumbel_noise_matches_softmax():
    logits = torch.tensor([1.5, 0.5, 0.0, -2.0])
    keys = torch.tensor([row_key(3, j) for j in range(40_000)])
    picks = (logits + gumbel_noise(keys, 0, torch.arange(4).expand(len(keys), 4))).argmax(-1)
    assert torch.allclose(torch.bincount(picks, minlength=4) / len(keys), torch.softmax(logits, -1), atol=0.01)


# ---------------------------------------------------------------- engine vs nanochat fixtures
def logits_before(model, prefix, tokens):
    "The model's softcapped float32 logits before each of `tokens` after `prefix`, one full forward: (len(tokens), V)."
    with torch.no_grad():
        ids = torch.tensor([list(prefix) + list(tokens)])
        return model.unembed(model.hidden(ids))[0, len(prefix) - 1 : -1].float()


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("gen", ["head", "oct2025"])
def test_greedy_equals_nanochat(gen, fast, tok):
    """Greedy sequences, masks and stream columns as nanochat's Engine gave them (on another machine), token for token
    up to a near tie (two logits within 2 x LOGITS_ATOL) that the two computations' rounding may break differently;
    past it the prefixes differ and nothing more is compared (tests/rounding.py)."""
    ref = torch.load(FIX / f"reference_{gen}.pt", weights_only=True)
    model = speedups.use_fast_paths(load_fixture_model(gen), fast)  # the plain engine, and the CPU fast paths
    eng = Engine(model, tok)
    prefix = [int(t) for t in ref["engine_prefix"]]
    seqs, masks = eng.generate_batch(prefix, num_samples=2, max_tokens=24, temperature=0.0, top_k=None, seed=42)
    greedy = json.loads((FIX / f"reference_{gen}.json").read_text())["engine"]["greedy"]
    stream, margins = greedy["stream_columns"], greedy["top1_minus_top2_margin_row0_nocache"]
    cols = [c for c, _ in eng.generate(prefix, num_samples=2, max_tokens=24, temperature=0.0)]
    P = len(prefix)
    for j in range(2):
        theirs = [c[j] for c in stream]  # row j as nanochat generated it, its stop token (if any) included
        logits = logits_before(model, prefix, theirs)  # (len(theirs), V): ours, before each of their tokens
        want, want_masks = [int(t) for t in ref["engine_greedy_results"][j]], ref["engine_greedy_masks"][j]
        n = assert_greedy_agrees(seqs[j][P:], theirs, logits, eng.stop_tokens, LOGITS_ATOL)
        assert want[P:] == theirs[: len(want) - P]  # the fixture's sequence is its stream up to the stop
        assert seqs[j][:P] == want[:P] and masks[j][: P + n] == [int(m) for m in want_masks[: P + n]]
        ours_stream = [c[j] for c in cols]  # our stream goes on past a stop (finished rows keep decoding)
        stop = next((i for i, t in enumerate(ours_stream) if t in eng.stop_tokens), len(ours_stream))
        assert_greedy_agrees(ours_stream[:stop], theirs, logits, eng.stop_tokens, LOGITS_ATOL)
        # nanochat's top-two margins here are all at least 0.02, far from a tie: every token agrees on any CPU
        assert min(margins[: len(theirs)]) > 2 * LOGITS_ATOL and n == len(theirs) == 24
        wrong = [int(logits[m].argmin()) for m in range(len(theirs))]  # clearly non-maximal picks are caught
        for m in (0, 11, 23):
            with pytest.raises(AssertionError, match="not a tie"):
                assert_greedy_agrees(seqs[j][P : P + m] + [wrong[m]], theirs, logits, eng.stop_tokens, LOGITS_ATOL)


def test_tool_script_replay(tok):
    script = json.loads((FIX / "engine_tool_script.json").read_text())
    for case in script["cases"]:
        model = ScriptedModel(case["scripts"], tok.get_vocab_size(), tok.encode_special("<|assistant_end|>"))
        eng = Engine(model, tok, nanochat_format=True)
        kw = dict(num_samples=2, max_tokens=script["max_tokens"], temperature=0.0)
        assert eng.generate_batch(script["prefix"], **kw) == (case["results"], case["masks"]), case["name"]
        assert [[c, m] for c, m in eng.generate(script["prefix"], **kw)] == case["stream"], case["name"]
    # default formatting forces "10" where nanochat forces "10.0"
    case = script["cases"][0]
    seqs, _ = Engine(
        ScriptedModel(case["scripts"], tok.get_vocab_size(), tok.encode_special("<|assistant_end|>")), tok
    ).generate_batch(script["prefix"], 2, script["max_tokens"], temperature=0.0)
    assert "<|output_start|>10<|output_end|>" in tok.decode(seqs[0])


# ---------------------------------------------------------------- engine vs the no-cache reference
@pytest.fixture(scope="module")
def tool_model(tok):
    return BiasedModel(load_fixture_model("head"), tool_bias(tok))


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.render_for_completion(
        {"messages": [{"role": "user", "content": "What is 6 times 7?"}, {"role": "assistant", "content": ""}]}
    )


@pytest.mark.parametrize("temperature,top_k", [(1.0, 50), (0.8, None), (0.0, None)])
def test_engine_equals_no_cache_reference(tok, tool_model, prompt, temperature, top_k):
    """The KV-cache engine gives the no-cache reference's tokens and masks, forced tool output included, up to each
    row's first near tie: the two compute the logits in other kernels and orders (a cache against full forwards),
    the noise is the same (tests/rounding.py, assert_sampled_agrees)."""
    eng = Engine(tool_model, tok)
    kw = dict(num_samples=6, max_tokens=32, temperature=temperature, top_k=top_k, seed=1)
    got = eng.generate_batch(prompt, **kw)
    ref = reference_generate(Engine(tool_model, tok), prompt, **kw)
    assert assert_sampled_agrees(eng, [prompt], got, ref, **kw).count(None) >= 4  # near ties are rare: most rows whole
    if temperature > 0:
        assert got.stats["tool_calls"] > 0 and got.stats["forced_tokens"] > 0


def test_sampled_agreement_catches_what_rounding_cannot_explain(tok, tool_model, prompt):
    """assert_sampled_agrees accepts a difference only as a near tie of the two picks' scores: it fails on a clearly
    lower-scored token, a stop where the row clearly goes on, a token outside the top k, other forced output or other
    masks; under a loose enough tolerance the same difference passes as a tie."""
    eng = Engine(tool_model, tok)
    kw = dict(num_samples=6, max_tokens=32, temperature=0.8, top_k=None, seed=1)
    seqs, masks = eng.generate_batch(prompt, **kw)
    P = len(prompt)
    r = max(range(6), key=lambda r: len(seqs[r]))  # the longest row
    n = masks[r].index(1, P + 3) - P  # a sampled token, not the first
    with torch.no_grad():
        L = tool_model(torch.tensor([seqs[r][: P + n]]))[0, -1]  # (V,) softcapped
    scores = L / 0.8 + gumbel_noise(torch.tensor([row_key(1, r)]), n, eng.token_hash(L.numel(), L.device)[None])[0]
    assert int(scores.argmax()) == seqs[r][P + n]  # the scores the helper recomputes are the engine's

    def check(r, row, row_masks, **over):  # ours against ours with row r replaced
        theirs = ([row if i == r else s for i, s in enumerate(seqs)],
                  [row_masks if i == r else m for i, m in enumerate(masks)])
        return assert_sampled_agrees(eng, [prompt], (seqs, masks), theirs, **{**kw, **over})

    assert check(r, seqs[r], masks[r]) == [None] * 6
    wrong = seqs[r][: P + n] + [int(scores.argmin())], masks[r][: P + n + 1]
    with pytest.raises(AssertionError, match="not a tie"):
        check(r, *wrong)
    assert check(r, *wrong, atol=100.0)[r] == n  # the same difference is a tie under a loose tolerance
    assert scores.max() - max(scores[t] for t in eng.stop_tokens) > 1.0  # no stop near the pick
    with pytest.raises(AssertionError, match="not a tie"):  # stopped here
        check(r, seqs[r][: P + n], masks[r][: P + n])
    outside = int(L.argmin())  # far below the 50 largest
    with pytest.raises(AssertionError, match=f"{outside} could not be picked"):
        check(r, seqs[r][: P + n] + [outside], masks[r][: P + n + 1], top_k=50)
    flipped = list(masks[r])
    flipped[P + n] = 0
    with pytest.raises(AssertionError, match="masks"):
        check(r, seqs[r], flipped)
    r, j = next((i, j) for i in range(6) for j in range(P, len(seqs[i])) if masks[i][j] == 0)  # a forced tool output
    with pytest.raises(AssertionError, match="forced output differs"):
        check(r, seqs[r][:j] + [seqs[r][j] + 1], masks[r][: j + 1])


def test_retirement_and_batching_change_nothing(tok, tool_model, prompt):
    prompts = [prompt, prompt[:5], tok.encode("Total:", prepend="<|bos|>")]
    eng = Engine(tool_model, tok)
    many = eng.generate_many(prompts, num_samples=4, max_tokens=24, top_k=50, seed=[1, 2, 3])
    stats = dict(many.stats)
    assert stats["rows_retired"] > 0 and stats["forward_rows"] < stats["rows"] * stats["decode_steps"]
    # The noise is integer arithmetic and per row, so batching cannot change it; but the forwards of another batch
    # composition (rows retired at other steps, one prompt at a time) are matrix products of other row counts, which
    # may take other kernels and round differently: compared up to each row's first near tie (tests/rounding.py).
    kw = dict(num_samples=4, max_tokens=24, top_k=50, seed=[1, 2, 3])
    eng.compact_fraction = 10.0  # never compact: finished rows stay in the batch
    assert_sampled_agrees(eng, prompts, many, eng.generate_many(prompts, **kw), **kw)
    eng.compact_fraction = 0.0  # compact at every finish
    assert_sampled_agrees(eng, prompts, many, eng.generate_many(prompts, **kw), **kw)
    singles = [eng.generate_many([p], 4, 24, top_k=50, seed=s) for p, s in zip(prompts, [1, 2, 3])]
    one_by_one = [s for q, _ in singles for s in q], [m for _, ms in singles for m in ms]
    assert_sampled_agrees(eng, prompts, many, one_by_one, **kw)
    # one run's own counts: exact (a row's stop token is counted as its finish)
    new_tokens = sum(len(s) for s in many[0]) - 4 * sum(map(len, prompts))
    assert stats["sampled_tokens"] + stats["forced_tokens"] + stats["finished_rows"] == new_tokens


def test_determinism_min_new_tokens_and_errors(tok, tool_model, prompt):
    eng = Engine(tool_model, tok)
    a = eng.generate_batch(prompt, 3, 16, seed=7)
    assert a == eng.generate_batch(prompt, 3, 16, seed=7) and a != eng.generate_batch(prompt, 3, 16, seed=8)
    seqs, _ = eng.generate_batch(prompt, 3, 20, seed=7, min_new_tokens=20)
    assert all(len(s) == len(prompt) + 20 for s in seqs)  # stop tokens suppressed
    assert eng.generate_batch(prompt, 2, 0) == ([prompt, prompt], [[0] * len(prompt)] * 2)
    for bad in [dict(num_samples=0), dict(max_tokens=10 * 256), dict(temperature=-1.0)]:
        with pytest.raises(ValueError):
            eng.generate_batch(prompt, **{"num_samples": 1, "max_tokens": 4, **bad})
    with pytest.raises(ValueError):
        eng.generate_many([prompt, []], 1, 4)
    with pytest.raises(ValueError):
        eng.generate_many([prompt, prompt], 1, 4, seed=[1])


# ---------------------------------------------------------------- seeds, tool-call stats, chunked noise, min_new_tokens
def test_seeds_may_be_any_integer_type(tok, tool_model, prompt):
    np = pytest.importorskip("numpy")
    eng, prompts = Engine(tool_model, tok), [prompt, prompt[:5]]
    # Every comparison below is of two calls with the same prompts, seeds and batch, on the same code path: the same
    # arithmetic in the same order, bit-identical on one machine whatever its kernels, so exact.
    want = eng.generate_many(prompts, 2, 6, seed=[3, 4])
    assert eng.generate_many(prompts, 2, 6, seed=np.int64(3)) == want
    assert eng.generate_many(prompts, 2, 6, seed=[np.int64(3), np.uint16(4)]) == want
    assert eng.generate_many(prompts, 2, 6, seed=np.array([3, 4])) == want
    assert eng.generate_batch(prompt, 2, 6, seed=np.int32(3)) == eng.generate_batch(prompt, 2, 6, seed=3)
    assert list(eng.generate(prompt, 2, 6, seed=np.int64(3))) == list(eng.generate(prompt, 2, 6, seed=3))
    reference = Engine(tool_model, tok)  # the reference against itself (against the engine: rounding may differ)
    want = reference_generate(reference, prompt, 2, 6, seed=3)
    assert reference_generate(reference, prompt, 2, 6, seed=np.int64(3)) == want
    for bad in [True, 3.0, "3", b"3", None, [3, 4.0], [3, True], [3], np.float64(3), {"a": 1}]:
        with pytest.raises(ValueError, match="seed must be an integer"):
            eng.generate_many(prompts, 2, 6, seed=bad)
    with pytest.raises(ValueError, match="seed must be an integer"):
        list(eng.generate(prompt, 2, 6, seed=np.float32(1)))


def test_stream_counts_only_tool_calls_of_running_rows(tok):
    sp = tok.encode_special
    end, py_start, py_end = sp("<|assistant_end|>"), sp("<|python_start|>"), sp("<|python_end|>")
    first, word = tok.encode("The")[0], tok.encode(" so")[0]
    scripts = [
        [first, end, py_start, *tok.encode("2+2"), py_end, word, word, py_start, *tok.encode("1/0"), py_end, word],
        [
            first,
            word,
            py_start,
            *tok.encode("6*7"),
            py_end,
            word,
            py_start,
            *tok.encode("1/0"),
            py_end,
            *[word] * 8,
            end,
        ],
    ]
    eng = Engine(ScriptedModel(scripts, tok.get_vocab_size(), end), tok)
    stream = list(eng.generate([tok.get_bos_token_id()], num_samples=2, max_tokens=40, temperature=0.0))
    cols = [c for c, _ in stream]
    assert cols[1][0] == end and sum(c[0] == py_end for c in cols) == 2  # row 0 finished, then made two calls
    assert any(m[0] == 0 for _, m in stream)  # ... whose output is still forced
    gen = eng.generate_batch([tok.get_bos_token_id()], num_samples=2, max_tokens=40, temperature=0.0)
    assert (gen.stats["tool_calls"], gen.stats["tool_errors"]) == (2, 1)  # only row 1's calls


def test_full_vocab_noise_is_chunked_and_chunks_change_nothing(tok, tool_model, prompt, monkeypatch):
    import nanorl.engine as engine

    shapes = []

    def recording_noise(keys, step, token_hash):
        out = gumbel_noise(keys, step, token_hash)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(engine, "gumbel_noise", recording_noise)
    eng, prompts = Engine(tool_model, tok), [prompt, prompt[:5], tok.encode("Total:", prepend="<|bos|>")]
    kw = dict(num_samples=6, max_tokens=16, temperature=0.9, top_k=None, seed=[4, 5, 6])
    whole = eng.generate_many(prompts, **kw)
    V = shapes[0][1]
    assert V == tool_model.config.vocab_size and shapes[0][0] == 18  # small batch: one chunk
    for rows in [1, 4]:  # 18 rows: 4 leaves a short last chunk
        monkeypatch.setattr(engine, "NOISE_CHUNK_ELEMENTS", rows * V)
        shapes.clear()
        assert eng.generate_many(prompts, **kw) == whole
        assert max(r for r, _ in shapes) == rows and any(r < rows for r, _ in shapes) == (rows > 1)
    monkeypatch.setattr(engine, "NOISE_CHUNK_ELEMENTS", 1 << 21)
    big = torch.randn(256, 65536)  # nanochat's vocabulary at the RL batch
    shapes.clear()
    Engine(tool_model, tok).sample_full_vocab(big, torch.arange(256), 0, 1.0)
    assert max(r * v for r, v in shapes) <= 1 << 21 and sum(r for r, _ in shapes) == 256


def test_min_new_tokens_holds_stops_back_on_full_vocab_path(tok, tool_model, prompt):
    bias = torch.zeros(tok.get_vocab_size())
    stops = [tok.encode_special("<|assistant_end|>"), tok.get_bos_token_id()]
    bias[stops] = 40.0
    model = BiasedModel(tool_model.base, bias)
    kw = dict(num_samples=8, max_tokens=16, temperature=1.0, top_k=None, seed=11)
    free = [len(s) - len(prompt) for s in Engine(model, tok).generate_batch(prompt, **kw)[0]]
    assert min(free) == 0  # the bias really stops rows
    eng = Engine(model, tok)
    gen = eng.generate_batch(prompt, min_new_tokens=6, **kw)
    seqs, masks = gen
    held = [len(s) - len(prompt) for s in seqs]
    assert min(held) >= 6 and max(held) < 16 and gen.stats["finished_rows"] == 8
    cols = [c for c, _ in eng.generate(prompt, min_new_tokens=6, **kw)]
    assert not any(t in stops for c in cols[:6] for t in c) and any(t in stops for t in cols[6])
    ref = reference_generate(Engine(model, tok), prompt, min_new_tokens=6, **kw)  # no cache: rounding may differ
    assert_sampled_agrees(eng, [prompt], (seqs, masks), ref, min_new_tokens=6, **kw)


# ---------------------------------------------------------------- the packed head
def test_packed_head_is_used_for_long_calls_and_matches_unembed(tok, monkeypatch):
    model = speedups.use_fast_paths(load_fixture_model("head"))
    h = torch.randn(5, model.config.n_embd)
    monkeypatch.setattr(speedups, "onednn_pays", lambda out_features, in_features: True)  # the tiny shapes too
    with torch.no_grad(), speedups.packed_weights(model):
        assert model.lm_head.pack is not None
        packed = model.unembed(h, softcap=False)
    with torch.no_grad():
        assert torch.allclose(packed, model.unembed(h, softcap=False), atol=1e-4)
    packs, real = [], speedups.PackedLinear
    def count(weight, bias=None, onednn=True):
        packs.append(tuple(weight.shape))
        return real(weight, bias, onednn)

    monkeypatch.setattr(speedups, "PackedLinear", count)
    eng, prompt = Engine(model, tok), tok.encode("Total:", prepend="<|bos|>")
    eng.generate_batch(prompt, 2, speedups.PACK_MIN_TOKENS - 1, seed=1)
    assert packs == []  # too short to pay for packing
    eng.generate_batch(prompt, 2, speedups.PACK_MIN_TOKENS, seed=1)
    assert packs.count((model.config.vocab_size, model.config.n_embd)) == 1  # the head, once per generate call


def test_long_calls_decode_inside_the_packed_weights_block(tok, monkeypatch):
    model = speedups.use_fast_paths(load_fixture_model("head"))
    mlp = model.transformer.h[0].mlp.c_fc
    monkeypatch.setattr(speedups, "onednn_pays", lambda out_features, in_features: True)  # the tiny shapes too
    seen = []
    real = Engine.pick_tokens
    monkeypatch.setattr(
        Engine, "pick_tokens", lambda self, *a, **k: seen.append(mlp.pack is not None) or real(self, *a, **k)
    )
    eng, prompt = Engine(model, tok), tok.encode("Total:", prepend="<|bos|>")
    packed = eng.generate_batch(prompt, 2, 12, seed=3)
    assert seen and all(seen) and mlp.pack is None  # packed during the call, dropped after it
    with torch.backends.mkldnn.flags(enabled=False):  # the same call on F.linear: another kernel, rounding may differ
        plain = eng.generate_batch(prompt, 2, 12, seed=3)
    assert_sampled_agrees(eng, [prompt], packed, plain, num_samples=2, max_tokens=12, seed=3)  # up to a near tie
    seen.clear()
    eng.generate_batch(prompt, 2, 4, seed=3)
    assert seen and not any(seen)  # too short: no block
    seen.clear()
    Engine(speedups.use_fast_paths(model, on=False), tok).generate_batch(prompt, 2, 12, seed=3)
    assert seen and not any(seen)  # switched off: the plain loop, no block


def test_pick_tokens_leaves_its_input_alone(tok, tool_model):
    eng = Engine(tool_model, tok)
    raw = torch.randn(3, tok.get_vocab_size())
    before = raw.clone()
    eng.pick_tokens(raw, torch.arange(3), 0, Sampler(1.0, 50), suppress_stop=True)
    eng.pick_tokens(raw, torch.arange(3), 0, Sampler(1.0), suppress_stop=True)
    assert torch.equal(raw, before)


# ---------------------------------------------------------------- the stop token: kept by generate_many, one `cut`
def test_stopped_rows_end_with_their_stop_token_cut_rows_have_none(tok, tool_model, prompt):
    """generate_many keeps a sampled stop token last in its row, mask 1, its log-prob the sampler's; a row without one
    is `cut`, at max_tokens; generate_batch gives the same rows without the stop token, as nanochat's rows are."""
    T, k, P = 0.9, 50, len(prompt)
    bias = tool_bias(tok)
    bias[tok.encode_special("<|assistant_end|>")] += 2.0  # about half the rows stop within 24 tokens
    model = BiasedModel(tool_model.base, bias)
    eng = Engine(model, tok)
    gen = eng.generate_many([prompt], 8, 24, temperature=T, top_k=k, seed=1)
    for seq, mask, lps, cut in zip(gen.sequences, gen.masks, gen.logprobs, gen.cut):
        stops = [j for j, t in enumerate(seq[P:]) if t in eng.stop_tokens]
        assert len(lps) == len(seq) - P
        if cut:
            assert stops == [] and len(seq) - P == 24
            continue
        assert stops == [len(seq) - P - 1] and mask[-1] == 1
        with torch.no_grad():
            z = model(torch.tensor([seq[:-1]]))[0, -1]  # (V,): softcapped logits before the stop token
        want = torch.log_softmax(Sampler(T, k).logits(z), -1)[seq[-1]].item()
        assert abs(lps[-1] - want) < 1e-4, (lps[-1], want)
    assert 0 < gen.cut.count(False) < 8 and gen.stats["forced_tokens"] > 0, "rows that stop, are cut, call the tool"
    assert gen.stats["finished_rows"] == gen.cut.count(False)
    batch = eng.generate_batch(prompt, 8, 24, temperature=T, top_k=k, seed=1)
    ends = [len(s) - (not c) for s, c in zip(gen.sequences, gen.cut)]
    assert batch == ([s[:e] for s, e in zip(gen.sequences, ends)], [m[:e] for m, e in zip(gen.masks, ends)])
    assert not any(t in eng.stop_tokens for s in batch.sequences for t in s[P:])  # nanochat's rows: no stop token
    assert batch.cut == gen.cut and [len(lp) for lp in batch.logprobs] == [e - P for e in ends]


def test_temperature_and_top_k_are_checked_in_one_place(tok, tool_model, prompt):
    "A bad temperature or top-k raises the same error, from the same function, in Sampling, the engine and the CLI."
    from nanorl.config import Config, validate
    from nanorl.rollout import Sampling

    eng = Engine(tool_model, tok)
    for bad, fragment in ((dict(temperature=-1.0), "temperature must be >= 0"), (dict(temperature=float("nan")),
                          "temperature must be >= 0"), (dict(top_k=-2), "top_k must be >= 0")):
        raised = []
        for make in (lambda: Sampling(**bad), lambda: eng.generate_many([prompt], 1, 2, **bad),
                     lambda: list(eng.generate(prompt, 1, 2, **bad)), lambda: validate(Config(**bad))):
            with pytest.raises(ValueError) as e:
                make()
            tb = e.tb
            while tb.tb_next:
                tb = tb.tb_next
            assert tb.tb_frame.f_code.co_name == "check_sampling", tb.tb_frame.f_code  # the one check raised it
            raised.append(str(e.value))
        assert raised[0] == raised[1] == raised[2] and fragment in raised[0], raised
        assert raised[3] == "--" + raised[0].replace("top_k", "top-k"), raised  # the CLI's names the flag
    s = Sampling(temperature=0.7, top_k=0)
    assert s.sampler == Sampler(0.7) and s.engine_args()["top_k"] is None  # top-k 0: the whole vocabulary, once
    assert Sampling(temperature=0.0).sampler is None and Sampling(temperature=0.0).engine_args()["temperature"] == 0
