"""The import graph keeps the layers of docs/architecture.md (Layers): a module of txl_dist imports only from its
own layer or below, at module level, inside a function or through a package's table of names imported on first use
(`txl_dist.lazy_names`), and no two modules import each other in a circle. And the rule on function-local imports
(docs/architecture.md, Rules): each says why it is there, few of them, and the commands' --help imports neither
torch nor DeepSpeed."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from benchmarks.startup import COMMANDS as STARTUP_COMMANDS
from benchmarks.startup import help_run

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    (
        "txl_dist.fileio",
        "txl_dist.output_folders",
        "txl_dist.exit_status",
        "txl_dist.word_scan",
        "txl_dist.lazy_names",
        "txl_dist.run_paths",
        "txl_dist.checkpoint_paths",
        "txl_dist.config",
        "txl_dist.deepspeed_internals",
    ),
    ("txl_dist.model", "txl_dist.tokenizer", "txl_dist.data"),
    ("txl_dist.evaluation", "txl_dist.inference", "txl_dist.rendezvous"),
    ("txl_dist.supervision", "txl_dist.checkpoints", "txl_dist.plan"),
    ("txl_dist.training", "txl_dist.export"),
    ("txl_dist.convert", "txl_dist"),
    ("txl_dist.downstream", "txl_dist.plot", "txl_dist.plot_records"),
]
"""Lowest first: docs/architecture.md, Layers. Layer N is LAYERS[N - 1]. ``txl_dist`` is the package's own API
(its __init__). Each folder of txl_dist lies in one layer, whole."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted((ROOT / "txl_dist").rglob("*.py"))}


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest layer name that MODULE is or lies under."""
    best, index = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, index = len(name), i
    if index is None:
        raise AssertionError(f"{module}: in no layer of tests/test_architecture.py LAYERS")
    return index


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported txl_dist module, line, at module level) for each import in PATH; ``from a import b`` counts as
    a.b where that is a module, else as a."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name == "txl_dist" or name.startswith("txl_dist."):
                found.append((name, node.lineno, id(node) in top))
    found += [(name, line, False) for name, line in lazy_table_imports(tree)]
    return found


def lazy_table_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, line) for each home in the table a package hands `txl_dist.lazy_names.lazy_names` (a dict literal,
    given in the call or assigned to a module-level name): imported on first use, so checked like an import
    inside a function."""
    tables = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_names" and len(node.args) == 2:
            table = node.args[1]
            table = tables.get(table.id) if isinstance(table, ast.Name) else table
            if not isinstance(table, ast.Dict):
                raise AssertionError(
                    f"line {node.lineno}: lazy_names is given no dict literal: the test cannot read it"
                )
            found += [(value.value, value.lineno) for value in table.values if isinstance(value, ast.Constant)]
    return found


def test_every_module_lies_in_a_layer():
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except AssertionError as error:
            unplaced.append(str(error))
    assert MODULES and not unplaced, "\n".join(unplaced) or "no module found under txl_dist/"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_from_its_layer_or_below(module):
    own = layer_of(module)
    upward = [
        f"{MODULES[module].relative_to(ROOT)}:{line} imports {name} ({LAYERS[layer_of(name)][0]} lies above "
        f"{LAYERS[own][0]})"
        for name, line, _ in imports_of(MODULES[module])
        if name != module and layer_of(name) > own and not (module == "txl_dist" and name.startswith("txl_dist."))
    ]
    assert not upward, "\n".join(upward)


