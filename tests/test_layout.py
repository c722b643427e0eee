"""The shape of the code: the library knows nothing of the Dagster layer, no module imports itself
back through others, and nothing outside a task's own package switches on a task kind."""

import ast
import re
from pathlib import Path

from tests import REPO

PACKAGES = ("dagster_rl", "assets", "resources")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every project module `path` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {name: {m for m in imports_of(p) if m in modules and m != name} for name, p in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycle_between_project_modules():
    edges = graph()
    assert len(edges) > 40  # the walk found the project
    assert cycles(edges) == []


def test_the_library_never_imports_the_dagster_layer():
    up = {(m, i) for m, deps in graph().items() if m.startswith("dagster_rl") for i in deps if i.split(".")[0] != "dagster_rl"}
    assert up == set()
    dagster_in_library = [p for p in (REPO / "dagster_rl").rglob("*.py") if re.search(r"^\s*(from|import) dagster\b", p.read_text(), re.M)]
    assert dagster_in_library == []


def test_generic_code_never_imports_a_task_or_switches_on_a_kind():
    tasks = ("dagster_rl.tasks.secret_search", "dagster_rl.tasks.lm")
    generic = {m: deps for m, deps in graph().items() if not m.startswith(tasks)}
    assert {(m, d) for m, deps in generic.items() for d in deps if d.startswith(tasks)} == set()
    switches = [
        f"{p.relative_to(REPO)}:{n}"
        for pkg in PACKAGES
        for p in (REPO / pkg).rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bkind\s*(==|!=|\bin\b)\s*[\"'(\[{]", line)
    ]
    assert switches == []
