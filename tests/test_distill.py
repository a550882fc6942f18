"""On-policy distillation (``hf_distill``, trainers/hf/distill.py): the teacher's engine
scores exactly what the teacher computes, each token's advantage is the teacher's
log-prob minus the student's (plus the reward's group advantage when weighted), bad
settings are one line and exit 2, and a student distilled from a trained teacher
learns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from corun import Lane
from corun.contract.engine import Sampling
from corun.engines.transformers_engine import TransformersEngine
from corun.records.events import read_records
from tests.support.cli import assert_usage_error, call_main
from trainers.hf.policy import ChatFormat, load_policy
from trainers.hf.rl import to_rollouts
from trainers.hf.tasks import eval_problems
from trainers.hf.tiny import build
from trainers.lm.distill import Distill, DistillConfig
from trainers.lm.engine import Rollouts
from trainers.lm.policy import rollout_logprobs
from trainers.lm.policy_gradient import Scored
from trainers.pg import group_advantages

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_teacher_scores_equal_its_recomputed_logprobs(anyio_backend: str) -> None:
    teacher, tokenizer = load_policy("tiny-llama-large", "teacher")
    chat = ChatFormat(tokenizer, "")
    engine = TransformersEngine(teacher, chat.pad_id, Lane("teacher"), owns_lane=True,
                                interrupt=False)  # fmt: skip
    prompts = [chat.encode(e.prompt) for e in eval_problems(6)]  # of several lengths
    assert len({len(p) for p in prompts}) > 1
    try:
        with anyio.fail_after(60):
            generations = await engine.generate(prompts, Sampling(6, 1.0), seed=0)
            scores = await engine.score(prompts, [g.ids for g in generations])
            rows = await engine.distributions(prompts, [g.ids for g in generations])
    finally:
        await engine.shutdown()
    rollouts = to_rollouts(prompts, generations, chat.pad_id)
    recomputed, _, _ = rollout_logprobs(teacher, rollouts, 1.0)
    for row, (generation, score, dist) in enumerate(zip(generations, scores, rows, strict=True)):
        assert len(score) == len(generation.ids) > 0
        # The whole rows: distributions, whose entries at the sampled tokens are the scores.
        assert dist.shape == (len(score), len(tokenizer))
        torch.testing.assert_close(dist.exp().sum(-1), torch.ones(len(score)))
        chosen = dist.gather(-1, torch.tensor(generation.ids)[:, None])[:, 0]
        torch.testing.assert_close(chosen, torch.tensor(score), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(score), recomputed[row, : len(score)],
                                   atol=1e-5, rtol=0)  # fmt: skip
        # Sampled by the same weights at temperature 1: its behaviour log-probs too.
        torch.testing.assert_close(torch.tensor(score), torch.tensor(generation.logprobs),
                                   atol=1e-5, rtol=0)  # fmt: skip


def _scored(rewards: list[float]) -> Scored:
    rows, width = len(rewards), 3
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False],
                         [True, True, True]])[:rows]  # fmt: skip
    student = -torch.rand(rows, width) * mask
    rollouts = Rollouts(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long),
        response_ids=torch.ones(rows, width, dtype=torch.long), response_mask=mask,
        logprobs=student, truncated=torch.zeros(rows, dtype=torch.bool),
        token_versions=torch.zeros(rows, width, dtype=torch.long), version=0,
    )  # fmt: skip
    teacher = -torch.rand(rows, width) * mask
    return Scored(rollouts, ["p"] * rows, torch.tensor(rewards), teacher_logprobs=teacher)


def test_advantages_are_teacher_minus_student_per_token() -> None:
    scored = _scored([1.0, 0.0, 0.0, 1.0])
    mask = scored.rollouts.response_mask
    assert scored.teacher_logprobs is not None
    gap = (scored.teacher_logprobs - scored.rollouts.logprobs) * mask
    sampled = {"kind": "hf_distill", "samples_per_prompt": 2, "distill_kl": "sampled"}
    alone = Distill(DistillConfig(**sampled)).training_data(scored)
    torch.testing.assert_close(alone.advantages, gap)
    mixed = DistillConfig(**sampled, reward_weight=0.5)
    by_reward = group_advantages(scored.rewards, 2)[:, None]
    torch.testing.assert_close(Distill(mixed).training_data(scored).advantages,
                               gap + 0.5 * by_reward * mask)  # fmt: skip
    assert by_reward.abs().sum() > 0  # the mixed case differs from the teacher alone
    no_teacher = Scored(scored.rollouts, scored.prompts, scored.rewards)
    with pytest.raises(ValueError, match="teacher's log-probs"):
        Distill(DistillConfig(kind="hf_distill", distill_kl="sampled")).training_data(no_teacher)
    # Exact: the reward's advantage alone goes to the policy loss; the rows travel on.
    rows = torch.log_softmax(torch.randn(4, 3, 7), -1)
    with_rows = Scored(scored.rollouts, scored.prompts, scored.rewards, teacher_rows=rows)
    exact = Distill(DistillConfig(kind="hf_distill", samples_per_prompt=2, reward_weight=0.5))
    data = exact.training_data(with_rows)
    torch.testing.assert_close(data.advantages, 0.5 * by_reward * mask)
    assert data.teacher_rows is rows


def test_exact_kl_is_the_reverse_kl_of_the_rows() -> None:
    """The exact estimator's per-position loss: KL(student ‖ teacher) over the vocabulary,
    the student's distribution at the run's temperature; zero where they agree."""
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 3, 8), torch.nn.Linear(8, 5)
    teacher = torch.log_softmax(torch.randn(2, 3, 5), -1)
    distill = Distill(DistillConfig(kind="hf_distill", temperature=0.5))
    distill.modules(Headed(head))  # type: ignore[arg-type]
    student = torch.distributions.Categorical(logits=head(hidden) / 0.5)
    expected = torch.distributions.kl_divergence(
        student, torch.distributions.Categorical(logits=teacher)
    )
    torch.testing.assert_close(distill.exact_kl(hidden, teacher), expected)
    same = torch.log_softmax(head(hidden) / 0.5, -1).detach()
    torch.testing.assert_close(distill.exact_kl(hidden, same), torch.zeros(2, 3), atol=1e-6, rtol=0)


class Headed:
    def __init__(self, head: torch.nn.Module) -> None:
        self.head = head


def _other_tokenizer(tmp_path: Path) -> str:
    return f"hf:{build(tmp_path / 'other', vocab=300)}"


BAD = {
    "teacher with another tokenizer": ("teacher = 'OTHER'\n", "`$.trainer.teacher`"),
    "reward weight without groups": (
        "teacher = 'tiny-llama'\nreward_weight = 0.5\nsamples_per_prompt = 1\n",
        "`$.trainer.reward_weight`",
    ),
    "teacher engine option it lacks": (
        "teacher = 'tiny-llama'\n[trainer.teacher_engine_options]\nkv_cache_gib = 2\n",
        "`$.trainer.teacher_engine_options.kv_cache_gib`",
    ),
    "no teacher": ("", "teacher"),
    "a teacher engine that scores nothing": (
        "teacher = 'tiny-llama'\nteacher_engine = 'vllm-server'\ndistill_kl = 'sampled'\n",
        "`$.trainer.teacher_engine`",
    ),
    "two in-process vLLM engines": (
        "engine = 'vllm'\nteacher = 'tiny-llama'\nteacher_engine = 'vllm'\n"
        "distill_kl = 'sampled'\n",
        "`$.trainer.teacher_engine`",
    ),
    "exact KL from a vLLM teacher": (
        "teacher = 'tiny-llama'\nteacher_engine = 'vllm'\n",
        "`$.trainer.distill_kl`",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_settings_are_one_line_and_exit_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings, place = BAD[case]
    settings = (
        settings.replace("OTHER", _other_tokenizer(tmp_path)) if "OTHER" in settings else settings
    )
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[run]\ndir = "{tmp_path / "run"}"\nsteps = 2\n\n[log]\nprogress = "off"\n\n'
        '[data]\nbatch_size = 2\n\n[trainer]\nkind = "hf_distill"\nmodel = "tiny-llama"\n'
        f"eval_size = 4\n{settings}"
    )
    capsys.readouterr()  # the other model's build writes a progress bar: not the run's
    code, _, err = call_main(["train", str(config)], capsys)
    assert_usage_error(code, err, place)
    assert not (tmp_path / "run" / "checkpoints").exists()


TEACHER = """[run]
name = "teacher"
steps = 400
[loop]
lr_schedule = "cosine"
eval_interval = 400
save_interval = 400
[data]
batch_size = 64
[trainer]
kind = "hf_sft"
model = "tiny-llama-large"
lr = 2e-3
eval_size = 64
"""
STUDENT = TEACHER.replace('"teacher"', '"student"').replace("400", "100").replace(
    "tiny-llama-large", "tiny-llama").replace("2e-3", "3e-3")  # fmt: skip
STEPS = 150


@pytest.mark.slow  # a teacher (400 steps), a student (100) and 150 distilled: ~3 minutes
def test_distilled_student_learns(tmp_path: Path) -> None:
    (tmp_path / "teacher.toml").write_text(TEACHER)
    (tmp_path / "student.toml").write_text(STUDENT)
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(ROOT / "configs" / "hf_distill.toml"),
         f"run.dir={tmp_path / 'run'}", f"run.steps={STEPS}", f"loop.eval_interval={STEPS}",
         "loop.save_interval=0", "trainer.eval_size=256", "log.progress=off",
         f"trainer.init_from={tmp_path / 'student.toml'}",
         f"trainer.teacher_from={tmp_path / 'teacher.toml'}",
         "data.batch_size=64", "trainer.samples_per_prompt=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    evals = {r["step"]: r["eval/reward"] for r in records if "eval/reward" in r}
    assert sorted(evals) == [0, STEPS]
    assert evals[STEPS] > evals[0] + 0.1, evals
    steps = [r for r in records if "train/distill_kl" in r]
    assert len(steps) == STEPS
    first, last = steps[0]["train/distill_kl"], steps[-1]["train/distill_kl"]
    assert last < first, (first, last)
    assert {"distill/reverse_kl", "perf/teacher_time_s"} <= steps[-1].keys()


def test_a_vllm_teacher_scores_sampled_tokens(tmp_path: Path) -> None:
    """distill_kl = "sampled" with the teacher on in-process vLLM (the student on the
    transformers engine): two steps train on its scores, and its engine is torn down
    before the student's."""
    pytest.importorskip("vllm")
    config = tmp_path / "distill.toml"
    config.write_text(
        f'[run]\ndir = "{tmp_path / "run"}"\nsteps = 2\n\n[log]\nprogress = "off"\n\n'
        "[loop]\nbaseline_eval = false\neval_interval = 0\n\n[data]\nbatch_size = 2\n\n"
        '[trainer]\nkind = "hf_distill"\nmodel = "tiny-llama"\nteacher = "tiny-llama-large"\n'
        'teacher_engine = "vllm"\ndistill_kl = "sampled"\nsamples_per_prompt = 2\n'
        "max_new_tokens = 4\neval_size = 4\n"
    )
    steps = _trained_steps(tmp_path, config)
    assert len(steps) == 2
    # A random teacher and student: far apart, and the teacher's log-probs are real ones.
    assert all(r["distill/reverse_kl"] != 0 and r["distill/teacher_logp"] < 0 for r in steps)
    _assert_teacher_torn_down_first(tmp_path)


