"""House rules: notebooks named by their modules, imports down the notebook order, nothing defined twice."""

import ast
import json
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS, LIB, TESTS = ROOT / "nbs", ROOT / "nanorl", ROOT / "tests"


def code_cells(nb_path):
    "The source of every code cell of a notebook."
    cells = json.loads(nb_path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


NUMBERED = r"(\d\d)([a-z]?)_(\w+)"  # 16_train; 15a_step and 15b_config sit between 15 and 16, numbers kept


def numbered_notebooks():
    "The course's notebooks, in their order: `NN_name` and `NNa_name`."
    return sorted(nb for nb in NBS.glob("[0-9][0-9]*_*.ipynb") if re.fullmatch(NUMBERED, nb.stem))


def notebook_modules() -> dict:
    "module name -> its notebook's position (number, letter) in the course, from each `#| default_exp`."
    order = {}
    for nb in numbered_notebooks():
        found = [m.group(1) for src in code_cells(nb) for m in re.finditer(r"^#\| default_exp (\w+)", src, re.M)]
        assert len(found) == 1, f"{nb.name}: expected one `#| default_exp`, found {found}"
        number, letter, name = re.fullmatch(NUMBERED, nb.stem).groups()
        assert name == found[0], f"{nb.name} exports nanorl.{found[0]}: a notebook is named by its module"
        order[found[0]] = (int(number), letter)
    return order


def internal_imports(py_path) -> list[tuple[str, int]]:
    "(module, line) of every nanorl module that a library file imports."
    out = []
    for node in ast.walk(ast.parse(py_path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.append((node.module.split(".")[0], node.lineno))
            elif node.level == 1:
                out += [(alias.name, node.lineno) for alias in node.names]
            elif node.module and node.module.split(".")[0] == "nanorl":
                parts = node.module.split(".")
                out += [(parts[1], node.lineno)] if len(parts) > 1 else [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".")[1], node.lineno) for a in node.names if a.name.startswith("nanorl.")]
    return out


def library_files():
    "nanorl/*.py written by nbdev_export (not the index)."
    return [p for p in sorted(LIB.glob("*.py")) if p.name not in ("__init__.py", "_modidx.py")]


def test_every_module_has_its_notebook():
    "Each library module comes from exactly one numbered notebook named after it."
    order = notebook_modules()
    assert {p.stem for p in library_files()} == set(order), "library modules and notebooks differ"


def test_imports_flow_down_the_notebook_order():
    "A module imports only modules of earlier notebooks."
    order = notebook_modules()
    upward = [
        f"nanorl/{p.name}:{line} imports nanorl.{mod} (notebook {order.get(mod)} >= {order[p.stem]})"
        for p in library_files()
        for mod, line in internal_imports(p)
        if mod not in order or order[mod] >= order[p.stem]
    ]
    assert not upward, "imports against the course order:\n" + "\n".join(upward)


def test_no_import_hidden_in_a_string():
    "No library module names another nanorl module in a string (`nanorl.demo:make_tasks`, importlib paths)."
    hidden = []
    for p in library_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                hidden += [f"{p.name}: {m}" for m in re.findall(r"\bnanorl\.\w+:\w+", node.value)]
    assert not hidden, hidden


def test_the_order_test_can_fail(tmp_path):
    "The import scanner sees relative, absolute and plain imports."
    f = tmp_path / "m.py"
    f.write_text("from .train import x\nfrom nanorl.demo import y\nimport nanorl.loss\nfrom nanorl import engine\n")
    assert [m for m, _ in internal_imports(f)] == ["train", "demo", "loss", "engine"]


# ------------------------------------------------------------------ nothing defined twice

ALLOWED_TWICE = {"main"}  # every runnable script has its own entry point


def top_level_names(source: str) -> list[str]:
    "Top-level functions and classes of a piece of Python (magics skipped; `@patch` methods belong to their class)."
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    patched = lambda n: any(isinstance(d, ast.Name) and d.id == "patch" for d in getattr(n, "decorator_list", []))
    return [n.name for n in tree.body if isinstance(n, kinds) and not n.name.startswith("test_") and not patched(n)]


def definitions() -> dict:
    "name -> where it is defined: library modules, notebook cells that are not exported, test modules."
    where = defaultdict(list)
    for p in library_files():
        for name in top_level_names(p.read_text()):
            where[name].append(f"nanorl/{p.name}")
    for nb in sorted(NBS.glob("*.ipynb")):
        for src in code_cells(nb):
            if re.match(r"^#\|\s*export", src):  # exported: the same definition as the module's
                continue
            for name in top_level_names(src):
                where[name].append(f"nbs/{nb.name}")
    for p in sorted(TESTS.glob("*.py")):
        for name in top_level_names(p.read_text()):
            where[name].append(f"tests/{p.name}")
    return where


def test_nothing_is_defined_twice():
    "No test double or helper is defined twice across nbs/, tests/ and nanorl/."
    twice = {name: places for name, places in definitions().items() if len(places) > 1 and name not in ALLOWED_TWICE}
    assert not twice, "defined more than once:\n" + "\n".join(f"{n}: {p}" for n, p in sorted(twice.items()))
