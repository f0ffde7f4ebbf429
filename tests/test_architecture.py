"""The house's rules, checked on the source (docs/architecture.md): layers, no cycles, one place per concern.

The import graph is read with ``ast`` from every module of ``ensemble_core``, counting imports
inside functions and under ``TYPE_CHECKING`` too (a deferred import is still a dependency):

* imports only go down the layers of :data:`LAYERS` (or stay within a layer);
* there is no import cycle, not even inside a layer;
* the rooms of one layer that must not know each other don't (:data:`APART`): the Ray
  transport imports no method, the methods know nothing of Ray;
* no module imports the package's own ``__init__`` (the curated API is for users);
* every exception class lives in ``errors.py`` and is exported by ``ensemble_core``.
"""

from __future__ import annotations

import ast
import inspect
from collections import defaultdict
from pathlib import Path

import pytest

import ensemble_core
from ensemble_core import errors

ROOT = Path(ensemble_core.__file__).resolve().parent
PACKAGE = "ensemble_core"

#: Bottom to top. A module's layer is the first entry its dotted name (without the package) starts with.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "options", "transfer")),
    ("text and models", ("text", "models")),
    ("constrained decoding", ("constraints",)),
    ("decoding", ("decoding",)),
    ("methods, member backends, test members", ("methods", "remote", "testing")),
    ("the facade", ("ensemble",)),
    ("serving", ("serving",)),
    ("server, benchmark, command-line flags", ("server", "bench", "flags")),
    ("command line", ("cli", "demo")),
]
#: Rooms of one layer that must not import each other (either way).
APART = [("text", "models"), ("methods", "remote"), ("methods", "testing"), ("remote", "testing")]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _targets(module: str, node: ast.AST) -> list[str]:
    """The ensemble_core modules an import statement brings in."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith(PACKAGE)]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not source.startswith(PACKAGE):
        return []
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in MODULES else source)
    return out


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(t for t in _targets(module, node) if t != module)
    return graph


def room(module: str) -> str:
    rest = module[len(PACKAGE) + 1:]
    return rest.split(".")[0] if rest else ""


def layer(module: str) -> int:
    name = room(module)
    for rank, (_, rooms) in enumerate(LAYERS):
        if name in rooms:
            return rank
    raise AssertionError(f"{module} is in no layer: add its room to LAYERS in tests/test_architecture.py "
                         "and docs/architecture.md")


GRAPH = import_graph()
EDGES = sorted((a, b) for a, targets in GRAPH.items() for b in targets)


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        if module != PACKAGE and not module.endswith("__main__"):
            layer(module)


@pytest.mark.parametrize("source, target", [e for e in EDGES if e[0] != PACKAGE and e[1] != PACKAGE],
                         ids=lambda x: x.replace(PACKAGE + ".", ""))
def test_imports_only_go_down(source: str, target: str) -> None:
    assert layer(target) <= layer(source), (
        f"{source} ({LAYERS[layer(source)][0]}) imports {target} ({LAYERS[layer(target)][0]}), a layer above it")
    pair = {room(source), room(target)}
    assert not any(pair == {a, b} for a, b in APART), f"{source} imports {target}: these rooms stay apart"


def test_no_module_imports_the_curated_package() -> None:
    assert [a for a, b in EDGES if b == PACKAGE and a != PACKAGE] == []


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert cycles == []


def test_every_exception_lives_in_errors_and_is_exported() -> None:
    outside = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and module != f"{PACKAGE}.errors":
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if any(b.endswith(("Error", "Exception")) or b in ("GenerationCancelled",) for b in bases):
                    outside.append(f"{module}.{node.name}")
    assert outside == []
    defined = {name for name, obj in inspect.getmembers(errors, inspect.isclass)
               if issubclass(obj, BaseException) and obj.__module__ == errors.__name__}
    assert defined - set(ensemble_core.__all__) == set()
    assert all(name in (errors.__doc__ or "") for name in defined), "the tree in errors.py's docstring names them all"


def test_every_registered_method_loads_and_names_itself() -> None:
    for name in ensemble_core.METHODS:
        cls = ensemble_core.method_class(name)
        assert cls.name == name and issubclass(cls, ensemble_core.EnsembleMethod)


@pytest.mark.real
def test_the_documented_example_method_runs(real_pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/concepts.md's example method, copied out of the page: one new file and one registration line."""
    page = (ROOT.parent / "docs" / "concepts.md").read_text()
    block = page.split("<!-- example-method: most_confident.py -->")[1].split("<!-- /example-method -->")[0]
    code = block.split("```python\n", 1)[1].rsplit("```", 1)[0]
    assert 25 <= len(code.strip().splitlines()) <= 50
    (tmp_path / "most_confident.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ensemble_core.METHODS, "most-confident", "most_confident:MostConfident")
    ensemble = ensemble_core.Ensemble(real_pair, method="most-confident", max_new_tokens=24)
    result = ensemble.generate("What is 12 + 7? Answer in one sentence.")
    assert result.text and result.finish_reason in ("eos", "stop", "length")
    assert result.completion_tokens <= 24 + 8
    streamed = "".join(ensemble.stream("What is 12 + 7? Answer in one sentence."))
    assert streamed == result.text  # greedy: the same text, streamed segment by segment
