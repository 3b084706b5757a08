"Tests for nanorl.tasks: nanochat parity on the fixtures, full-data checks, loading paths, numeric mode, Arithmetic."

import json, os, re, subprocess, sys, time, warnings
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from nanorl.rewards import RewardShaping, Task, conversation_text, extract_answer, reference_answer
from nanorl.tasks import (GSM8K, Arithmetic, Difficulty, answer_to_parts, check_row, find_local_gsm8k,
                          gsm8k_conversation, load_gsm8k_rows)

FIX = Path(__file__).parent / "fixtures"
FULL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"
GSM = json.loads((FIX / "nanochat" / "gsm8k_reward.json").read_text())
needs_full = pytest.mark.skipif(not (FULL / "train.jsonl").is_file(), reason="full GSM8K files absent")


def fixture_rows():
    return [{"question": e["question"], "answer": e["answer"]} for e in GSM["examples"]]


# ---------------------------------------------------------------- nanochat parity (fixtures)
def test_conversions_equal_nanochat():
    for e in GSM["examples"]:
        assert gsm8k_conversation(e["question"], e["answer"]) == e["conversation"]
        assert reference_answer(e["conversation"]) == e["reference_answer"]


@pytest.mark.parametrize("case", GSM["cases"], ids=lambda c: f"{c['row']}-{c['kind']}")
def test_cases_equal_nanochat(case):
    task = GSM8K.from_rows(fixture_rows(), seed=None)
    conv = task[case["row"]]
    assert extract_answer(case["completion"]) == case["extracted"]
    assert task.evaluate(conv, case["completion"]) == bool(case["evaluate"])
    r = task.reward(conv, case["completion"])
    assert r == case["reward"] and isinstance(r, float)


def test_rendering_equals_fixture_ids():
    tokmod = pytest.importorskip("nanorl.tokenizer")
    tok = tokmod.Tokenizer.from_directory(FIX / "nanochat" / "tokenizer")
    task = GSM8K(split="train", data_dir=FIX / "gsm8k", seed=None)
    for i, e in enumerate(GSM["examples"]):
        conv = task[i]  # fixture slice = first 64 lines of train.jsonl, the fixture rows are its first 20
        ids, mask = tok.render_conversation(conv)
        assert list(ids) == e["render_conversation_ids"] and list(mask) == e["render_conversation_mask"]
        assert list(tok.render_for_completion(conv)) == e["render_for_completion_ids"]


def test_fixture_slice_loads_in_nanochat_order():
    import numpy as np

    t = GSM8K(split="test", data_dir=FIX / "gsm8k")
    lines = (FIX / "gsm8k" / "test.jsonl").read_text().splitlines()
    order = np.random.default_rng(42).permutation(len(lines))
    assert len(t) == 32 and t.malformed == []
    assert [t.row_index(i) for i in range(len(t))] == order.tolist()
    assert t[0]["messages"][0]["content"] == json.loads(lines[order[0]])["question"]


# ---------------------------------------------------------------- full data
@needs_full
@pytest.mark.parametrize("split,n", [("train", 7473), ("test", 1319)])
def test_full_data_shuffle_and_no_malformed(split, n):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a malformed-row warning would fail the test
        t = GSM8K(split=split, data_dir=FULL)
    assert len(t) == n and t.malformed == []
    assert [t.row_index(i) for i in range(100)] == GSM["shuffle_seed42"][f"{split}_n{n}_first100"]
    lines = (FULL / f"{split}.jsonl").read_text().splitlines()
    numeric = GSM8K(split=split, data_dir=FULL, nanochat_compat=False)
    for i in range(len(t)):
        conv, row = t[i], json.loads(lines[t.row_index(i)])
        assert conv["messages"][0]["content"] == row["question"]
        parts = conv["messages"][1]["content"]
        assert "".join(p["text"] if p["type"] != "python" else "" for p in parts).count("####") == 1
        ref = reference_answer(conv)
        assert ref == row["answer"].split("#### ")[-1].replace(",", "")  # reference = the file's answer line
        assert t.reward(conv, f"So:\n#### {ref}") == 1.0 and numeric.reward(conv, f"#### {ref}.") == 1.0
        assert t.reward(conv, f"#### {int(ref) + 1}") == 0.0


