"""Project-wide rules beyond the import table (tests/test_layers.py): ruff and mypy
clean, no long functions in corun/, trainers/ and benchmarks/, and trainers written against
corun's public face only."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import corun

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "corun" / "__init__.py"

# A function or method, from its ``def`` to its last line (docstring, comments and
# nested functions included). The tree's 99.5th percentile is about 50; above 60 a
# function is doing several things.
MAX_FUNCTION_LINES = 60
# The functions longer than that today, at their current length: they may shrink (then
# lower the number, or drop the entry once under the limit), never grow.
LONG_FUNCTIONS = {
    # The endpoint's routes (models, health, completions, chat) as closures over the
    # served policy, the batcher and the bearer token.
}


def _python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
    """(dotted name, length in lines) of every function under ``node``, nested ones and
    methods (``Class.method``) included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}.{child.name}"
            yield name, (child.end_lineno or child.lineno) - child.lineno + 1
            yield from _functions(child, name)
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}.{child.name}")
        else:
            yield from _functions(child, prefix)


def function_lengths() -> dict[str, int]:
    return {
        name: length
        for path in _python_files("corun", "trainers", "benchmarks")
        for name, length in _functions(ast.parse(path.read_text()), _module(path))
    }


def test_no_function_is_too_long() -> None:
    lengths = function_lengths()
    too_long = {
        name: n for name, n in lengths.items() if n > LONG_FUNCTIONS.get(name, MAX_FUNCTION_LINES)
    }
    assert too_long == {}, f"longer than {MAX_FUNCTION_LINES} lines (or than allowed)"
    stale = {
        name: lengths.get(name)
        for name in LONG_FUNCTIONS
        if lengths.get(name, 0) <= MAX_FUNCTION_LINES
    }
    assert stale == {}, "gone or under the limit now: drop these from LONG_FUNCTIONS"


def _imported_from_corun(path: Path) -> Iterator[tuple[str, str]]:
    """(module, name) of every ``from corun... import name`` in ``path``, and
    ("corun", attribute) of every ``corun.attribute`` after a plain ``import corun``."""
    tree = ast.parse(path.read_text())
    plain = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "corun":
            yield from ((node.module or "", alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            plain |= any(alias.name == "corun" and not alias.asname for alias in node.names)
    if plain:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "corun":
                    yield "corun", node.attr


def test_trainers_use_only_corun_public_names() -> None:
    """trainers/ never imports corun's private names, and from ``corun`` itself only
    what ``corun.__all__`` exports."""
    public = set(corun.__all__)
    offenders = [
        f"{path.relative_to(ROOT)}: {module}.{name}"
        for path in _python_files("trainers")
        for module, name in _imported_from_corun(path)
        if name.startswith("_") or (module == "corun" and name not in public)
    ]
    assert offenders == []


def _type_checking_imports(tree: ast.Module) -> set[tuple[str, str]]:
    """(module, name) of the imports under ``if TYPE_CHECKING:``."""
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    return {
        (node.module or "", alias.asname or alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_public_names_are_declared_alike() -> None:
    """corun/__init__.py names its public face three times — ``__all__``, ``_EXPORTS``
    (where each name is loaded from at run time) and the ``TYPE_CHECKING`` imports (what
    type checkers see): the same names, each from the same module."""
    exports = {(module, name) for module, names in corun._EXPORTS.items() for name in names}
    typed = _type_checking_imports(ast.parse(INIT.read_text()))
    assert sorted(typed ^ exports) == []
    assert sorted({name for _, name in exports} ^ set(corun.__all__)) == []
    assert len(corun.__all__) == len(set(corun.__all__))


LINTERS = {
    "ruff": ["ruff", "check", "corun", "trainers", "benchmarks", "tests"],
    "mypy": ["mypy"],  # corun/, trainers/ and benchmarks/ (pyproject.toml)
    # trainers/, which gpu_check.py imports, is held to the plain run's rules; a cache of
    # its own, since both mypy runs go at once
    "mypy-strict-corun": ["mypy", "--strict", "--follow-imports=silent", "--cache-dir",
                          ".mypy_cache/strict", "-p", "corun", "-p", "benchmarks"],
}  # fmt: skip


@pytest.fixture(scope="module")
def linters() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Every linter started at once: each is one process on one core (the two mypy
    runs took 160 s of CI one after the other)."""
    started = {
        name: subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for name, command in LINTERS.items()
    }  # fmt: skip
    yield started
    for proc in started.values():
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("name", list(LINTERS))
def test_linters_clean(linters: dict[str, subprocess.Popen[str]], name: str) -> None:
    output, _ = linters[name].communicate(timeout=900)
    assert linters[name].returncode == 0, output
