"""reasoning-gym as a data source of the hf trainers (trainers/hf/reasoning_gym.py):
batches by (seed, index), held-out items disjoint from training ones, the task's own
scorer as the ``task_score`` reward, the usage errors, and the shipped recipe's gain."""

from __future__ import annotations

import math
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from benchmarks.recipes import CHECKS, measure
from corun.base.config import DataConfig, TaskConfig
from corun.records.events import read_records
from tests.support.cli import (
    assert_usage_error,
    base_toml,
    call_main,
    corun_subprocess,
    restore_process_state,  # noqa: F401  (a fixture)
)
from tests.support.config import make_config
from tests.support.processes import environment
from trainers.hf import reasoning_gym
from trainers.hf.rewards import Rewards
from trainers.hf.tasks import Example, held_out

REPO = Path(__file__).resolve().parents[1]
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TASKS = {
    "chain_sum": {"weight": 3.0, "settings": SMALL},
    "basic_arithmetic": {"weight": 1.0, "settings": SMALL},
}


def data_config(tasks: dict[str, Any] = TASKS) -> DataConfig:
    return DataConfig(
        source="reasoning-gym",
        tasks={name: TaskConfig(**task) for name, task in tasks.items()},
        batch_size=16,
    )


@pytest.fixture(scope="module")
def mix() -> reasoning_gym.TaskMix:
    source = reasoning_gym.source(data_config())
    assert source is not None
    return source


def fingerprint(batches: list[list[Example]]) -> list[tuple[str, str, str]]:
    return [(e.task, str(e.prompt), e.answer) for batch in batches for e in batch]


# ------------------------------------------------------------------------ the stream


def test_a_batch_is_a_function_of_seed_and_index(mix: reasoning_gym.TaskMix) -> None:
    """The same (seed, index) gives the same batch, in any order and in another
    process; another seed another batch; the tasks drawn by weight."""
    stream = mix.batches(16, seed=5)
    forward = [stream.batch(i) for i in range(6)]
    assert fingerprint(forward) == fingerprint([stream.batch(i) for i in reversed(range(6))][::-1])
    assert fingerprint([mix.batches(16, 6).batch(0)]) != fingerprint(forward[:1])
    code = (
        "from tests.test_reasoning_gym import data_config, fingerprint\n"
        "from trainers.hf import reasoning_gym\n"
        "print(fingerprint([reasoning_gym.source(data_config()).batches(16, 5).batch(3)]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=environment(), capture_output=True,
        text=True, check=True, timeout=120,
    )  # fmt: skip
    assert other.stdout.strip() == str(fingerprint(forward[3:4]))
    tasks = [e.task for batch in forward for e in batch]
    assert 0.6 < tasks.count("chain_sum") / len(tasks) < 0.9  # weights 3 : 1


def test_a_resumed_stream_continues_exactly(mix: reasoning_gym.TaskMix) -> None:
    """The loop resumes by batch index from memory: a stream made afresh (as after a
    restart) gives batches 4.. as the uninterrupted one did."""
    uninterrupted = mix.batches(16, seed=2)
    assert uninterrupted.in_memory
    whole = [uninterrupted.batch(i) for i in range(8)]
    resumed = reasoning_gym.source(data_config())
    assert resumed is not None
    after = [resumed.batches(16, seed=2).batch(i) for i in range(4, 8)]
    assert fingerprint(after) == fingerprint(whole[4:])


def test_held_out_items_are_never_trained_on(mix: reasoning_gym.TaskMix) -> None:
    """Held out by content: every evaluated question hashes into the held-out tenth,
    no training question does; the held-out items are the same in every run."""
    evaluated = mix.held_out(200)
    assert all(held_out(str(e.prompt)) for e in evaluated)
    assert {e.task for e in evaluated} == {"chain_sum", "basic_arithmetic"}
    trained = {str(e.prompt) for i in range(30) for e in mix.batches(16, seed=i % 3).batch(i)}
    assert not trained & {str(e.prompt) for e in evaluated}
    assert not any(held_out(q) for q in trained)
    assert fingerprint([mix.held_out(200)]) == fingerprint([evaluated])


# ------------------------------------------------------------------------ the reward


@pytest.mark.anyio
async def test_the_task_scorer_is_a_reward(mix: reasoning_gym.TaskMix, anyio_backend: str) -> None:
    """task_score is the task's own score_answer (on the <answer> part when tagged),
    beside the other rewards, which are called as before (no `entry` keyword)."""
    items = mix.held_out(3)
    rewards = Rewards(
        {"task_score": 1.0, "format": 0.5, "tests.test_reasoning_gym:three_keywords": 0.0},
        "rewards", timeout_s=30.0, scorer=mix.score,
    )  # fmt: skip
    right, tagged, wrong = items[0].answer, f"<answer>{items[1].answer}</answer>", "x"
    with anyio.fail_after(30):
        scores = await rewards.score(
            [str(e.prompt) for e in items], [right, tagged, wrong], [e.answer for e in items],
            entries=[e.entry for e in items],
        )  # fmt: skip
    assert scores.ok == [True, True, True]
    assert scores.rewards == [1.5, 1.0, 0.0]


def three_keywords(*, prompt: str, response: str, answer: str) -> float:
    """A user's reward written for the three documented keywords only."""
    return 0.0


