"""The course as a reader meets it: references name the right notebook, outputs are saved, budgets hold."""

import ast
import json
import re
import subprocess
import sys

from test_layout import LIB, NBS, ROOT, TESTS, library_files, notebook_modules, numbered_notebooks

NUMBERED = numbered_notebooks()
STEMS = {nb.stem for nb in NUMBERED}
SIDE_ROOMS = {"01a_chat", "01b_optim", "03_llama", "04_checkpoint", "04a_rundir", "05_calculator", "08_tasks",
              "11a_prefix", "13_speedups", "13a_capture", "13b_kernel", "14_scale", "15_vllm_engine", "18_real",
              "15b_config", "15c_start"}
SHOWS = re.compile(r"\bprint\(|\bdisplay\(|\bplt\.|\.plot\(")
MAX_CELL_WORDS, MAX_NOTEBOOK_WORDS, MAX_TOTAL_WORDS = 300, 3000, 25000
MAX_LINE, MAX_PARAMS = 120, 8   # module length: split by concern (README, "Writing code here"), no line cap


def cells(nb_path, kind):
    "The cells of one kind ('markdown' or 'code', None: all) of a notebook, each as a dict with its source joined."
    found = json.loads(nb_path.read_text())["cells"]
    return [{**c, "source": "".join(c["source"])} for c in found if kind in (None, c["cell_type"])]


def words(text: str) -> int:
    return len(text.split())


# ------------------------------------------------------------------ references to notebooks

# "notebook 11", "notebooks 09 and 10", "(13)", "`11_loss`": each must name a notebook of the course map
REFERENCE = re.compile(r"\bnotebooks? (\d{1,2})\b(?!_)|\bnotebooks? \d{1,2}(?:,| and| or) (\d{1,2})\b(?!_)"
                       r"|\((\d{2})\)|\b(\d{2}[a-z]?_[a-z][a-z_]*[a-z])\b")


def bad_references(text: str, where: str) -> list[str]:
    "References in `text` that name no notebook, or a number without its name."
    bad = []
    for m in REFERENCE.finditer(text):
        number = next(g for g in m.groups() if g)
        if "_" in number:
            if number not in STEMS and re.match(r"\d{2}[a-z]?_", number) and not number.startswith("00"):
                bad.append(f"{where}: `{number}` is no notebook")
            continue
        line = text[: m.start()].count("\n") + 1
        bad.append(f"{where}:{line}: '{m.group(0)}' gives a number without the notebook's name; write `NN_name`")
    return bad


def prose_of_library_and_tests():
    "(where, text) of every docstring and comment of nanorl/ and tests/."
    for p in [*library_files(), *sorted(TESTS.glob("*.py"))]:
        if p.name == "test_course.py":
            continue  # its examples are bad references on purpose
        source = p.read_text()
        comments = "\n".join(m.group(0) for m in re.finditer(r"#.*", source))
        strings = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)]
        yield str(p.relative_to(ROOT)), comments + "\n" + "\n".join(strings)


def test_references_name_the_notebook_of_the_course_map():
    "Every reference to a notebook in the notebooks' prose, the README and docstrings is a `NN_name` that exists."
    bad = []
    for nb in sorted(NBS.glob("*.ipynb")):
        for i, c in enumerate(cells(nb, "markdown")):
            bad += bad_references(c["source"], f"{nb.name} markdown cell {i}")
        for i, c in enumerate(cells(nb, "code")):
            comments = "\n".join(m.group(0) for m in re.finditer(r"#(?!\|).*|\"[^\"\n]*\"", c["source"]))
            bad += bad_references(comments, f"{nb.name} code cell {i}")
    bad += bad_references((ROOT / "README.md").read_text(), "README.md")
    for where, text in prose_of_library_and_tests():
        bad += bad_references(text, where)
    assert not bad, "references that name no notebook of the course map:\n" + "\n".join(bad[:60])


def test_reference_checker_can_fail():
    "A bare number, a stale name and a good name are told apart."
    assert bad_references("see notebook 11 for this", "x") and bad_references("the demo (13) shows", "x")
    assert bad_references("as `12_fast_cpu` does", "x")
    assert not bad_references("as `11_loss` shows, with 16 rows (16 of them)", "x")


