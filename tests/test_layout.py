"""The package layout's rules (docs/architecture.md, "Layout"), checked on the source.

Every import counts, the ones inside functions too: a cycle dodged with a late import is still a
cycle for whoever reads the code. Importing a submodule is not counted as importing its package's
``__init__`` (Python runs the parent first; that is not a dependency of the importer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "nicswitch_agent"
GENERATED = "nicswitch_agent._pb"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py") if not _module_name(p).startswith(GENERATED)}


def _resolve(name: str) -> str | None:
    """The module of ours that ``name`` (a module, or a name in a module) refers to."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path) -> set[str]:
    """Every module (ours or not) this file imports, at any depth of its code. ``from p import n``
    counts as an import of ``p.n`` when that is a module of ours, else of ``p``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = {_resolve(imported) for imported in _imports(path) if not imported.startswith(GENERATED)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


GRAPH = _graph()


def _reaches(start: str, goal: str) -> list[str] | None:
    """A path of imports from start to goal, or None."""
    stack, seen = [[start]], {start}
    while stack:
        path = stack.pop()
        for nxt in sorted(GRAPH[path[-1]]):
            if nxt == goal:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*path, nxt])
    return None


def test_no_import_cycles() -> None:
    cycles = [" -> ".join(cycle) for name in sorted(GRAPH) if (cycle := _reaches(name, name)) is not None]
    assert cycles == [], "\n".join(cycles)


def _importers_of(prefix: str) -> set[str]:
    return {name for name, path in MODULES.items()
            if any(i == prefix or i.startswith(prefix + ".") for i in _imports(path))}


def test_grpc_is_imported_only_by_the_clusterd_client_the_operator_tools_and_the_simulator() -> None:
    allowed = ("nicswitch_agent.clusterd.", "nicswitch_agent.ops.", "nicswitch_agent.sim.")
    assert sorted(m for m in _importers_of("grpc") if not m.startswith(allowed)) == []


@pytest.mark.parametrize(("package", "forbidden"), [
    # hooks know nothing of ClusterD, of the agent, or of how orders reach them
    ("nicswitch_agent.hooks", ("nicswitch_agent.clusterd", "nicswitch_agent.sim", "nicswitch_agent.agent",
                               "nicswitch_agent.coordination", "nicswitch_agent.executor", "nicswitch_agent.ops")),
    # coordination runs on every rank: members never load the ClusterD client
    ("nicswitch_agent.coordination", ("nicswitch_agent.clusterd", "nicswitch_agent.sim", "nicswitch_agent.agent",
                                      "nicswitch_agent.ops", "nicswitch_agent.executor")),
    # the simulator shares no logic with the client (only the generated wire messages)
    ("nicswitch_agent.sim", ("nicswitch_agent.clusterd", "nicswitch_agent.coordination", "nicswitch_agent.agent",
                             "nicswitch_agent.executor", "nicswitch_agent.hooks", "nicswitch_agent.ops",
                             "nicswitch_agent.observability")),
    # what people are told never drives what the agent does
    ("nicswitch_agent.observability", ("nicswitch_agent.clusterd", "nicswitch_agent.coordination",
                                       "nicswitch_agent.agent", "nicswitch_agent.executor")),
])
def test_what_never_imports_what(package: str, forbidden: tuple[str, ...]) -> None:
    inside = [name for name in GRAPH if name == package or name.startswith(package + ".")]
    assert inside, package
    bad = sorted(f"{name} -> {target}" for name in inside for target in GRAPH[name]
                 if any(target == f or target.startswith(f + ".") for f in forbidden))
    assert bad == []


def test_the_top_level_keeps_at_most_eight_modules() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, top


def test_no_module_is_over_700_lines() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 700}
    assert long == {}