# ---------------------------------------------------------------- loading paths
def _write_parquet(rows, path):
    import pyarrow as pa, pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_local_layouts(tmp_path, monkeypatch):
    rows = [json.loads(l) for l in (FIX / "gsm8k" / "train.jsonl").read_text().splitlines()]
    _write_parquet(
        rows[:40], tmp_path / "nanochat" / "task_data" / "openai--gsm8k" / "main" / "train" / "00000.parquet"
    )
    _write_parquet(
        rows[40:], tmp_path / "nanochat" / "task_data" / "openai--gsm8k" / "main" / "train" / "00001.parquet"
    )
    _write_parquet(rows, tmp_path / "hub" / "main" / "train-00000-of-00001.parquet")
    _write_parquet(rows[:5], tmp_path / "hub" / "socratic" / "train-00000-of-00001.parquet")
    want = [gsm8k_conversation(r["question"], r["answer"]) for r in rows]
    for d in [FIX / "gsm8k", tmp_path / "nanochat", tmp_path / "hub"]:
        t = GSM8K(data_dir=d, seed=None)
        assert [t[i] for i in range(len(t))] == want, d
    assert len(GSM8K(subset="socratic", data_dir=tmp_path / "hub")) == 5
    monkeypatch.setenv("NANORL_GSM8K_DIR", str(tmp_path / "hub"))
    assert len(GSM8K(seed=None)) == 64
    monkeypatch.delenv("NANORL_GSM8K_DIR")
    # nanochat's own cache is found without any setting
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "nanochat"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert GSM8K(seed=None)[63] == want[63]
    assert find_local_gsm8k(tmp_path / "nanochat", "main", "test") is None


def test_nanochat_cache_follows_base_dir(tmp_path, monkeypatch):
    "nanochat's cache is found under base_dir, else a non-empty $NANOCHAT_BASE_DIR, else ~/.cache/nanochat."
    rows = [json.loads(l) for l in (FIX / "gsm8k" / "test.jsonl").read_text().splitlines()]
    cache = Path("task_data") / "openai--gsm8k" / "main" / "test" / "00000.parquet"
    _write_parquet(rows, tmp_path / "explicit" / cache)
    _write_parquet(rows[:3], tmp_path / "env" / cache)
    _write_parquet(rows[:5], tmp_path / "home" / ".cache" / "nanochat" / cache)
    monkeypatch.delenv("NANORL_GSM8K_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "env"))
    assert len(GSM8K(split="test", base_dir=tmp_path / "explicit")) == 32  # explicit beats the environment
    assert load_gsm8k_rows("main", "test", base_dir=str(tmp_path / "explicit"))[0] == rows
    assert len(GSM8K(split="test")) == 3
    monkeypatch.setenv("NANOCHAT_BASE_DIR", "")  # empty: the default, not the cwd
    monkeypatch.chdir(tmp_path / "env")
    assert len(GSM8K(split="test")) == 5


def test_save_to_disk_layout(tmp_path):
    import datasets

    rows = [json.loads(l) for l in (FIX / "gsm8k" / "test.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "main" / "test"))
    assert GSM8K(split="test", data_dir=tmp_path, seed=None)[3] == gsm8k_conversation(**rows[3])


def test_hub_path_uses_datasets(monkeypatch, tmp_path):
    import datasets

    calls = []
    rows = [json.loads(l) for l in (FIX / "gsm8k" / "test.jsonl").read_text().splitlines()]

    def fake_load_dataset(name, subset, split):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list([dict(r, extra=1) for r in rows])

    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "NANORL_GSM8K_DIR"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    t = GSM8K(split="test")
    assert calls == [("openai/gsm8k", "main", "test")] and len(t) == 32 and t.source == "hub:openai/gsm8k"

    def broken(*a, **k):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", broken)
    with pytest.raises(FileNotFoundError, match="NANORL_GSM8K_DIR"):
        GSM8K(split="test")


def test_offline_fails_fast_in_a_fresh_process(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if k not in ("NANORL_GSM8K_DIR", "HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE")
    }
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), NANOCHAT_BASE_DIR=str(tmp_path))
    code = (
        "import time; from nanorl.tasks import GSM8K\nt0 = time.perf_counter()\n"
        "try: GSM8K('main', 'train')\nexcept FileNotFoundError as e: print(round(time.perf_counter() - t0, 3)); print(e)\n"
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    total = time.perf_counter() - t0
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines, out.stderr
    assert float(lines[0]) < 2.0 and total < 30
    assert "data_dir" in out.stdout and "NANORL_GSM8K_DIR" in out.stdout and "train.jsonl" in out.stdout


def test_bad_arguments():
    with pytest.raises(ValueError, match="split must be"):
        load_gsm8k_rows("main", "val", data_dir=FIX / "gsm8k")
    with pytest.raises(ValueError, match="looked for"):
        GSM8K(split="train", data_dir=FIX / "nanochat")
    with pytest.raises(ValueError, match="completion must be a str"):
        GSM8K.from_rows(fixture_rows()).evaluate(GSM["examples"][0]["conversation"], None)


# ---------------------------------------------------------------- malformed rows
def test_malformed_rows_counted_dropped_or_refused():
    rows = fixture_rows()[:4] + [
        {"question": "q", "answer": "no marker"},
        {"question": "q", "answer": "<<1+1=2>>2 >> 3\n#### 2"},
        {"question": "q", "answer": "x\n#### ten"},
        {"question": "q", "answer": "x\n#### 10."},
        {"question": "q", "answer": "x\n#### 1\n#### 2"},
        {"question": 3, "answer": "#### 1"},
    ]
    with pytest.warns(UserWarning, match="6 of 10 rows are malformed"):
        t = GSM8K.from_rows(rows, seed=None)
    assert len(t) == 4 and [i for i, _ in t.malformed] == [4, 5, 6, 7, 8, 9]
    assert [t[i] for i in range(4)] == [gsm8k_conversation(**r) for r in rows[:4]]
    with pytest.raises(ValueError, match="malformed"):
        GSM8K.from_rows(rows, strict=True)
    # a conversation without a reference answer is refused, never rewarded (nanochat would give None == None -> 1)
    conv = gsm8k_conversation("q", "no marker")
    with pytest.raises(ValueError, match="reference answer"):
        t.reward(conv, "no answer either")


# ---------------------------------------------------------------- numeric mode
@pytest.mark.parametrize(
    "text,want",
    [
        ("#### 10.", "10"),
        ("#### 10.00", "10"),
        ("#### 1e3", "1000"),
        ("#### 2.5E-1", "0.25"),
        ("#### 4 #### 5", "5"),
        ("#### 5\nrecheck: #### 6", "6"),
        ("#### $1,234.50", "1234.5"),
        ("#### -$3", "-3"),
        ("####10", "10"),
        ("####\n7", "7"),
        ("#### 1,000,000", "1000000"),
        ("#### 12,34", None),
        ("#### 5-3", None),
        ("#### 5 x 3", None),
        ("#### 5 apples", "5"),
        ("#### 7. Done", "7"),
        ("#### abc", None),
        ("####", None),
        ("#### -", None),
        ("#### 00", "0"),
        ("#### 1e999", "1E+999"),
        ("#### 1e9999999", None),
        ("#### 1e-9999999", None),
        ("#### 0e99999999", "0"),
        ("#### " + "9" * 1200, None),
    ],
)
def test_numeric_extraction(text, want):
    assert extract_answer(text, nanochat_compat=False) == want


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**12), 10**12), st.sampled_from(["{n}", "{n:,}", "{n}.", "{n}.00", "{n:,}.0", "${n}"]))
def test_numeric_mode_reads_formats_of_an_integer(n, fmt):
    text = f"Work.\n#### {fmt.format(n=n) if not fmt.startswith('$') or n >= 0 else '-$' + str(-n)}"
    assert extract_answer(text, nanochat_compat=False) == str(n)