def circles_in(graph: dict[str, set[str]]) -> list[str]:
    """Each import circle of GRAPH (module -> the modules it imports), written a -> b -> a."""
    done: set[str] = set()
    circles: list[str] = []

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            circle = trail[trail.index(module) :] + [module]
            # A package's __init__ importing its own submodules, which import the package, is not a circle of
            # dependencies (Python finishes the package first); any other is.
            if not all(
                circle[0].startswith(m + ".") or m.startswith(circle[0] + ".") or m == circle[0] for m in circle
            ):
                circles.append(" -> ".join(circle))
            return
        if module in done:
            return
        for name in sorted(graph.get(module, ())):
            visit(name, trail + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return circles


def test_no_circle_among_module_level_imports():
    graph = {
        module: {name for name, _, top in imports_of(path) if top and name in MODULES and name != module}
        for module, path in MODULES.items()
    }
    circles = circles_in(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """The checks can fail: an upward import names its file and line, and a circle is found."""
    assert layer_of("txl_dist.model.transformer") < layer_of("txl_dist.training.trainer")
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from txl_dist.training import trainer\n", encoding="utf-8")
    assert imports_of(source) == [("txl_dist.training.trainer", 4, False)]
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("elsewhere.module")
    circle = {"txl_dist.model.a": {"txl_dist.model.b"}, "txl_dist.model.b": {"txl_dist.model.a"}}
    assert circles_in(circle) == ["txl_dist.model.a -> txl_dist.model.b -> txl_dist.model.a"]
    package = {"txl_dist.model": {"txl_dist.model.a"}, "txl_dist.model.a": {"txl_dist.model"}}
    assert circles_in(package) == []


# --- Function-local imports (docs/architecture.md, Rules) ----------------------------------------------------------

COMMAND_FOLDERS = ("txl_dist", "data_tools", "launchers")
REASONS = ("# lazy:", "# optional dependency")
REASON = re.compile(r"#\s*(lazy:|optional dependency)")
MOST_LOCAL_IMPORTS = 22
"""The budget: 22 since TensorFlow (the tf extra, for the authors' released models) and the model reader that
launchers/train.py hands the start-up (it lies above training) joined the 20 before them."""


def local_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, whether it gives its reason) of each import statement inside a function of PATH. Imports that follow
    each other in one body form a block; the block gives its reason in a comment beginning with one of REASONS,
    between the statement before the block and its first import, or on one of its imports' lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[tuple[int, bool]] = []

    def reason_in(first: int, last: int) -> bool:  # lines first..last, 1-based
        return any(REASON.search(line) for line in lines[first - 1 : last])

    def check_body(body: list[ast.stmt], start: int) -> None:
        index = 0
        while index < len(body):
            if not isinstance(body[index], (ast.Import, ast.ImportFrom)):
                index += 1
                continue
            block_end = index
            while block_end + 1 < len(body) and isinstance(body[block_end + 1], (ast.Import, ast.ImportFrom)):
                block_end += 1
            before = body[index - 1].end_lineno + 1 if index > 0 else start
            block = body[index : block_end + 1]
            why = reason_in(before, block[-1].end_lineno)
            found.extend((node.lineno, why) for node in block)
            index = block_end + 1

    def visit(node: ast.AST, in_function: bool) -> None:
        previous = None  # the statements or handlers before an else: or finally: block
        for name in ("body", "handlers", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if not (isinstance(body, list) and body):
                continue
            if in_function and isinstance(body[0], ast.stmt):
                check_body(body, node.lineno + 1 if previous is None else previous[-1].end_lineno + 1)
            previous = body
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse("\n".join(lines)), False)
    return sorted(found)


def _python_files() -> list[Path]:
    return [path for folder in COMMAND_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]


def test_every_function_local_import_says_why_and_there_are_few():
    """An import inside a function hides a dependency from readers and tools: allowed only where it keeps a
    command's --help fast (``# lazy: ...``, with what it keeps out) or guards an optional dependency
    (``# optional dependency``), and at most MOST_LOCAL_IMPORTS in txl_dist, data_tools and launchers."""
    everywhere = [(path, line, why) for path in _python_files() for line, why in local_imports(path)]
    unexplained = [f"{path.relative_to(ROOT)}:{line}" for path, line, why in everywhere if not why]
    assert not unexplained, "function-local imports without '# lazy:' or '# optional dependency':\n" + "\n".join(
        unexplained
    )
    assert len(everywhere) <= MOST_LOCAL_IMPORTS, "\n".join(f"{p.relative_to(ROOT)}:{n}" for p, n, _ in everywhere)


def test_the_local_import_check_sees_an_unexplained_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n\n"
        "def f():\n    import json\n\n"  # 4: no reason
        "def g():\n    # lazy: --help stays fast\n    import torch\n\n    from torch import (\n        nn,\n    )\n"
        "    x = 1\n    import math\n\n"  # 8, 10: one block with its reason; 14: after a statement, none
        "def h():\n    import matplotlib  # optional dependency\n\n"  # 17
        "class C:\n    def m(self):\n        try:\n            pass\n        except ImportError:\n"
        "            # lazy: a handler's own block\n            import re\n"  # 25
        "        else:\n            import sys\n",  # 27: the handler's comment is not the else block's
        encoding="utf-8",
    )
    assert local_imports(source) == [
        (4, False),
        (8, True),
        (10, True),
        (14, False),
        (17, True),
        (25, True),
        (27, False),
    ]


def test_the_lazy_name_tables_are_read_as_imports(tmp_path):
    """A package's `lazy_names` table counts as its imports (so an upward one is caught), and every module that
    imports txl_dist.lazy_names hands it a table the check can read."""
    source = tmp_path / "p.py"
    source.write_text(
        "from txl_dist.lazy_names import lazy_names\n\n"
        '_HOMES = {"Trainer": "txl_dist.training.trainer"}\n\n'
        "__getattr__, __dir__ = lazy_names(__name__, _HOMES)\n",
        encoding="utf-8",
    )
    assert ("txl_dist.training.trainer", 3, False) in imports_of(source)
    users = [m for m, path in MODULES.items() if "txl_dist.lazy_names" in {n for n, _, _ in imports_of(path)}]
    assert users, "no package uses txl_dist.lazy_names"
    for module in users:
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        assert lazy_table_imports(tree), f"{module} imports lazy_names but hands it no table the check can read"


@pytest.mark.parametrize("command", [target for _, target in STARTUP_COMMANDS])
def test_a_commands_help_imports_neither_torch_nor_deepspeed(command):
    """--help answers without importing torch or DeepSpeed (seconds each): a heavy import at the top of a module on
    the help path fails here. `benchmarks/startup.py` runs the same probe over the same commands and times it."""
    _, report = help_run(sys.executable, command, dict(os.environ))
    assert report == {"status": 0, "imported": []}, f"{command} --help: {report}"


PACKAGES = sorted(name for name, path in MODULES.items() if name.count(".") == 1 and path.name == "__init__.py")


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_states_the_layer_the_table_gives_it(package):
    """Each package's docstring names its layer ("Layer N"), the one LAYERS and docs/architecture.md give it."""
    path = MODULES[package]
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    stated = {int(number) for number in re.findall(r"\bLayer (\d+)\b", text)}
    assert stated, f"{path.relative_to(ROOT)}: its docstring names no layer ('Layer N: ...')"
    assert stated == {layer_of(package) + 1}, (
        f"{path.relative_to(ROOT)} says Layer {sorted(stated)}; tests/test_architecture.py LAYERS puts {package} in "
        f"layer {layer_of(package) + 1}"
    )


def test_the_documented_layers_are_the_layers_the_graph_is_checked_against():
    """docs/architecture.md (Layers): its table names each layer's modules as LAYERS does, row for row."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", section, re.MULTILINE)
    documented = {int(number): set(re.findall(r"`([a-z_.]+)`", names)) for number, names in rows}
    expected = {
        number: {name.removeprefix("txl_dist.") for name in names} for number, names in enumerate(LAYERS, start=1)
    }
    assert documented == expected
