"""Every shipped recipe reaches the figure docs/recipes.md quotes for it.

Each check of benchmarks/recipes.py trains its recipe (or the recipe's shorter twin)
with ``corun train``, as a user would, and compares the held-out metric at the last
evaluation with benchmarks/recipe_figures.json: a change that moves what a recipe
learns by more than 3 standard errors of the difference fails here, with both
figures in the message. The table in docs/recipes.md is generated from the same file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.recipes import (
    BEGIN,
    CHECKS,
    DOCS,
    END,
    EXAMPLE_BEGIN,
    EXAMPLE_DOCS,
    EXAMPLE_END,
    Check,
    example_figure,
    measure,
    moved,
    stored,
    table,
)

REPO = Path(__file__).resolve().parents[1]
SERVE_ONLY = {"tinker"}  # `corun train` refuses it: it configures `corun serve`


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every check, so a warm start several recipes name trains once."""
    return tmp_path_factory.mktemp("recipes")


# A recipe too slow for CI is measured there by its shorter twin, and the variants of
# LONG_ONLY not at all; `-m long` runs them.
PARAMS = [
    pytest.param(check, id=check.name, marks=[] if check.in_ci else [pytest.mark.long])
    for check in CHECKS
]


@pytest.mark.slow
@pytest.mark.parametrize("check", PARAMS)
def test_the_recipe_reaches_its_documented_figure(check: Check, scratch: Path) -> None:
    documented = stored().get(check.name)
    assert documented is not None, (
        f"{check.name} has no documented figure: python -m benchmarks.recipes "
        f"{check.recipe} --write"
    )
    now = measure(check, scratch)
    assert now.steps == documented["steps"]
    reason = moved(check, documented, now)
    assert reason is None, reason


@pytest.mark.slow
def test_a_recipe_that_stops_learning_fails_with_its_figures(tmp_path: Path) -> None:
    """sft_warmup at a learning rate a million times smaller: the check names the
    recipe, the figure reached and the documented one."""
    check = next(check for check in CHECKS if check.recipe == "sft_warmup")
    now = measure(check, tmp_path, extra=["trainer.lr=3e-9"])
    reason = moved(check, stored()[check.name], now)
    assert reason is not None and reason.startswith("sft_warmup: held-out eval/accuracy")
    assert f"documented {stored()[check.name]['final']:.3f}" in reason


def test_every_recipe_has_a_check_and_the_docs_table_is_generated() -> None:
    recipes = {path.stem for path in (REPO / "configs").glob("*.toml")} - SERVE_ONLY
    assert recipes == {check.recipe for check in CHECKS if not check.is_example}
    assert set(stored()) == {check.name for check in CHECKS}  # every check, twins too
    # Each documented figure is one of learning: the run ends more than a standard error
    # above where it started (the prompt enhancer's 72 held-out prompts allow no more).
    flat = {name: f for name, f in stored().items() if f["final"] - f["start"] <= f["se"]}
    assert flat == {}
    text = DOCS.read_text()
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table(stored()) in generated, (
        "docs/recipes.md's figure table is not the one benchmarks/recipe_figures.json "
        "gives: python -m benchmarks.recipes --write regenerates it"
    )
    quoted = EXAMPLE_DOCS.read_text().split(EXAMPLE_BEGIN, 1)[1].split(EXAMPLE_END, 1)[0]
    assert quoted.strip() == example_figure(stored()), (
        "docs/writing-a-trainer.md quotes another figure of its example than "
        "benchmarks/recipe_figures.json holds: python -m benchmarks.recipes "
        "examples/loo.toml --write regenerates it"
    )
