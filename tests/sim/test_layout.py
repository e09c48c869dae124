"""The sim package stays in small modules that import each other one way (issue 13).

The controller is assembled from modules that look handlers up by name, so a handler lost in a
move would only show when its state is reached: the table is checked against the class here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nicswitch_agent.sim
from nicswitch_agent.sim.event_controller import JobController

SIM = Path(nicswitch_agent.sim.__file__).parent
PACKAGE = "nicswitch_agent.sim"
MAX_LINES = 700


def sim_imports(path: Path) -> set[str]:
    """The sim modules ``path`` imports at module level (``from nicswitch_agent.sim import codes`` counts)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            found |= {
                alias.name.removeprefix(PACKAGE + ".").split(".")[0]
                for alias in node.names
                if alias.name.startswith(PACKAGE + ".")
            }
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == PACKAGE:
                found |= {alias.name for alias in node.names if (SIM / f"{alias.name}.py").exists()}
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
    return found


def test_no_sim_module_is_over_the_limit() -> None:
    sizes = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in SIM.glob("*.py")}
    assert sizes, SIM
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_sim_modules_import_each_other_without_a_cycle() -> None:
    graph = {path.stem: sim_imports(path) for path in SIM.glob("*.py") if path.stem != "__init__"}
    assert graph["event_controller"] >= {"state_handlers", "streams"}, graph["event_controller"]
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, "import cycle: " + " -> ".join((*stack, module))
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, (*stack, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_every_rule_names_a_handler_of_the_controller() -> None:
    from nicswitch_agent.sim.rules import RULES  # inside: the module is new with the split

    missing = sorted({name for _, name in RULES.values() if not callable(getattr(JobController, name, None))})
    assert missing == []