def test_side_rooms_say_so():
    "Each side room's first prose line after its title says it is a side room; the README lists the same ones."
    for nb in NUMBERED:
        first = cells(nb, "markdown")[0]["source"]
        body = [ln for ln in first.splitlines() if ln.strip() and not ln.startswith(("#", ">"))]
        second = cells(nb, "markdown")[1]["source"] if not body else ""
        opening = (body[0] if body else second.strip().splitlines()[0]).lstrip("*_ ")
        assert opening.startswith("Side room") == (nb.stem in SIDE_ROOMS), f"{nb.name}: '{opening[:80]}'"
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(\d\d[a-z]?_\w+)` \| `\w+` \| ([^|]+) \|", readme, flags=re.M))
    assert {n for n, room in rows.items() if room.strip() == "side room"} == SIDE_ROOMS


# ------------------------------------------------------------------ outputs and budgets


def test_cells_that_show_something_have_saved_outputs():
    "Every code cell of a numbered notebook that prints or plots has a saved output, unless it cannot run in CI."
    missing = []
    for nb in NUMBERED:
        for i, c in enumerate(cells(nb, "code")):
            if SHOWS.search(c["source"]) and not c.get("outputs") and "#| eval: false" not in c["source"]:
                missing.append(f"{nb.name} code cell {i}: {c['source'].splitlines()[0][:80]}")
    assert not missing, "cells that show something but have no saved output:\n" + "\n".join(missing)


def test_prose_budgets():
    "No markdown cell over 300 words, no numbered notebook over 3,000, all of nbs/ at most 25,000."
    total, over = 0, []
    for nb in sorted(NBS.glob("*.ipynb")):
        counts = [words(c["source"]) for c in cells(nb, "markdown")]
        total += sum(counts)
        over += [f"{nb.name} cell {i}: {n} words" for i, n in enumerate(counts) if n > MAX_CELL_WORDS]
        if nb in NUMBERED and sum(counts) > MAX_NOTEBOOK_WORDS:
            over.append(f"{nb.name}: {sum(counts)} words")
    assert not over, "\n".join(over)
    assert total <= MAX_TOTAL_WORDS, f"nbs/ holds {total} words of prose (budget {MAX_TOTAL_WORDS})"


def words_before(found) -> tuple[str, int] | None:
    "(notebook, prose words read before it) of the first cell along the README's RL path for which `found(cell)`."
    path = re.search(r"\*\*The RL path\*\*(.*?)\n\n", (ROOT / "README.md").read_text(), re.S).group(1)
    read = 0
    for stem in ["index", *re.findall(r"`(\d\d[a-z]?_\w+)`", path)]:
        for c in cells(NBS / f"{stem}.ipynb", None):
            if c["cell_type"] == "code" and found(c):
                return stem, read
            read += words(c["source"]) if c["cell_type"] == "markdown" else 0
    return None


def test_first_gradient_early_on_the_rl_path():
    "Along the README's RL path, a cell backpropagating sampled completions comes within 2,500 prose words."
    def gradient(c):
        backward = ".backward()" in c["source"] or "learn(" in c["source"]          # `15a_step`'s learn: backward
        return backward and ("rollout(" in c["source"] or "sample(" in c["source"])
    first = words_before(gradient)
    assert first, "no cell on the RL path runs .backward() on sampled completions"
    assert first[1] <= 2500, f"the first gradient is in {first[0]}, after {first[1]} words of prose"


def test_first_answer_early_on_the_rl_path():
    "Along the README's RL path, a cell printing a real model's sampled answers comes within 3,000 prose words."
    def answers(c):
        shown = "".join("".join(o.get("text", "")) for o in c.get("outputs", []))
        return "sample(" in c["source"] and "completion_text(" in c["source"] and bool(shown)
    first = words_before(answers)
    assert first, "no cell on the RL path prints sampled answers"
    assert first[1] <= 3000, f"the first sampled answer is in {first[0]}, after {first[1]} words of prose"


def test_modules_lines_and_parameters():
    "No line over 120 characters, no function over 8 parameters."
    bad = []
    for p in library_files():
        lines = p.read_text().splitlines()
        bad += [f"{p.name}:{i + 1}: {len(ln)} characters" for i, ln in enumerate(lines)
                if len(ln) > MAX_LINE and not ln.startswith("__all__ = [")]   # nbdev_export wraps `__all__` itself
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs] if x.arg not in ("self", "cls")]
                if len(names) + bool(a.vararg) + bool(a.kwarg) > MAX_PARAMS:
                    bad.append(f"{p.name}:{node.lineno} {node.name} takes {len(names)} parameters")
    assert not bad, "\n".join(bad)


def test_importing_the_speed_room_changes_nothing():
    "Importing every module (the speed room included) leaves the plain methods of the model and engine in place."
    code = (
        "import nanorl.model as m, nanorl.llama as l, nanorl.engine as e\n"
        "before = [m.GPT.forward, m.Linear.forward, l.Llama.forward, l.Llama.unembed, e.Engine.decode_steps]\n"
        "import nanorl.speedups, nanorl.train, nanorl.demo\n"
        "after = [m.GPT.forward, m.Linear.forward, l.Llama.forward, l.Llama.unembed, e.Engine.decode_steps]\n"
        "print(sum(a is not b for a, b in zip(before, after)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "0", "importing nanorl.speedups replaced a method of the plain path"


def test_every_module_is_in_the_course_map():
    "The course map's modules are the library's (so a renamed room cannot hide from these checks)."
    assert set(notebook_modules()) == {p.stem for p in library_files()} and LIB.is_dir()


def test_notebook_lines_fit():
    "Every line of every notebook cell (markdown and code, outputs aside) is at most 120 characters."
    long = [f"{nb.name} {kind} cell {i}: {len(ln)} characters" for nb in sorted(NBS.glob("*.ipynb"))
            for kind in ("markdown", "code") for i, c in enumerate(cells(nb, kind))
            for ln in c["source"].splitlines() if len(ln) > MAX_LINE]
    assert not long, "\n".join(long)


def test_printed_source_is_the_library_source():
    "A cell that prints a function's source (`inspect.getsource`) shows today's code: its saved output is re-derived."
    import inspect

    import nanorl.step

    stale = []
    for nb in NUMBERED:
        for i, c in enumerate(cells(nb, "code")):
            names = re.findall(r"print\(inspect\.getsource\((\w+)\)\)", c["source"])
            if not names:
                continue
            want = "".join(inspect.getsource(getattr(nanorl.step, n)) + "\n" for n in names)
            saved = "".join(o.get("text", "") if isinstance(o.get("text"), str) else "".join(o.get("text", []))
                            for o in c.get("outputs", []))
            if saved != want:
                stale.append(f"{nb.name} code cell {i}: re-run it")
    assert not stale, "\n".join(stale)


# ------------------------------------------------------------------ saved outputs stay true (tests/notebooks.py)


def test_stale_output_checker_tells_shapes_apart():
    "A cell whose printed words or lines changed is stale; new digits alone are not; `# output: varies` is skipped."
    from notebooks import VARIES, stale_cells

    def cell(text, source="print(x)"):
        return {"cell_type": "code", "source": source, "outputs": [{"output_type": "stream", "name": "stdout",
                                                                     "text": text}], "_ran": True}
    saved = [cell("step 1 loss 0.512 in 3.2 s\nmean reward +0.25\n")]
    assert not stale_cells(saved, [cell("step 1 loss -0.6 in 12.25 s\nmean reward 1e-05\n")])
    assert stale_cells(saved, [cell("step 1 loss 0.512\nmean reward +0.25\n")])        # a timing no longer printed
    assert stale_cells(saved, [cell("step 1 loss 0.512 in 3.2 s\n")])                   # a line fewer
    assert stale_cells(saved, [cell("step 1 loss 0.512 stop 0.9 in 3.2 s\nmean reward +0.25\n")])   # a new column
    varies = [cell("answer: 12*8 = 96\n", source=f"print(answer)  {VARIES}")]
    assert not stale_cells(varies, [cell("answer: 12+8 is twenty\n")])
    not_run = [{**cell("anything"), "_ran": False}]
    assert not stale_cells(saved, not_run)
