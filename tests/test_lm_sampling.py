"""Sampling for the LM trainers: top-p log-probs, the transformers engine's draw by
inverse CDF, the TinyLM rollout engine's masks and behaviour log-probs, and GRPO's
dynamic-sampling refill with scripted rounds.

Expected numbers are worked out by hand in the comments, not recomputed with the
code under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import corun
from corun.engines.decode import sample_rows
from tests.support.config import make_config
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.lm.grpo import GRPOBatch, GRPOTrainer
from trainers.lm.model import top_p_log_probs
from trainers.lm.policy import build_policy, response_logprobs
from trainers.lm.policy_gradient import Scored
from trainers.lm.tasks import EOS, PAD, TASKS, encode_prompts

# ----------------------------------------------------------------------------- draws


def test_inverse_cdf_draws_follow_the_weights() -> None:
    """Row 0: weights 0.5 / 0.3 / 0.2 / 0 (the last never drawn); row 1 puts all on
    token 3. 40,000 draws: each frequency within 4 binomial standard errors (0.01)."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0]]).repeat(20_000, 1)
    drawn = sample_rows(probs, torch.Generator().manual_seed(0)).view(20_000, 2)
    counts = torch.bincount(drawn[:, 0], minlength=4).float() / 20_000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.01), counts
    assert counts[3] == 0 and bool((drawn[:, 1] == 3).all())
    again = sample_rows(probs, torch.Generator().manual_seed(0)).view(20_000, 2)
    assert torch.equal(drawn, again)  # one seed, one stream


def test_inverse_cdf_takes_weights_that_do_not_sum_to_one() -> None:
    """exp of log-probs sums to 1 only up to rounding: the draw scales by each row's
    total, so the last token with weight is still reachable, never one past it."""
    probs = torch.tensor([[0.0, 0.25, 0.25, 0.0]]).repeat(10_000, 1)  # sums to 0.5
    drawn = sample_rows(probs, torch.Generator().manual_seed(1))
    assert set(drawn.tolist()) == {1, 2}


# ----------------------------------------------------------------------------- top-p


def test_top_p_one_is_log_softmax() -> None:
    logits = torch.randn(3, 15, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top_p_log_probs(logits, 1.0), torch.log_softmax(logits, dim=-1))


def test_small_top_p_keeps_only_the_argmax() -> None:
    logits = torch.randn(4, 15, generator=torch.Generator().manual_seed(1))
    lp = top_p_log_probs(logits, 1e-3)
    best = logits.argmax(dim=-1)
    assert torch.equal(lp.gather(1, best[:, None]).squeeze(1), torch.zeros(4))
    others = torch.ones_like(lp, dtype=torch.bool).scatter(1, best[:, None], False)
    assert torch.isinf(lp[others]).all() and (lp[others] < 0).all()


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_kept_mass(top_p: float) -> None:
    logits = 2 * torch.randn(8, 15, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, dim=-1)
    lp = top_p_log_probs(logits, top_p)
    kept = torch.isfinite(lp)
    kept_mass = (probs * kept).sum(dim=-1)
    assert (kept_mass >= top_p - 1e-6).all()
    # The smallest such set: without its least likely token it falls short of top_p.
    smallest = probs.masked_fill(~kept, float("inf")).min(dim=-1).values
    assert (kept_mass - smallest < top_p).all()
    # Renormalised over the kept tokens, in proportion to the original probabilities.
    assert torch.allclose(lp.exp().sum(dim=-1), torch.ones(8), atol=1e-5)
    assert torch.allclose(lp.exp(), probs * kept / kept_mass[:, None], atol=1e-6)


