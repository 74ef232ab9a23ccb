"""The rooms of README.md's layout table, enforced: each room imports only rooms below it in
one strict order, and no two modules import each other, directly or round a cycle. Imports
are read from the source with `ast`: every import counts for the order (lazy ones inside
functions too), module-level ones for cycles (a lazy import runs after both modules loaded)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT_FOLDERS = ("app", "engine", "native", "assets")

# Bottom first: a room may import the rooms before it, never one after it. A file at the
# engine's top level is a room of its own (errors at the bottom, the public API at the top).
ROOMS = [
    "native",
    "assets",
    "engine/errors",
    "engine/platform",
    "engine/modelfile",
    "engine/ops",
    "engine/kv",
    "engine/llamacpp",
    "engine/tokens",
    "engine/lora",
    "engine/models",
    "engine/speculative",
    "engine/batching",
    "engine/images",
    "engine/runtimes",
    "engine/chat",
    "engine/voice",
    "engine/evaluation",
    "engine/api",
    "app/host",
    "app/serve",
    "app/gui",
    "app",
]
# Where a room may not reach although it sits above: the engine never measures itself in
# its inference path.
FORBIDDEN = {"engine/api": {"engine/evaluation"}}
# app/ reaches the engine through its public API (engine/api.py) and the rooms that are
# interfaces of their own: speech, images and the measurement tools. Two commands look
# inside the engine on purpose and may reach what they report on or store.
APP_MAY_IMPORT = {"engine/api", "engine/voice", "engine/images", "engine/evaluation"}
APP_FILE_MAY_ALSO_IMPORT = {
    "app/doctor.py": {"engine/platform", "engine/kv", "engine/llamacpp"},
    "app/calibrate.py": {"engine/speculative"},
}


def room_of(parts: list[str]) -> str | None:
    """The room of a module given as its path parts under the repository, for example
    ['engine', 'kv', 'cache'] -> 'engine/kv', ['engine', 'errors'] -> 'engine/errors'."""
    if not parts or parts[0] not in PROJECT_FOLDERS:
        return None
    if len(parts) > 1 and (ROOT / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}/{parts[1]}"
    if parts[0] == "engine":
        name = parts[1] if len(parts) > 1 else "__init__"
        return "engine/errors" if name == "errors" else "engine/api"
    return parts[0]


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(source: str, package: list[str], top_level_only: bool = False) -> set[tuple]:
    """Project modules imported by a module of `package`, as path-part tuples (a name
    imported from a package may be a module: both are returned)."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    if top_level_only:  # run at import: outside functions, and not only for type checkers
        nodes = [
            n
            for top in tree.body
            if not _is_function(top) and not _type_checking_only(top)
            for n in ast.walk(top)
        ]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [(alias.name.split("."), None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = base + (node.module.split(".") if node.module else [])
            else:
                module = (node.module or "").split(".")
            names = [(module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in names:
            if module and module[0] == "miniapp":
                module = module[1:]
            if not module or module[0] not in PROJECT_FOLDERS:
                continue
            found.add(tuple(module))
            if name and (ROOT.joinpath(*module, name + ".py")).exists():
                found.add((*module, name))
    return found


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (its imports never run)."""
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _is_function(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)


def _sources() -> list[Path]:
    return sorted(p for folder in PROJECT_FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _package(path: Path) -> list[str]:
    return list(path.relative_to(ROOT).parent.parts)


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_imports_only_rooms_below_it(room):
    below = set(ROOMS[: ROOMS.index(room)]) - FORBIDDEN.get(room, set())
    wrong = {}
    for path in _sources():
        if room_of(_module_parts(path)) != room:
            continue
        rooms = {room_of(list(m)) for m in _imports(path.read_text("utf-8"), _package(path))}
        extra = rooms - below - {room, None}
        if extra:
            wrong[str(path.relative_to(ROOT))] = sorted(extra)
    assert not wrong, f"imports of rooms above (or forbidden): {wrong}"


def test_app_imports_the_engine_only_through_its_api_and_the_named_rooms():
    wrong = {}
    for path in _sources():
        name = str(path.relative_to(ROOT))
        if not name.startswith("app/"):
            continue
        allowed = APP_MAY_IMPORT | APP_FILE_MAY_ALSO_IMPORT.get(name, set())
        rooms = {room_of(list(m)) for m in _imports(path.read_text("utf-8"), _package(path))}
        engine = {r for r in rooms if r and r.startswith("engine/")}
        if engine - allowed:
            wrong[name] = sorted(engine - allowed)
    assert not wrong, f"engine rooms app/ reaches past the API: {wrong}"


def test_the_readme_names_what_app_may_import():
    section = (ROOT / "README.md").read_text("utf-8").split("## Layout and import names")[1]
    for room in APP_MAY_IMPORT | set().union(*APP_FILE_MAY_ALSO_IMPORT.values()):
        assert f"`{room.removeprefix('engine/')}" in section or f"`{room}" in section, room


def test_every_project_module_is_in_a_room():
    assert all(room_of(_module_parts(path)) in ROOMS for path in _sources())


def _module_graph() -> dict[tuple, set[tuple]]:
    graph = {}
    for path in _sources():
        imported = _imports(path.read_text("utf-8"), _package(path), top_level_only=True)
        graph[tuple(_module_parts(path))] = imported
    return {node: {m for m in edges if m in graph and m != node} for node, edges in graph.items()}


def _cycles(graph: dict[tuple, set[tuple]]) -> list[list[tuple]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_level_import_cycle():
    # A package's __init__ that re-exports its modules imports them; they import their
    # siblings, not the package, so such an edge alone is no cycle.
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles: " + "; ".join(
        " -> ".join(".".join(m) for m in cycle) for cycle in cycles
    )


def test_the_checker_sees_relative_lazy_and_cyclic_imports():
    """A test of the test: a lazy relative import of app/ from engine/ is seen, and a cycle
    of two modules is found."""
    lazy = "def f():\n    from ...app import settings\n"
    assert {room_of(list(m)) for m in _imports(lazy, ["engine", "images"])} == {"app"}
    assert _imports("def f():\n    import miniapp.engine.kv\n", ["app"], True) == set()
    assert _cycles({("a",): {("b",)}, ("b",): {("a",)}, ("c",): set()}) == [[("a",), ("b",)]]


def test_the_readme_layout_table_names_every_room():
    table = (ROOT / "README.md").read_text("utf-8").split("## Layout and import names")[1]
    named = set(re.findall(r"^\| `([\w/.]+?)/?` \|", table, flags=re.M))
    folders = {room for room in ROOMS if (ROOT / room).is_dir()}
    assert folders <= named, sorted(folders - named)