def test_async_distillation_runs_the_teacher_on_its_own_lane(tmp_path: Path) -> None:
    """loop.concurrency = 2: rollouts (generation, then the teacher's scoring) run ahead
    of the update on lanes of their own, the student's engine and the teacher's each
    on its own; every step trains on scored batches (up to a version stale)."""
    config = tmp_path / "distill.toml"
    config.write_text(
        f'[run]\ndir = "{tmp_path / "run"}"\nsteps = 6\n\n[log]\nprogress = "off"\n\n'
        "[loop]\nconcurrency = 2\nmax_staleness = 1\nbaseline_eval = false\n"
        "eval_interval = 0\n\n[data]\nbatch_size = 4\n\n"
        '[trainer]\nkind = "hf_distill"\nmodel = "tiny-llama"\nteacher = "tiny-llama-large"\n'
        "samples_per_prompt = 1\nmax_new_tokens = 4\neval_size = 4\n"
    )
    steps = _trained_steps(tmp_path, config)
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert all("train/distill_kl" in r and r["perf/teacher_time_s"] > 0 for r in steps)
    _assert_teacher_torn_down_first(tmp_path)


def _trained_steps(tmp_path: Path, config: Path) -> list[dict[str, Any]]:
    """``corun train config`` (its run in tmp_path/run) and its steps' records."""
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(config)], cwd=tmp_path,
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]


def _assert_teacher_torn_down_first(tmp_path: Path) -> None:
    events = read_records(tmp_path / "run" / "events.jsonl")
    order = [e["event"] for e in events if e["event"].startswith("teardown:")]
    assert order.index("teardown:teacher") < order.index("teardown:engine"), order