@pytest.mark.anyio
async def test_a_raising_scorer_fails_only_its_sample(
    mix: reasoning_gym.TaskMix, anyio_backend: str
) -> None:
    items = mix.held_out(3)

    def scorer(response: str, entry: object) -> float:
        if response == "boom":
            raise ValueError("the scorer broke")
        return mix.score(response, entry)

    rewards = Rewards({"task_score": 1.0}, "rewards", timeout_s=30.0, scorer=scorer)
    with anyio.fail_after(30):
        scores = await rewards.score(
            [str(e.prompt) for e in items], [items[0].answer, "boom", items[2].answer],
            [e.answer for e in items], entries=[e.entry for e in items],
        )  # fmt: skip
    assert scores.ok == [True, False, True]
    assert scores.rewards == [1.0, 0.0, 1.0]


def test_task_score_needs_a_source_with_a_scorer() -> None:
    with pytest.raises(corun.ConfigError, match=r"rewards\.task_score: the data source's own"):
        Rewards({"task_score": 1.0}, "rewards", timeout_s=1.0)


# ------------------------------------------------------------------------ usage errors


def rg_toml(run_dir: Path, tasks: str) -> str:
    return base_toml(run_dir).replace('kind = "tests.support.fakes:FakeTrainer"\n', "") + (
        'kind = "hf_sft"\nmodel = "tiny-llama"\n\n[data]\nsource = "reasoning-gym"\n' + tasks
    )


def test_an_unknown_task_exits_2_naming_it_and_close_names(tmp_path: Path) -> None:
    cfg = tmp_path / "rg.toml"
    cfg.write_text(rg_toml(tmp_path / "run", "[data.tasks.chain_sums]\n"))
    assert tomllib.loads(cfg.read_text())["data"]["tasks"] == {"chain_sums": {}}
    result = corun_subprocess(tmp_path, "train", str(cfg))
    line = assert_usage_error(result.returncode, result.stderr, "`$.data.tasks.chain_sums`")
    assert "close: chain_sum, decimal_chain_sum" in line


@pytest.mark.parametrize(
    ("tasks", "named"),
    [
        ("[data.tasks.chain_sum]\nsettings = { min_terms = 5, max_terms = 2 }\n",
         "`$.data.tasks.chain_sum.settings`: reasoning-gym refused them"),
        ("[data.tasks.chain_sum]\nweight = 0\n", "`tasks.chain_sum.weight` = 0.0"),
        ("", "needs tasks"),
    ],
)  # fmt: skip
def test_bad_tasks_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_process_state: None,  # noqa: F811
    tasks: str, named: str,
) -> None:  # fmt: skip
    cfg = tmp_path / "rg.toml"
    cfg.write_text(rg_toml(tmp_path / "run", tasks))
    code, _, err = call_main(["train", str(cfg)], capsys)
    assert_usage_error(code, err, named)


def test_without_the_package_one_line_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_process_state: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if absent
    cfg = tmp_path / "rg.toml"
    cfg.write_text(rg_toml(tmp_path / "run", "[data.tasks.chain_sum]\n"))
    code, _, err = call_main(["train", str(cfg)], capsys)
    assert_usage_error(code, err, "pip install -e '.[reasoning-gym]'")


# ------------------------------------------------------------------------ a run


@pytest.mark.anyio
async def test_a_grpo_run_scores_with_the_task_and_reports_each_task(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Two GRPO steps on the built-in tiny-llama-rg: rollouts scored by task_score and
    the evaluation reported per task."""
    trainer = {
        "kind": "hf_grpo", "model": "tiny-llama-rg", "samples_per_prompt": 2,
        "max_new_tokens": 4, "eval_size": 8, "rewards": {"task_score": 1.0, "format": 0.1},
    }  # fmt: skip
    data = {"source": "reasoning-gym", "tasks": TASKS, "batch_size": 2}
    config = make_config(tmp_path / "run", trainer, run={"steps": 2}, data=data)
    with anyio.fail_after(120):
        await corun.run(corun.resolve_trainer("hf_grpo")(config), config)
    rows = read_records(tmp_path / "run" / "metrics.jsonl")
    assert any("rollout/reward/task_score" in row for row in rows)
    evals = [row for row in rows if "eval/reward" in row]
    assert {"eval/score/chain_sum", "eval/score/basic_arithmetic"} <= set(evals[-1])


# ------------------------------------------------------------------------ the recipe


def test_the_recipes_name_the_tasks_the_tokenizer_was_trained_on() -> None:
    for name in ("rg_sft", "rg_grpo"):
        config = corun.load_config(REPO / f"configs/{name}.toml")
        settings = {task: dict(t.settings) for task, t in config.data.tasks.items()}
        assert settings == reasoning_gym.ARITHMETIC, name
        assert getattr(config.trainer, "model", None) == "tiny-llama-rg"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    scratch = tmp_path_factory.mktemp("rg-recipe")
    sft, grpo = (next(c for c in CHECKS if c.recipe == name) for name in ("rg_sft", "rg_grpo"))
    yield measure(sft, scratch), measure(grpo, scratch)


@pytest.mark.slow
def test_the_recipe_gains_over_its_warm_start(recipe: tuple[Any, Any]) -> None:
    """configs/rg_grpo.toml from rg_sft.toml's checkpoint: the held-out task score
    rises over the warm start's final evaluation by 0.15 or more, and by more than 3
    standard errors of the difference (measured 2026-12-06: 0.371 -> 0.539, +0.168,
    5.7 standard errors; docs/recipes.md)."""
    sft, grpo = recipe
    assert grpo.start == pytest.approx(sft.final)  # GRPO's first evaluation: the warm start
    se = math.hypot(sft.se, grpo.se)
    assert grpo.final - grpo.start >= 0.15, (sft, grpo)
    assert grpo.final - grpo.start > 3 * se, (sft, grpo)
