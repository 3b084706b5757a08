"""bench/gpu.py's dry run: every section of the GPU check runs on the CPU at tiny shapes, so the script cannot rot."""

import json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["device", "correct_gpt", "correct_llama", "decode_gpt", "train_gpt", "decode_llama", "train_llama",
            "torchrun_ddp", "torchrun_fsdp"]
# float32 engine vs trainer log-probs, and cached vs full-forward logits, are two float32 computations of the same
# numbers in different orders (batched decode with a KV cache against one full forward): logits are at most 15 in size
# (GPT's softcap; about 7 in the dry run's models), where float32's spacing is 1e-6 at most, and 2-3 layers of width 64
# and a logsumexp over 512 logits leave a few ulps to a few tens: 2e-5 bounds that (the dry run measures 4-5e-6 on an
# AVX-512 CPU). A real mismatch (a wrong position, mask, temperature or top-k set) shows as 1e-2 and up.
FLOAT32_TOL = 2e-5


def test_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--out", str(out)], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"bench/gpu.py --dry-run failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == SECTIONS
    assert {n: s["error"] for n, s in sections.items() if s["error"] is not None} == {}
    assert report["failed"] == [] and report["dry_run"]
    assert all(s["device"] == report["device"] for s in sections.values()), "every figure is tagged with the device"

    for family in ("gpt", "llama"):
        c = sections[f"correct_{family}"]
        assert c["float32"]["tokens"] > 0 and c["float32"]["gap_max"] < FLOAT32_TOL
        assert c["bfloat16"]["tokens"] > 0 and 0 <= c["bfloat16"]["outside_0.9_1.1"] <= 1
        assert c["kv_cache"]["max_abs"] < FLOAT32_TOL
        assert c["greedy"]["temperature_0"] and c["greedy"]["top_k_1"] and c["greedy"]["tokens"] > 0
        assert c["captured_float32"]["gap_max"] < FLOAT32_TOL and c["greedy"]["captured_temperature_0"]
        for kind in ("rows", "captured"):                 # the masked step stands in for the recorded one on a CPU
            decode = sections[f"decode_{family}"][kind]
            assert set(decode) == {"1", "4"} and all(r["tok_s"] > 0 for r in decode.values())
        assert sections[f"train_{family}"]["tok_s"] > 0 and sections[f"train_{family}"]["mfu"] > 0
    for name in ("torchrun_ddp", "torchrun_fsdp"):
        run = sections[name]
        assert len(run["steps"]) == 2
        assert all(s["t_rollout"] > 0 and s["t_train"] > 0 for s in run["steps"])
        assert "t_rollout" in run and "t_train" in run
    assert sections["torchrun_fsdp"]["process_group"] == "gloo"

    assert "| section | figure | value |" in p.stdout
    for name in SECTIONS:
        assert f"| {name} | status" in p.stdout
    assert report["device"] in p.stdout


def test_decode_steps_dry_run(tmp_path):
    "bench/decode_steps.py times each part of a decode step, plain and masked, on the CPU at tiny shapes."
    out = tmp_path / "decode_steps.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_steps.py"), "--dry-run", "--rows", "1", "3",
                        "--steps", "3", "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"bench/decode_steps.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["dry_run"] and set(report["ms"]) == {"1", "3"}
    parts = {"head (unembed)", "sampler (pick_tokens)", "picks to the host (tolist)", "hidden states, plain",
             "whole step, plain", "hidden states, captured", "whole step, captured"}
    assert all(set(ms) == parts and all(v > 0 for v in ms.values()) for ms in report["ms"].values())