# ----------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def tiny_policy() -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_policy(32, 1, 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_masks_and_behaviour_logprobs(tiny_policy: Any, temperature: float) -> None:
    task = TASKS["sort"]
    prompts = encode_prompts(["314259>", "000111>", "987654>", "555555>"])
    engine = LocalEngine(tiny_policy)
    engine.update_weights(tiny_policy.state_dict(), 3)
    gen = torch.Generator().manual_seed(1234)
    out = engine.generate(prompts, 8, task.max_answer_len + 1, temperature, 1.0, generator=gen)

    n_rows = 32
    assert out.prompt_ids.shape == (n_rows, prompts.shape[1])
    assert torch.equal(out.prompt_ids, prompts.repeat_interleave(8, dim=0))
    assert out.version == 3
    is_eos = out.response_ids == EOS
    has_eos = is_eos.any(dim=1)
    assert torch.equal(out.truncated, ~has_eos)
    # Both kinds of rows occur with this seed, so both branches are checked.
    assert has_eos.any() and (~has_eos).any()
    for row in range(n_rows):
        mask = out.response_mask[row]
        ids = out.response_ids[row]
        if has_eos[row]:
            first = int(is_eos[row].nonzero()[0])
            expected = torch.arange(ids.numel()) <= first
        else:
            expected = torch.ones(ids.numel(), dtype=torch.bool)
        assert torch.equal(mask, expected), row
        assert (ids[~mask] == PAD).all()
        assert (out.logprobs[row][~mask] == 0).all()
        assert (out.logprobs[row][mask] < 0).all()

    # The "ratio is 1 for unchanged weights" invariant: the trainer's log-probs of the
    # same sequences with the same weights and temperature equal the behaviour ones.
    logp, _, _ = response_logprobs(tiny_policy, out.sequences, out.prompt_ids.shape[1], temperature)
    logp = logp.masked_fill(~out.response_mask, 0.0)
    assert torch.allclose(logp, out.logprobs, atol=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_ratio_is_one_for_unchanged_weights(tmp_path: Path, top_p: float) -> None:
    """Through the trainer: sample, then the policy loss with the same weights.

    With every ratio 1 and A = -1 the per-token loss is exactly 1, nothing clips and
    the KL estimate to the behaviour policy is 0 -- with top-p sampling too, where
    the behaviour log-probs come from the truncated distribution.
    """
    with torch.random.fork_rng():
        torch.manual_seed(0)
        trainer = grpo_trainer(tmp_path, dynamic_sampling=False, top_p=top_p)
        ctx = corun.RolloutContext(0, corun.rollout_generator(0, 0, 0))
        scored, _ = trainer.sample_and_score(trainer.dataset().batch(0), ctx)
    rows = slice(0, scored.rollouts.prompt_ids.shape[0])
    with torch.no_grad():
        loss, metrics, _ = trainer.policy_loss(
            scored.rollouts, rows, -torch.ones(rows.stop, 1), None
        )
    assert metrics["clip_ratio"] == 0.0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-5)
    assert float(loss) == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------- GRPO refill

GROUP = 4  # samples_per_prompt
WANTED = 4  # data.batch_size: groups per step
FLAT, INFO = "flat", "info"


def grpo_trainer(tmp_path: Path, **overrides: Any) -> GRPOTrainer:
    trainer_cfg = {
        "kind": "grpo", "d_model": 32, "n_heads": 2, "n_layers": 1, "dynamic_sampling": True,
        "max_sampling_rounds": 3, "samples_per_prompt": GROUP, "eval_size": 8, **overrides,
    }  # fmt: skip
    config = make_config(tmp_path, trainer_cfg, data={"batch_size": WANTED})
    trainer = GRPOTrainer(config)
    trainer.setup(corun.SetupContext(config))
    return trainer


def scored_round(round_index: int, kinds: list[str], width: int) -> Scored:
    """One scripted round: ``kinds`` per group; group ``g`` of round ``r`` is tagged
    ``10·r + g`` in its prompt ids so the test can tell which groups were kept."""
    rows = len(kinds) * GROUP
    tags = torch.tensor([10 * round_index + g for g in range(len(kinds))])
    rewards = torch.cat([
        torch.ones(GROUP) if kind == FLAT else torch.tensor([1.0, 0.0, 0.5, 0.0])
        for kind in kinds
    ])  # fmt: skip
    rollouts = Rollouts(
        prompt_ids=tags.repeat_interleave(GROUP)[:, None].repeat(1, 7),
        response_ids=torch.full((rows, width), 5),
        response_mask=torch.ones(rows, width, dtype=torch.bool),
        logprobs=torch.full((rows, width), -1.0),
        truncated=torch.zeros(rows, dtype=torch.bool),
        token_versions=torch.full((rows, width), round_index),
        version=round_index,
    )
    return Scored(rollouts, [f"p{int(tag)}" for tag in tags.repeat_interleave(GROUP)], rewards)


class Script:
    """A stand-in for ``sample_and_score`` that plays back rounds and records calls."""

    def __init__(self, rounds: list[list[str]]) -> None:
        self.rounds = rounds
        self.chunks: list[list[tuple[str, str]]] = []

    def __call__(
        self, examples: list[tuple[str, str]], ctx: corun.RolloutContext
    ) -> tuple[Scored, dict[str, float]]:
        index = len(self.chunks)
        self.chunks.append(examples)
        kinds = self.rounds[index]
        assert len(examples) == len(kinds)
        metrics = {
            "rollout/reward_mean": float(index),
            "perf/generate_time_s": 1.0,
            "perf/reward_time_s": 0.5,
        }
        return scored_round(index, kinds, width=3 + index), metrics


def run_make_batch(
    trainer: GRPOTrainer, monkeypatch: pytest.MonkeyPatch, rounds: list[list[str]]
) -> tuple[GRPOBatch, dict[str, float], Script]:
    script = Script(rounds)
    monkeypatch.setattr(trainer, "sample_and_score", script)
    examples = [(f"{i:06d}>", "") for i in range(WANTED * trainer.prompt_rounds())]
    batch, metrics = trainer.make_batch(examples, corun.RolloutContext(0, torch.Generator()))
    # Each round draws the next slice of the step's prompts.
    for index, chunk in enumerate(script.chunks):
        assert chunk == examples[index * WANTED : (index + 1) * WANTED]
    return batch, metrics, script


