"""The shape of the code: the library knows nothing of the Dagster layer, no module imports itself
back through others, and nothing outside a task's own package switches on a task kind."""

import ast
import re
from importlib.metadata import version
from pathlib import Path

from tests import REPO

PACKAGES = ("dagster_rl", "assets", "resources")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every project module `path` imports, at module level or inside a function, or by a literal name
    (`importlib.import_module("dagster_rl.tasks.agent.tiny")`: an import all the same)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
        elif isinstance(node, ast.Import):
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
    dagster_in_library = [
        p for p in (REPO / "dagster_rl").rglob("*.py") if re.search(r"^\s*(from|import) dagster\b", p.read_text(), re.M)
    ]
    assert dagster_in_library == []


# What each foundation package may import of the project: `base` nothing but itself; the packages
# the loop's concepts (`core`) build on, `base` and each other, never `core` or above.
FOUNDATION = {
    "dagster_rl.base": ("dagster_rl.base",),
    "dagster_rl.store": ("dagster_rl.base", "dagster_rl.store"),
    "dagster_rl.runtime": ("dagster_rl.base", "dagster_rl.runtime"),
    "dagster_rl.sandbox": ("dagster_rl.base", "dagster_rl.sandbox", "dagster_rl.runtime"),
    "dagster_rl.inference": ("dagster_rl.base", "dagster_rl.inference", "dagster_rl.runtime"),
}


def test_the_foundation_never_imports_the_loops_concepts():
    edges = graph()
    up = {
        (m, d)
        for m, deps in edges.items()
        for pkg, allowed in FOUNDATION.items()
        if m == pkg or m.startswith(pkg + ".")
        for d in deps
        if d.startswith("dagster_rl") and not any(d == a or d.startswith(a + ".") for a in allowed)
    }
    assert any(m.startswith("dagster_rl.base.") for m in edges)  # the walk found the foundation
    assert up == set(), "the foundation imports upward; move what it needs into dagster_rl.base: " + str(sorted(up))


def test_generic_code_never_imports_a_task_or_switches_on_a_kind():
    tasks = ("dagster_rl.tasks.secret_search", "dagster_rl.tasks.lm", "dagster_rl.tasks.agent")
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


def project_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def documented_tree() -> set[str]:
    """The module paths the tree in docs/internals.md (`## Module map`) names: a line ending in `/` opens
    a folder at its indent, a `name.py` line is a module of the folder above it."""
    text = (REPO / "docs" / "internals.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    found, stack = set(), []
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0]
        if not name:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        del stack[depth:]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        elif name.endswith(".py"):
            found.add("/".join([*stack, name]))
    return found


def test_the_module_map_in_internals_is_the_tree():
    on_disk = {str(p.relative_to(REPO)) for p in project_modules() if p.name != "__init__.py"}
    documented = documented_tree()
    assert len(on_disk) > 80
    assert sorted(on_disk - documented) == [], "modules missing from docs/internals.md's module map"
    assert sorted(documented - on_disk) == [], "docs/internals.md's module map names modules that do not exist"


def test_every_package_map_names_its_modules():
    """Each package's docstring (its `__init__.py`) names every module and subpackage in it."""
    missing = []
    for init in (REPO / "dagster_rl").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for child in init.parent.iterdir():
            name = child.stem if child.suffix == ".py" else child.name
            if child.name in ("__init__.py", "__pycache__") or not (child.suffix == ".py" or (child / "__init__.py").exists()):
                continue
            if not re.search(rf"(?<![\w.]){re.escape(name)}\b", doc):
                missing.append(f"{init.parent.relative_to(REPO)}: {name}")
    assert missing == []


def test_modules_and_classes_stay_small():
    """No module over 500 lines, no class over 250: past that, a file holds more than one idea."""
    big_modules, big_classes = [], []
    for path in project_modules():
        text = path.read_text()
        if len(text.splitlines()) > 500:
            big_modules.append(f"{path.relative_to(REPO)}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                big_classes.append(f"{path.relative_to(REPO)}:{node.name}: {node.end_lineno - node.lineno + 1}")
    assert big_modules == [] and big_classes == []


def imports_dagster_core(path: Path) -> bool:
    """Whether `path` imports Dagster's private `dagster._core` (at module level or in a function)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        if any(n == "dagster._core" or n.startswith("dagster._core.") for n in names):
            return True
    return False


def test_dagsters_private_api_is_imported_in_one_module_checked_against_the_installed_dagster():
    """An upgrade of Dagster fails here until that module is checked against the new version."""
    importers = sorted(
        str(p.relative_to(REPO)) for pkg in (*PACKAGES, "bench") for p in (REPO / pkg).rglob("*.py") if imports_dagster_core(p)
    )
    assert importers == ["resources/dagster_internals.py"]
    doc = " ".join((REPO / "resources" / "dagster_internals.py").read_text().split())
    assert f"dagster {version('dagster')} and dagster-k8s {version('dagster-k8s')}" in doc


def test_the_trainer_processes_start_where_the_package_is():
    """The trainer's processes run in, and put first on their PYTHONPATH, the folder holding `dagster_rl`."""
    from dagster_rl.tasks.lm.backends import SOURCE_ROOT

    assert (SOURCE_ROOT / "dagster_rl" / "__init__.py").is_file()


def third_party_imports() -> dict[str, set[str]]:
    """Top-level names the project's packages import that are neither its own nor the standard library's,
    with the modules that import each."""
    import sys

    found: dict[str, set[str]] = {}
    for path in project_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in PACKAGES and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(module_name(path))
    return found


def test_every_package_the_code_imports_is_declared():
    """A package imported directly is a dependency of pyproject.toml of its own, never one that
    another dependency happens to bring (`pydantic_core` came with pydantic, undeclared)."""
    import tomllib
    from importlib.metadata import packages_distributions

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in project["dependencies"]}
    by_import = packages_distributions()
    undeclared = {}
    for name, users in third_party_imports().items():
        dists = {d.lower().replace("_", "-") for d in by_import.get(name, [name])}
        if not dists & declared:
            undeclared[f"{name} (imported by {sorted(users)[0]})"] = sorted(dists)
    assert len(third_party_imports()) > 15  # the walk found the imports
    assert undeclared == {}, f"imported but not declared in pyproject.toml's dependencies: {undeclared}"
