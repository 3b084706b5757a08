"""bench/gsm8k_eval.py's paired comparison: the gain problem by problem, and the share of it from finishing."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gsm8k_eval  # noqa: E402


def record(label, right, stopped):
    "A record as gsm8k_eval writes it (the fields `paired` reads)."
    return {"label": label, "right": right, "stopped": stopped}


def test_paired_gain_and_its_parts(tmp_path):
    "3 problems x 2 draws: the gain is the mean per-problem change; finishing alone is the stop-rate change x accuracy."
    before = record("base", [[1, 0], [0, 0], [0, 0]], [[1, 1], [1, 0], [0, 0]])     # 1 of 3 stopped replies right
    after = record("rl", [[1, 1], [1, 0], [0, 0]], [[1, 1], [1, 1], [1, 0]])        # 3 of 5 stopped replies right
    out = tmp_path / "evals.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in (record("base", [[0]], [[0]]), before, after)) + "\n")
    c = gsm8k_eval.compare(out, ["base", "rl"])                                    # the newest record of a label
    assert c["before"] == pytest.approx(1 / 6) and c["after"] == pytest.approx(3 / 6)
    assert c["gain"] == pytest.approx(1 / 3) and c["gain_se"] == pytest.approx(((1 / 12) / 3) ** 0.5)
    assert c["right_if_stopped_before"] == pytest.approx(1 / 3) and c["right_if_stopped_after"] == pytest.approx(3 / 5)
    assert c["gain_from_finishing"] == pytest.approx((5 / 6 - 3 / 6) * (1 / 3))


def test_unpaired_or_missing_records_are_refused(tmp_path):
    "Records of different sizes, or a label without per-problem outcomes: one line saying which."
    out = tmp_path / "evals.jsonl"
    out.write_text(json.dumps(record("a", [[1]], [[1]])) + "\n" + json.dumps(record("b", [[1, 0]], [[1, 1]])) + "\n")
    with pytest.raises(SystemExit, match="not paired"):
        gsm8k_eval.compare(out, ["a", "b"])
    with pytest.raises(SystemExit, match="no record .* for c"):
        gsm8k_eval.compare(out, ["a", "c"])


def test_the_first_problems_of_a_longer_record_are_paired(tmp_path):
    "256 problems before, 2 after: the first 2 of the longer record (the same problems, the same draws) are compared."
    out = tmp_path / "evals.jsonl"
    before = record("base", [[0, 0], [1, 0], [1, 1]], [[1, 1], [1, 1], [1, 1]])
    out.write_text(json.dumps(before) + "\n" + json.dumps(record("rl", [[1, 0], [1, 0]], [[1, 1], [1, 1]])) + "\n")
    c = gsm8k_eval.compare(out, ["base", "rl"])
    assert c["problems"] == 2 and c["before"] == pytest.approx(0.25) and c["gain"] == pytest.approx(0.25)