def test_numeric_mode_reward_on_fixture_rows():
    t = GSM8K.from_rows(fixture_rows(), seed=None, nanochat_compat=False)
    conv = t[15]  # reference 448000
    for good in ["#### 448,000", "#### 448000.00", "#### 448000.", "####448000", "#### 4.48e5", "#### 1\n#### 448000"]:
        assert t.reward(conv, good) == 1.0, good
    for bad in ["#### 448001", "#### 448000\n#### 1", "no answer", "#### 448,00"]:
        assert t.reward(conv, bad) == 0.0, bad


# ---------------------------------------------------------------- task interface and shaping
def test_slicing_and_indexing():
    t = GSM8K.from_rows(fixture_rows(), seed=None, start=2, stop=15, step=4)
    assert len(t) == 4 and t[1] == gsm8k_conversation(**fixture_rows()[6]) and t[-1] == t[3] and t.row_index(3) == 14
    with pytest.raises(IndexError):
        t[4]
    with pytest.raises(IndexError):
        t.row_index(4)
    assert t.row_index(-1) == 14 and t[-4] == t[0]
    with pytest.raises(ValueError, match="step >= 1"):
        GSM8K.from_rows(fixture_rows(), step=0)


def test_shaping_terms():
    conv = GSM["examples"][0]["conversation"]
    plain = GSM8K.from_rows(fixture_rows())
    assert not plain.shaping_on and plain.reward_terms(conv, "#### 72") == {"correct": 1.0}
    s = GSM8K.from_rows(fixture_rows(), shaping=RewardShaping(format_weight=0.2, length_weight=1.0, length_budget=10))
    assert s.reward_terms(conv, "#### 72") == {"correct": 1.0, "format": 0.2, "length": 0.0}
    terms = s.reward_terms(conv, "x" * 15 + "#### 7")  # 21 chars: 11 over a budget of 10 -> capped at -1
    assert terms == {"correct": 0.0, "format": 0.2, "length": -1.0} and s.reward(
        conv, "x" * 15 + "#### 7"
    ) == pytest.approx(-0.8)
    assert s.reward_terms(conv, "x" * 5 + "#### 72")["length"] == pytest.approx(-0.2)  # 12 chars, 2 over


