"""The import table of docs/architecture.md, enforced: every import in corun/,
trainers/ and benchmarks/ goes where the table allows, and no two modules import each other in a
circle. Modules are named by their dotted paths; imports inside functions and
``TYPE_CHECKING`` blocks count."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "architecture.md"
CHECKED = ("corun", "trainers", "benchmarks")


def allowed_imports(text: str) -> dict[str, set[str]]:
    """package → the packages it may import, from the table between the markers."""
    rows = text.split("<!-- layers:", 1)[1].split("<!-- /layers -->", 1)[0]
    table: dict[str, set[str]] = {}
    for line in rows.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        package, may = cells[0].strip("`"), cells[2]
        table[package] = set(re.findall(r"`([a-z_.]+)`", may))
        if may.startswith("every"):  # "every `corun` package (above)": resolved below
            table[package] = table[package] - {"corun"} | {"*"}
    order = list(table)
    for package, may in table.items():
        if "*" in may:
            above = order[: order.index(package)]
            table[package] = may - {"*"} | {p for p in above if p.startswith("corun")}
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for top in CHECKED for p in sorted((ROOT / top).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The checked modules that ``name`` imports (``from pkg import module`` resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *filter(None, [node.module])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {module for module in found if module in known and module != name}


def package_of(module: str, table: dict[str, set[str]]) -> str | None:
    """The table's most specific row that ``module`` falls under."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in table:
            return ".".join(parts[:n])
    return None


def violations(table: dict[str, set[str]], graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        own = package_of(module, table)
        if own is None:
            found.append(f"{module}: in no row of the table")
            continue
        for target in sorted(imported):
            theirs = package_of(target, table)
            if theirs != own and theirs not in table[own]:
                found.append(f"{module} imports {target}: {own} may not import {theirs}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[str]:
    found: list[str] = []
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            found.append(" -> ".join([*trail[trail.index(module) :], module]))
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    # A package's __init__ is imported whenever one of its modules is; that edge is
    # Python's, not the code's, so only the imports written in files count.
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_table_covers_every_package() -> None:
    table = allowed_imports(TABLE.read_text())
    assert {"corun", "trainers", "corun.loop", "corun.contract"} <= table.keys()
    orphans = [m for m in modules() if package_of(m, table) is None]
    assert orphans == []


def test_imports_follow_the_table() -> None:
    assert violations(allowed_imports(TABLE.read_text()), import_graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_a_wrong_import_is_named() -> None:
    """The check itself: an import against the table is reported with both names."""
    table = allowed_imports(TABLE.read_text())
    graph = {"corun.loop.template": {"corun.serve.server"}, "corun.serve.server": set()}
    assert violations(table, graph) == [
        "corun.loop.template imports corun.serve.server: corun.loop may not import corun.serve"
    ]
    assert cycles({"a": {"b"}, "b": {"a"}}) == ["a -> b -> a"]
