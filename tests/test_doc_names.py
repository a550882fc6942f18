"""Every name the docs, the README, the recipes' comments and the examples give exists:
dotted names of ``corun``, ``trainers``, ``benchmarks`` and ``examples`` import (a
module, or an attribute of one), paths of the repository's folders are files or
folders of it, and settings written as `section.key` are fields of the config schema
(``trainer.*``: of some registered trainer's ``Config``). A path in another project's
repository is written with its name first (``verl:docs/...``) and is not checked."""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

import msgspec
import pytest

from corun import Trainer
from corun.base.config import Config
from corun.contract.registry import resolve_trainer
from tests.support.names import resolve

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("corun", "trainers", "benchmarks", "examples")
FOLDERS = (*PACKAGES, "tests", "configs", "docs")
DOTTED = re.compile(rf"(?<![\w./:-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(rf"(?<![\w./:-])((?:{'|'.join(FOLDERS)})/[\w./-]*\w)")
SETTING = re.compile(r"`\$?\.?(run|loop|checkpoint|log|data|serve|rollout|trainer)\.(\w+)[^`]*`")
FILE_SUFFIXES = {"py", "toml", "md", "pt", "json", "jsonl", "png", "txt"}


def sources() -> list[Path]:
    return [
        *sorted(ROOT.glob("docs/*.md")), ROOT / "README.md",
        *sorted(ROOT.glob("configs/*.toml")), *sorted(ROOT.glob("examples/**/*.py")),
    ]  # fmt: skip


@cache
def pyproject() -> dict[str, dict[str, str]]:
    entry_points: dict[str, dict[str, str]] = tomllib.loads(
        (ROOT / "pyproject.toml").read_text()
    )["project"]["entry-points"]
    return entry_points


def resolves(name: str) -> bool:
    try:
        resolve(name)
    except LookupError:
        return False
    return True


@cache  # every source's check reads it: the registry resolved once
def setting_fields() -> dict[str, set[str]]:
    """Each config section's field names; ``trainer``: every registered kind's."""
    sections = {f.name: f.type for f in msgspec.structs.fields(Config)}
    fields = {
        name: {f.name for f in msgspec.structs.fields(kind)}
        for name, kind in sections.items() if name != "trainer"
    }  # fmt: skip
    fields["trainer"] = {
        f.name for kind in pyproject()["corun.trainers"]
        for f in msgspec.structs.fields(resolve_trainer(kind).Config)
    }  # fmt: skip
    return fields


@pytest.mark.parametrize("source", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_things_exist(source: Path) -> None:
    text = source.read_text()
    groups = set(pyproject())  # entry point groups, named like modules
    missing = [
        name for name in sorted(set(DOTTED.findall(text)))
        if name not in groups and name.rsplit(".", 1)[-1] not in FILE_SUFFIXES
        and not resolves(name)
    ]  # fmt: skip
    missing += [path for path in sorted(set(PATH.findall(text))) if not (ROOT / path).exists()]
    fields = setting_fields()
    missing += [
        f"{section}.{key}" for section, key in sorted(set(SETTING.findall(text)))
        if key not in fields[section] and key not in FILE_SUFFIXES
        and not (section == "trainer" and hasattr(Trainer, key))  # a hook: trainer.sync_weights
    ]  # fmt: skip
    assert not missing, f"{source.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_check_catches_a_wrong_name() -> None:
    assert not resolves("trainers.sft.load_policy")  # the recipe comment issue 43 found
    assert resolves("trainers.lm.policy.load_policy")
    assert DOTTED.findall("see `trainers.sft.load_policy`.") == ["trainers.sft.load_policy"]
    assert PATH.findall("in verl:docs/algo/x.md and docs/runs.md") == ["docs/runs.md"]
