"""The package's imports follow the layers drawn in docs/concepts.rst ("The layers"), and no files import each other in a circle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "nip_like"
#: Imports allowed to run back up, each to be named in the docs below the drawing: (importer, imported), by module.
BACK_UP: set[tuple[str, str]] = set()
#: A layer line of the drawing: its number, its name (words, one space apart), then its rooms two spaces apart.
LAYER_LINE = re.compile(r"^\s+(\d+)  +(\S+(?: \S+)*)  +(\S.*)$")


def drawn_layers() -> dict[str, int]:
    """Each room of the drawing (``cli``, ``sweeps/``) and its layer's number."""
    text = (REPO_ROOT / "docs" / "concepts.rst").read_text()
    section = text.split("The layers\n----------\n", 1)[1].split("\n.. code-block:: text\n", 1)[1]
    block = []
    for line in section.lstrip("\n").splitlines():  # the drawing: the indented lines after the directive
        if not line.startswith(" "):
            break
        block.append(line)
    rooms = {}
    for line in block:
        match = LAYER_LINE.match(line)
        assert match, f"not a layer line of the drawing: {line!r}"
        for room in match.group(3).split():
            rooms[room] = int(match.group(1))
    return rooms


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (at the top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("nip_like"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found |= {name if name in known else node.module for name in names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("nip_like")}
    return {_known(name, known) for name in found} - {"nip_like"}


def _known(name: str, known: dict[str, Path]) -> str:
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def room_of(module: str) -> str:
    """The drawing's room of a module: ``nip_like.sweeps.grid`` -> ``sweeps/``, ``nip_like.cli`` -> ``cli``."""
    parts = module.split(".")[1:]
    package = PACKAGE.joinpath(*parts[:1])
    return f"{parts[0]}/" if package.is_dir() else parts[0]


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items() if name != "nip_like"}


def test_every_module_stands_in_a_drawn_layer():
    rooms = drawn_layers()
    missing = sorted({room_of(name) for name in import_graph()} - set(rooms))
    assert not missing, f"modules in no layer of docs/concepts.rst's drawing: {missing}"
    stale = sorted(set(rooms) - {room_of(name) for name in import_graph()})
    assert not stale, f"rooms of the drawing that are no module of the package: {stale}"


def test_no_import_runs_up_a_layer():
    rooms = drawn_layers()
    upward = [
        f"{importer} (layer {rooms[room_of(importer)]}) imports {imported} (layer {rooms[room_of(imported)]})"
        for importer, targets in import_graph().items()
        for imported in sorted(targets)
        if rooms[room_of(imported)] > rooms[room_of(importer)] and (importer, imported) not in BACK_UP
    ]
    assert not upward, "imports that run up the drawn layers:\n" + "\n".join(upward)


def test_the_allowed_back_up_imports_still_exist():
    graph = import_graph()
    gone = [pair for pair in BACK_UP if pair[1] not in graph.get(pair[0], set())]
    assert not gone, f"allowed upward imports that the code no longer makes (drop them here and in the docs): {gone}"


def test_no_files_import_each_other_in_a_circle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (circle := visit(imported)):
                return circle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module)
            assert circle is None, "an import circle: " + " -> ".join(circle)


@pytest.mark.slow  # a subprocess: seconds of start-up
def test_a_run_without_language_models_never_imports_transformers_or_peft(tmp_path):
    """Every CLI run and sweep job pays for its imports: transformers and peft load only where an agent is a language model."""
    script = f"""
import sys
from pathlib import Path
from nip_like.cli import compose_config
from nip_like.experiment import build_trainer, run_experiment
run_experiment(compose_config(["preset=smoke", "logger=none", "run.progress_bar=false"]), Path({str(tmp_path / 'bits')!r}))
build_trainer(compose_config(["scenario.cache_dir={tmp_path / 'data'}", "trainer.pretrain.agents=[]"]), Path({str(tmp_path / 'gi')!r}))
print(sorted(name for name in ("transformers", "peft") if name in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
