"""Shared by the engine tests (tests/test_vllm.py, tests/test_vllm_server.py,
tests/test_engine_fingerprint.py): the engine checks every engine passes (behaviour
log-probs across syncs, top log-probs, weight fingerprints, a failed reload),
a module's shared engine, a small ``hf_grpo`` table, a test-only HF GRPO trainer
loaded by ``corun train`` as ``kind = "tests.support.vllm_helpers:HeldGRPOTrainer"``,
and checks that a run's processes are gone. (Their fixtures: tests/support/vllm_fixtures.py.)

The held trainer wraps the real engine, which ``HFGRPOTrainer.setup`` started: entering
``generate`` or ``update_weights`` touches ``<run dir>/phase-generate`` / ``phase-sync``
(the markers tests/support/corun_process.py waits for), and with ``hold_in`` naming that
phase the call keeps the real engine busy until it is cancelled — generation repeats a
long decode (64 tokens, no stop), a weight update repeats the real reload — so a
signal lands inside vLLM's work, not in a sleep of the test's own.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import anyio
import pytest
import torch
from torch import Tensor

from corun import SetupContext
from corun.contract.engine import Engine, EngineError, EngineWrapper, Generation, Sampling
from corun.engines.fingerprint import sync_verified, weights_fingerprint
from tests.support.faults import SkipReload
from tests.support.processes import alive, group_alive, wait_until
from trainers.hf.policy import ChatFormat, HFPolicy
from trainers.hf.rl import HFGRPOConfig, HFGRPOTrainer, to_rollouts
from trainers.hf.tasks import eval_problems
from trainers.lm.engine import Rollouts
from trainers.lm.policy import rollout_logprobs

# ---------------------------------------------------------------- engine checks

E = TypeVar("E", bound=Engine)

TOLERANCE = 1e-4  # behaviour vs recomputed log-probs (measured: ~1e-6)
SYNC_SHIFT = 1e-2  # a real sync moves some log-prob by more than this (measured: > 0.1)
SAMPLINGS = {  # (temperature, top_p)
    "top_p": (0.7, 0.5),
    "full": (1.0, 1.0),
    "greedy": (0.0, 1.0),
}


def prompts(chat: ChatFormat, n: int = 8) -> list[list[int]]:
    return [chat.encode(example.prompt) for example in eval_problems(n)]


def sampling_of(case: str, chat: ChatFormat) -> Sampling:
    temperature, top_p = SAMPLINGS[case]
    return Sampling(max_tokens=12, temperature=temperature, top_p=top_p, stop_ids=(chat.eos_id,))


def recompute(policy: HFPolicy, rollouts: Rollouts, sampling: Sampling) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens (greedy: under T = 1)."""
    with torch.no_grad():
        return rollout_logprobs(policy, rollouts, sampling.temperature or 1.0)[0]


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def perturb(policy: HFPolicy, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


async def assert_logprobs_follow_syncs(
    engine: Engine, policy: HFPolicy, chat: ChatFormat, sampling: Sampling, syncs: int = 3
) -> None:
    """Version 0 = the policy's weights, then ``syncs`` changed weights: every time the
    behaviour log-probs equal the recomputed ones, and differ from the old weights'."""
    rows = prompts(chat)
    await engine.update_weights(policy.weights(), 0)  # whatever the engine held before
    old: HFPolicy | None = None
    for version in range(syncs + 1):
        if version:
            old = copy.deepcopy(policy)
            perturb(policy, seed=version)
            await engine.update_weights(policy.weights(), version)
        assert engine.version == version
        generations = await engine.generate(rows, sampling, seed=version)
        assert all(g.versions == [version] * len(g.ids) for g in generations)
        assert all(g.ids for g in generations)
        rollouts = to_rollouts(rows, generations, chat.pad_id)
        mask = rollouts.response_mask.float()
        behaviour = rollouts.logprobs
        diff = max_diff(behaviour, recompute(policy, rollouts, sampling), mask)
        assert diff < TOLERANCE, f"version {version}: behaviour vs recomputed differ by {diff}"
        if old is not None:
            stale = max_diff(behaviour, recompute(old, rollouts, sampling), mask)
            assert stale > SYNC_SHIFT, f"version {version}: the sync changed nothing ({stale})"
        if sampling.temperature == 0:  # greedy: every token is the policy's argmax
            assert_argmax(policy, rollouts)


def assert_argmax(policy: HFPolicy, rollouts: Rollouts) -> None:
    prompt_len = rollouts.prompt_ids.shape[1]
    sequences, attention = rollouts.sequences, rollouts.attention_mask
    with torch.no_grad():
        logits = policy(sequences[:, :-1], None if attention is None else attention[:, :-1])
    best = logits[:, prompt_len - 1 :].argmax(-1)
    mask = rollouts.response_mask
    assert torch.equal(best[mask], rollouts.response_ids[mask])


TOP_K = 5  # top log-probs asked for
TOP_TOLERANCE = 1e-4  # top vs recomputed log-probs (measured: < 3e-5, vLLM's offset)


async def assert_top_logprobs(
    engine: Engine, policy: HFPolicy, chat: ChatFormat, sampling: Sampling
) -> None:
    """With ``top_logprobs``, each step's top tokens are the policy's most likely under
    the behaviour distribution (temperature-scaled, before top-p; greedy: T = 1), with
    their log-probs, and the sampled tokens and behaviour log-probs are as without."""
    rows = prompts(chat, 4)
    await engine.update_weights(policy.weights(), 0)  # whatever the engine held before
    asked = dataclasses.replace(sampling, top_logprobs=TOP_K)
    generations = await engine.generate(rows, asked, seed=3)
    rollouts = to_rollouts(rows, generations, chat.pad_id)
    sequences, attention = rollouts.sequences, rollouts.attention_mask
    with torch.no_grad():
        logits = policy(sequences[:, :-1], None if attention is None else attention[:, :-1])
    start = rollouts.prompt_ids.shape[1] - 1
    dist = torch.log_softmax(logits[:, start:].float() / (sampling.temperature or 1.0), -1)
    for row, generation in enumerate(generations):
        assert generation.top is not None and len(generation.top) == len(generation.ids)
        for step, entries in enumerate(generation.top):
            ids = [token for token, _ in entries]
            values = torch.tensor([value for _, value in entries])
            expected = dist[row, step]
            assert len(ids) == TOP_K and values.isfinite().all(), entries
            assert (values[:-1] >= values[1:]).all(), entries  # best first
            assert_close(values, expected[ids], f"row {row} step {step}: top log-probs")
            assert_close(values, expected.topk(TOP_K).values, f"row {row} step {step}: top k")
            sampled = expected[generation.ids[step]].reshape(1)
            assert_close(torch.tensor([generation.logprobs[step]]), sampled, "behaviour")
    if sampling.temperature == 0:
        assert all(g.top and [s[0][0] for s in g.top] == g.ids for g in generations)
    plain = await engine.generate(rows, sampling, seed=3)  # the same draws without them
    assert [g.ids for g in plain] == [g.ids for g in generations]
    assert all(g.top is None for g in plain)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = float((got - want).abs().max())
    assert diff < TOP_TOLERANCE, f"{what} differ by {diff}: {got.tolist()} vs {want.tolist()}"


async def assert_fingerprints_follow_syncs(engine: Engine, policy: HFPolicy) -> None:
    """After a sync the engine's fingerprint is the trained state's; changed weights
    change it; a sync the engine silently skips fails ``sync_verified``, one line
    naming the version and both fingerprints."""
    version = engine.version
    first = await sync_verified(engine, policy.weights(), version + 1)
    assert first == weights_fingerprint(policy.weights().values())
    perturb(policy, seed=11)
    second = await sync_verified(engine, policy.weights(), version + 2)
    assert second != first and await engine.fingerprint() == second
    perturb(policy, seed=12)
    trained = weights_fingerprint(policy.weights().values())
    skipping = SkipReload(engine)
    with pytest.raises(EngineError) as failed:
        await sync_verified(skipping, policy.weights(), version + 3)
    assert str(failed.value) == (
        f"weight sync to version {version + 3}: the engine serves weights {second}, "
        f"not the trained {trained} (it did not reload them)"
    )
    assert skipping.skipped == [version + 3]


def hf_trainer(model_dir: Path, **settings: Any) -> dict[str, Any]:
    """A small hf_grpo trainer table (kind and engine may be overridden)."""
    return {
        "kind": "hf_grpo", "model": f"hf:{model_dir}", "engine": "vllm",
        "samples_per_prompt": 4, "max_new_tokens": 6, "eval_size": 8, **settings,
    }  # fmt: skip


RUN_TABLES: dict[str, dict[str, Any]] = {
    "loop": {"baseline_eval": False},
    "data": {"batch_size": 2},
    "log": {"progress": "off"},
}


class Engines(Generic[E]):
    """A module's shared engine, started on first use and again after a test killed or
    released it."""

    def __init__(self, start: Callable[[], Awaitable[E]], start_timeout_s: float) -> None:
        self._start, self.start_timeout_s = start, start_timeout_s
        self.engine: E | None = None

    async def get(self) -> E:
        if self.engine is not None and not await self.engine.health():
            await self.release()
        if self.engine is None:
            with anyio.fail_after(self.start_timeout_s):
                self.engine = await self._start()
        return self.engine

    async def release(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            with anyio.fail_after(60):
                await engine.shutdown()


async def assert_failed_reload_kills(engine: Engine, policy: HFPolicy) -> EngineError:
    version = engine.version
    state = dict(policy.weights())
    name = next(iter(state))
    state[name] = torch.zeros(3, 5)
    with anyio.fail_after(60):
        with pytest.raises(EngineError, match="weight reload for version 1 failed") as failed:
            await engine.update_weights(state, 1)
        assert name in str(failed.value)
        assert "\n" not in str(failed.value)
        assert not await engine.health()
    with anyio.fail_after(5):  # no engine work: each call fails before reaching it
        with pytest.raises(EngineError, match="unusable"):
            await engine.generate([[1, 2, 3]], Sampling(max_tokens=2), 0)
        with pytest.raises(EngineError, match="unusable"):
            await engine.update_weights(policy.weights(), 2)
    assert engine.version == version
    return failed.value


# ---------------------------------------------------------------- a held engine

Held = Literal["", "generate", "sync"]


class HeldGRPOConfig(HFGRPOConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    hold_in: Held = ""  # keep the engine busy in this phase until cancelled


class HeldEngine(EngineWrapper):
    """An :class:`Engine` that marks (and optionally holds) its phases."""

    def __init__(self, inner: Engine, run_dir: Path, hold_in: Held) -> None:
        super().__init__(inner)
        self.run_dir, self.hold_in = run_dir, hold_in

    async def _phase(self, phase: str) -> None:
        await anyio.Path(self.run_dir / f"phase-{phase}").touch()

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        await self._phase("generate")
        if self.hold_in == "generate":
            long = dataclasses.replace(sampling, max_tokens=64, stop_ids=())
            while True:  # in vLLM's decode steps until cancelled
                await self.inner.generate(prompts, long, seed)
        return await self.inner.generate(prompts, sampling, seed)

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        await self._phase("sync")
        while self.hold_in == "sync":  # reloading until cancelled
            await self.inner.update_weights(state, version)
        await self.inner.update_weights(state, version)


class HeldGRPOTrainer(HFGRPOTrainer):
    Config = HeldGRPOConfig

    async def setup(self, ctx: SetupContext) -> None:  # type: ignore[override]
        await super().setup(ctx)  # the real engine started, its shutdown registered
        self.engine = HeldEngine(self.engine, self.run_config.run_dir, self.config.hold_in)


# ---------------------------------------------------------------- processes


def assert_gone(pids: Sequence[int], what: str, timeout_s: float = 10.0) -> None:
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s)
    left = [pid for pid in pids if alive(pid)]
    assert not left, f"{what}: processes {left} outlived it"


def assert_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """``os.killpg(pgid, 0)`` raises ProcessLookupError: nothing of the group is left
    (zombies included: their parent must have reaped them)."""
    wait_until(lambda: not group_alive(pgid), timeout_s)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
