"""The package's folders are layers, and no module imports against their direction.

    base  ←  engine  ←  solve           (errors, version; the DAG and diag(G); finding the rescaling)
               ↑    ↖    ↑
               io      library          (files; analysis, rescaling, pipeline, toolkit, verify, ...)
                          ↑
                        report  ←  cli

A module may import its own folder and the folders its folder points to, nothing else; every
import counts, function-local ones included. Each folder's ``__init__`` says its job and what it
may import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pathcond_cli"
LIBRARY = {
    "runtime",
    "statistics",
    "analysis",
    "rescaling",
    "module_route",
    "model_files",
    "pipeline",
    "toolkit",
    "verify",
    "threads",
    "gsgd",
}
# Modules that import no other pathcond module: every layer may import them.
BASE = {"errors", "version"}
ALLOWED = {
    "base": set(),
    "engine": {"base"},
    "solve": {"engine", "base"},
    "io": {"engine", "base"},
    "library": {"engine", "solve", "io", "base"},
    "report": {"library", "engine", "solve", "io", "base"},
    "cli": {"report", "library", "engine", "solve", "io", "base"},
    "package": {"library", "base", "cli"},
}
FOLDERS = {"engine", "solve", "io", "report", "cli"}


def layer(parts: tuple[str, ...]) -> str:
    """The layer of the module ``pathcond_cli.<parts>`` (parts empty: the package itself)."""
    if not parts or parts[0] in ("__init__", "__main__"):
        return "package"
    if parts[0] in FOLDERS:
        return parts[0]
    if parts[0] in LIBRARY:
        return "library"
    if parts[0] in BASE:
        return "base"
    raise AssertionError(f"pathcond_cli.{'.'.join(parts)} is in no layer: place it in a folder or in LIBRARY")


def imported(module: Path) -> list[tuple[int, tuple[str, ...]]]:
    """(line, parts under pathcond_cli) of every pathcond module ``module`` imports."""
    where = module.relative_to(PACKAGE).with_suffix("").parts
    package = where[:-1] if where[-1] != "__init__" else where[:-1]
    found = []
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = (*base, *(node.module.split(".") if node.module else ()))
            if not node.module:  # from . import name: a submodule, or a name of the package
                for alias in node.names:
                    sub = (*target, alias.name)
                    is_module = (
                        PACKAGE.joinpath(*sub).with_suffix(".py").exists()
                        or (PACKAGE.joinpath(*sub) / "__init__.py").exists()
                    )
                    found.append((node.lineno, sub if is_module else target))
                continue
            found.append((node.lineno, target))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pathcond_cli":
            found.append((node.lineno, tuple(node.module.split(".")[1:])))
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, tuple(alias.name.split(".")[1:]))
                for alias in node.names
                if alias.name.split(".")[0] == "pathcond_cli"
            ]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("module", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_imports_follow_the_layers(module):
    own = layer(module.relative_to(PACKAGE).with_suffix("").parts)
    for line, target in imported(module):
        other = layer(target)
        assert other == own or other in ALLOWED[own], (
            f"{module.relative_to(PACKAGE.parent)}:{line} imports pathcond_cli.{'.'.join(target)}: "
            f"{own} may import {sorted(ALLOWED[own] | {own})} only"
        )


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_each_folder_says_its_job_and_what_it_may_import(folder):
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8")))
    assert doc and "import" in doc.lower(), f"pathcond_cli/{folder}/__init__.py: no docstring naming what it may import"


def test_a_wrong_import_is_caught(tmp_path, monkeypatch):
    """The check sees relative, absolute and function-local imports alike."""
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    (tmp_path / "engine").mkdir()
    offender = tmp_path / "engine" / "graph.py"
    offender.write_text("def f():\n    from ..solve import objective\n\nimport pathcond_cli.cli.app\n")
    (tmp_path / "solve").mkdir()
    (tmp_path / "solve" / "objective.py").write_text("")
    assert sorted(layer(target) for _, target in imported(offender)) == ["cli", "solve"]
    with pytest.raises(AssertionError, match="engine may import"):
        test_imports_follow_the_layers(offender)
