"""The docs a user reads: every relative link (and #anchor) in README.md and docs/
resolves, and nothing points at what a user does not have (issue numbers, files
outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*)$", FENCED.sub("", doc.read_text()), re.M):
        name = slug(heading)
        count = seen[name] = seen.get(name, -1) + 1
        found.add(name if count == 0 else f"{name}-{count}")
    return found


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCED.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, mailto: ...
            continue
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{doc.name}: missing {target}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{doc.name}: no anchor {target}")
    return broken


def test_relative_links_resolve() -> None:
    assert [line for doc in DOCS for line in broken_links(doc)] == []


def test_docs_name_nothing_a_user_lacks() -> None:
    pattern = re.compile(r"[Ii]ssues? #?\d+|\.\./shared/|DESIGN\.md")
    found = [
        f"{doc.relative_to(ROOT)}:{n}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_readme_stays_short() -> None:
    """The README is the front door; topics live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