def test_custom_reward_by_subclass():
    class Partial(GSM8K):
        def reward_terms(self, conversation, completion):
            terms = super().reward_terms(conversation, completion)
            return dict(terms, tool=0.1 * ("<<" in completion))

    t = Partial.from_rows(fixture_rows())
    assert t.reward(GSM["examples"][0]["conversation"], "<<1+1=2>>\n#### 72") == pytest.approx(1.1)


# ---------------------------------------------------------------- Arithmetic
def _solve(question):
    "Recompute an Arithmetic answer from the words of its question."
    value = None
    for s in re.split(r"(?<=\.) ", question):
        nums = [int(x) for x in re.findall(r"\d+", s)]
        if s.startswith("How many"):
            continue
        if value is None:
            value = nums[0] * nums[1] if len(nums) == 2 else nums[0]
        elif "more" in s:
            value += nums[0]
        elif "times" in s:
            value *= nums[0]
        else:
            value -= nums[0]
    return value


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(num_steps=3, max_value=50),
        dict(num_steps=1, ops="+"),
        dict(ops="*", max_answer=99),
        dict(num_steps=(2, 4), ops="+-", min_value=0),
    ],
)
def test_arithmetic_answers_are_right(kw):
    t = Arithmetic(n=300, seed=3, difficulty=Difficulty(**kw))
    lo, hi = t.num_steps
    assert len(t) == 300
    for i in range(len(t)):
        conv = t[i]
        q, parts = conv["messages"][0]["content"], conv["messages"][1]["content"]
        calls = [p for p in parts if p["type"] == "python"]
        assert lo <= len(calls) <= hi and set("".join(c["text"] for c in calls)) <= set("0123456789" + t.ops)
        outs = [p for p in parts if p["type"] == "python_output"]
        for c, o in zip(calls, outs):
            assert str(eval(c["text"])) == o["text"]
        ans = _solve(q)
        assert reference_answer(conv) == str(ans) and 0 <= ans <= t.max_answer
        assert t.reward(conv, f"#### {ans}") == 1.0 and t.reward(conv, f"#### {ans + 1}") == 0.0


def test_arithmetic_is_deterministic_and_short():
    a, b = Arithmetic(n=200, seed=7), Arithmetic(n=200, seed=7)
    assert [a[i] for i in range(200)] == [b[i] for i in range(200)]
    assert [a[i] for i in range(20)] != [Arithmetic(n=20, seed=8)[i] for i in range(20)]
    assert max(len(p["question"].split()) for p in a.problems) <= 25
    code = "from nanorl.tasks import Arithmetic; print(Arithmetic(n=5, seed=7).problems[4]['answer'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == a.problems[4]["answer"]  # same across processes (no salted hashes)


def test_arithmetic_splits_and_corpus():
    train, test = Arithmetic(n=1000, seed=0), Arithmetic(n=200, seed=0, split="test")
    assert not {p["question"] for p in train.problems} & {p["question"] for p in test.problems}
    texts = list(test.texts())
    assert len(texts) == 200 and texts[0] == conversation_text(test[0]) and "<<" not in texts[0]
    assert texts[0].startswith(test.problems[0]["question"] + "\n")


def test_arithmetic_bad_knobs():
    for kw, msg in [
        (dict(difficulty=Difficulty(ops="+/")), "ops"),
        (dict(difficulty=Difficulty(num_steps=0)), "num_steps"),
        (dict(difficulty=Difficulty(min_value=5, max_value=2)), "min_value"),
        (dict(split="dev"), "split"),
        (dict(n=50, difficulty=Difficulty(ops="*", min_value=40, max_value=40, max_answer=100)), "could not make"),
    ]:
        with pytest.raises(ValueError, match=msg):
            Arithmetic(**kw)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("#### 0123456789.,-+eE$x*/\n ab")), max_size=40))
def test_extraction_never_raises(text):
    for mode in (True, False):
        out = extract_answer("####" + text, nanochat_compat=mode)
        assert out is None or isinstance(out, str)
