"""The layout table in README.md, enforced: which folder's code may import which. Imports
are read from the source with `ast` (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROJECT_FOLDERS = {"app", "engine", "native", "assets"}
# folder -> the folders (besides itself) whose modules it may import.
ALLOWED = {
    "engine/images": {"engine"},
    "engine/voice": {"engine"},
    "engine/models": {"engine", "native"},
    "engine/speculative": {"engine", "engine/models"},
    "engine/batching": {"engine", "engine/models", "engine/speculative"},
    "engine/runtimes": {
        "engine",
        "engine/models",
        "engine/speculative",
        "engine/images",
        "engine/batching",
    },  # fmt: skip
    "engine": {
        "engine/models",
        "engine/runtimes",
        "engine/speculative",
        "engine/images",
        "engine/voice",
        "native",
    },  # fmt: skip
    "engine/evaluation": {
        "engine",
        "engine/models",
        "engine/runtimes",
        "engine/speculative",
        "engine/batching",
        "engine/voice",
        "engine/images",
        "assets",
        "native",
    },  # fmt: skip
    "native": set(),
}


def _folder_of(parts: list[str]) -> str:
    """'engine/models' for miniapp.engine.models.decoder, 'engine' for miniapp.engine.cache."""
    if len(parts) > 1 and (ROOT / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}/{parts[1]}"
    return parts[0]


def _imported_folders(path: Path) -> set[str]:
    return _imports_in(path.read_text("utf-8"), list(path.relative_to(ROOT).parent.parts))


def _imports_in(source: str, package: list[str]) -> set[str]:
    """The project folders a module of `package` imports from (absolute miniapp.* imports
    and relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                names = [base + (node.module.split(".") if node.module else [])]
            else:
                names = [(node.module or "").split(".")]
        else:
            continue
        for name in names:
            if name and name[0] == "miniapp":
                name = name[1:]
            if (
                name
                and (ROOT / name[0]).is_dir()
                and name[0] in {"app", "engine", "native", "assets"}
            ):
                found.add(_folder_of(name))
    return found


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).glob("*.py"))


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_the_layout_allows(folder):
    wrong = {}
    for module in _modules(folder):
        extra = _imported_folders(module) - ALLOWED[folder] - {folder}
        if extra:
            wrong[str(module.relative_to(ROOT))] = sorted(extra)
    assert not wrong, f"imports the layout table does not allow: {wrong}"


def test_the_checker_sees_relative_and_lazy_imports():
    """A test of the test: a lazy, relative import of app/ from engine/ is caught."""
    assert _imported_folders(ROOT / "engine" / "images" / "route.py") == {"engine"}
    lazy = "def f():\n    from ...app import settings\n"
    assert _imports_in(lazy, ["engine", "images"]) == {"app"}
    assert _imports_in("import miniapp.engine.evaluation.perplexity", ["engine"]) == {
        "engine/evaluation"
    }