def kept_tags(batch: GRPOBatch) -> list[int]:
    return batch.rollouts.prompt_ids[::GROUP, 0].tolist()


def test_dynamic_sampling_refills_over_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = grpo_trainer(tmp_path)
    assert trainer.prompt_rounds() == 3
    assert trainer.dataset().batch_size == WANTED * 3
    rounds = [[FLAT, INFO, FLAT, INFO], [FLAT, INFO, FLAT, FLAT], [INFO, FLAT, INFO, INFO]]
    batch, metrics, script = run_make_batch(trainer, monkeypatch, rounds)
    assert len(script.chunks) == 3
    # Round 1 gives groups 1 and 3, round 2 its group 0 (tag 11), round 3 its first
    # informative group (tag 20) and no more: exactly batch_size groups.
    assert kept_tags(batch) == [1, 3, 11, 20]
    assert batch.rollouts.prompt_ids.shape[0] == WANTED * GROUP
    assert batch.advantages.shape == (WANTED * GROUP,)
    # Responses of different widths are right-padded to the widest kept round.
    assert batch.rollouts.response_ids.shape[1] == 5
    assert not batch.rollouts.response_mask[:8, 3:].any()
    # No flat group is left: every kept group carries signal.
    for g in range(WANTED):
        assert batch.advantages[g * GROUP : (g + 1) * GROUP].abs().sum() > 0
    assert metrics["rollout/zero_std_group_ratio"] == 0.5  # round 1: 2 of 4 flat
    assert metrics["rollout/sampling_rounds"] == 3.0
    assert metrics["rollout/kept_groups"] == 4.0
    assert metrics["rollout/reward_mean"] == 0.0  # round 1's sampling metrics
    assert metrics["perf/generate_time_s"] == pytest.approx(3.0)  # summed over rounds
    assert metrics["perf/reward_time_s"] == pytest.approx(1.5)


def test_dynamic_sampling_stops_when_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = grpo_trainer(tmp_path)
    rounds = [[INFO, FLAT, INFO, FLAT], [INFO, INFO, INFO, FLAT], [INFO] * 4]
    batch, metrics, script = run_make_batch(trainer, monkeypatch, rounds)
    assert len(script.chunks) == 2, "sampled another round after the batch was full"
    assert kept_tags(batch) == [0, 2, 10, 11]
    assert metrics["rollout/sampling_rounds"] == 2.0
    assert metrics["rollout/kept_groups"] == 4.0
    assert metrics["rollout/zero_std_group_ratio"] == 0.5


def test_dynamic_sampling_first_round_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = grpo_trainer(tmp_path)
    batch, metrics, script = run_make_batch(trainer, monkeypatch, [[INFO] * 4] * 3)
    assert len(script.chunks) == 1
    assert kept_tags(batch) == [0, 1, 2, 3]
    assert metrics["rollout/zero_std_group_ratio"] == 0.0
    assert metrics["rollout/sampling_rounds"] == 1.0


def test_dynamic_sampling_partial_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only 3 informative groups in all 3 rounds: those 3 are kept, nothing flat.
    trainer = grpo_trainer(tmp_path)
    rounds = [[FLAT, FLAT, INFO, FLAT], [FLAT] * 4, [INFO, FLAT, INFO, FLAT]]
    batch, metrics, script = run_make_batch(trainer, monkeypatch, rounds)
    assert len(script.chunks) == 3
    assert kept_tags(batch) == [2, 20, 22]
    assert metrics["rollout/kept_groups"] == 3.0
    assert metrics["rollout/zero_std_group_ratio"] == 0.75


def test_dynamic_sampling_all_flat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = grpo_trainer(tmp_path)
    batch, metrics, script = run_make_batch(trainer, monkeypatch, [[FLAT] * 4] * 3)
    assert len(script.chunks) == 3
    assert batch.rollouts.prompt_ids.shape[0] == WANTED * GROUP
    assert torch.equal(batch.advantages, torch.zeros(WANTED * GROUP))
    assert metrics["rollout/kept_groups"] == 0.0
    assert metrics["rollout/sampling_rounds"] == 3.0
    assert metrics["rollout/zero_std_group_ratio"] == 1.0


def test_without_dynamic_sampling_nothing_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = grpo_trainer(tmp_path, dynamic_sampling=False)
    assert trainer.prompt_rounds() == 1
    assert trainer.dataset().batch_size == WANTED
    batch, metrics, script = run_make_batch(trainer, monkeypatch, [[FLAT, INFO, FLAT, INFO]])
    assert len(script.chunks) == 1
    assert kept_tags(batch) == [0, 1, 2, 3]
    # The flat groups stay, with zero advantages.
    assert torch.equal(batch.advantages[0:4], torch.zeros(4))
    assert torch.equal(batch.advantages[8:12], torch.zeros(4))
    assert batch.advantages[4:8].abs().sum() > 0
    assert metrics["rollout/zero_std_group_ratio"] == 0.5
    assert metrics["rollout/sampling_rounds"] == 1.0
    assert metrics["rollout/kept_groups"] == 4.0
