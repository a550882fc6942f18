"""The recipes corun ships: ready-to-run TOML configs, found by name.

The recipes are the files of the checkout's top-level configs/ folder; ``configs`` here
links to it, and a wheel carries them as this package's ``configs/`` (one copy, built
from that link). ``corun train grpo`` trains ``configs/grpo.toml``: a bare name that is
not a file where corun runs names a recipe (``grpo`` or ``grpo.toml``); a path is read
as it is.
A recipe names the run it starts from by recipe name too (``init_from =
"sft_warmup.toml"``), so a recipe copied out to edit (``corun recipes copy grpo``)
still starts from the shipped warm start, unless a ``sft_warmup.toml`` of one's own
lies beside it. Each file's leading comment says what it trains; its first clause is
the recipe's one-line summary (``corun recipes``).
"""

from __future__ import annotations

import re
from pathlib import Path

FOLDER = (Path(__file__).parent / "configs").resolve()  # configs/ in a checkout
SUFFIX = ".toml"


def names() -> list[str]:
    """The shipped recipes, by name."""
    return sorted(path.stem for path in FOLDER.glob(f"*{SUFFIX}"))


def is_name(text: str | Path) -> bool:
    """Whether ``text`` reads as a recipe's name: one path part, no other suffix."""
    path = Path(text)
    return len(path.parts) == 1 and path.suffix in ("", SUFFIX)


def shipped(name: str | Path) -> Path | None:
    """The shipped recipe ``name`` names (``grpo`` or ``grpo.toml``), if there is one."""
    recipe = FOLDER / f"{Path(name).stem}{SUFFIX}"
    return recipe if is_name(name) and recipe.is_file() else None


def locate(config: str | Path) -> Path:
    """``config`` itself when it is a file, or not a name; else the shipped recipe it
    names, if there is one (else ``config``, for the caller's "not found")."""
    path = Path(config)
    if path.exists() or not is_name(path):
        return path
    return shipped(path) or path


def summary(name: str) -> str:
    """The first clause of the recipe's leading comment, without its asides."""
    lines = (FOLDER / f"{name}{SUFFIX}").read_text().splitlines()
    comment = []
    for line in lines:
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    text = re.sub(r"\s*\([^()]*\)", "", " ".join(comment))  # asides, in parentheses
    return re.split(r"[.:;](?:\s|$)", text, maxsplit=1)[0]
