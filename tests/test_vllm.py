"""vLLM in process as a rollout engine (corun/engines/vllm_engine.py).

- The behaviour log-probs vLLM records match the HF policy's recomputed ones (the
  trainer's ``rollout_logprobs``) at version 0 and after three syncs of changed
  weights, sampled with top-p, at the full distribution and greedy; each sync is real
  (the old weights' log-probs differ).
- Top log-probs are the policy's most likely tokens under the behaviour distribution;
  after each sync the engine's weights fingerprint (computed in vLLM's worker) is the
  trained state's, and a sync that silently did not reload fails with the version.
- Concurrent generations share the running engine (continuous batching): a call that
  joins a running one finishes first when it is shorter, on asyncio and trio;
  cancelling one, or one vLLM rejects, leaves the others running.
- A failed weight reload kills the engine: EngineError, ``health()`` false, every
  later call fails at once; a cancelled generation frees its requests.
- An in-process ``hf_grpo`` run with ``engine = "vllm"`` trains and syncs.
- Through a real ``corun train``: bad engine settings are exit 2 with one line naming
  the setting; Ctrl-C during generation and during a weight update is exit 130 with the
  documented teardown order and no process left.

vLLM allows one in-process engine per process (VLLMEngine.start), so the tests here
share one (the ``engines`` fixture); a test that breaks it or needs the process to
itself releases it, and the next one starts a fresh engine (~3-7 s).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("vllm")

import corun
from corun.contract.engine import EngineError, Sampling
from corun.engines.fingerprint import sync_verified, weights_fingerprint
from corun.engines.options import VLLMConfig
from corun.engines.vllm_engine import VLLMEngine
from corun.records.events import read_records
from tests.support.cli import assert_usage_error
from tests.support.config import make_config
from tests.support.corun_process import CorunRun, assert_interrupted
from tests.support.processes import children_of
from tests.support.state import assert_state_equal
from tests.support.vllm_helpers import (
    RUN_TABLES,
    SAMPLINGS,
    TOLERANCE,
    Engines,
    assert_failed_reload_kills,
    assert_fingerprints_follow_syncs,
    assert_gone,
    assert_logprobs_follow_syncs,
    assert_top_logprobs,
    hf_trainer,
    max_diff,
    perturb,
    prompts,
    recompute,
    sampling_of,
)
from trainers.hf.policy import ChatFormat, HFPolicy, load_policy
from trainers.hf.rl import to_rollouts
from trainers.hf.state import export

# Interrupted after set-up: every step this trainer registers, in the documented order.
INTERRUPTED_TEARDOWN = [
    "teardown:stop",
    "teardown:save",
    "teardown:checkpoints",
    "teardown:engine",
    "teardown:logging",
    "teardown:on_train_end",
]


# ------------------------------------------------------------ the engine, in process


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[Engines[VLLMEngine]]:
    held = Engines(lambda: VLLMEngine.start(VLLMConfig(model=str(model_dir))), 180)
    yield held
    anyio.run(held.release)


@pytest.mark.parametrize("case", list(SAMPLINGS))
@pytest.mark.anyio
async def test_behaviour_logprobs_match_policy_across_syncs(
    engines: Engines[VLLMEngine], policy: HFPolicy, chat: ChatFormat, case: str
) -> None:
    engine = await engines.get()
    with anyio.fail_after(120):
        await assert_logprobs_follow_syncs(engine, policy, chat, sampling_of(case, chat))


@pytest.mark.parametrize("case", list(SAMPLINGS))
@pytest.mark.anyio
async def test_top_logprobs(
    engines: Engines[VLLMEngine], policy: HFPolicy, chat: ChatFormat, case: str
) -> None:
    engine = await engines.get()
    with anyio.fail_after(60):
        await assert_top_logprobs(engine, policy, chat, sampling_of(case, chat))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a vLLM start of its own
@pytest.mark.anyio
async def test_scores_equal_the_recomputed_logprobs(
    engines: Engines[VLLMEngine], model_dir: Path, policy: HFPolicy, chat: ChatFormat,
    anyio_backend: str,
) -> None:  # fmt: skip
    """A distillation teacher's engine (trainers/hf/distill.py, distill_kl = "sampled"):
    started to score, vLLM's prompt log-probs of given completions, under the weights
    it holds, equal the model's own at temperature 1; whole rows it does not return,
    and an engine started to sample refuses to score."""
    rows = prompts(chat)
    sampler = await engines.get()
    with anyio.fail_after(60):
        generations = await sampler.generate(rows, sampling_of("full", chat), seed=1)
        with pytest.raises(EngineError, match="not to score"):
            await sampler.score(rows, [g.ids for g in generations])
    await engines.release()  # one in-process engine at a time
    perturb(policy, seed=5)  # weights of the teacher's own, loaded as corun loads them
    scorer = await VLLMEngine.start(VLLMConfig(model=str(model_dir), scores_only=True))
    try:
        with anyio.fail_after(120):
            await scorer.update_weights(policy.weights(), 0)
            scores = await scorer.score(rows, [g.ids for g in generations])
            with pytest.raises(EngineError, match="top-k"):
                await scorer.distributions(rows, [g.ids for g in generations])
    finally:
        await scorer.shutdown()
    assert [len(s) for s in scores] == [len(g.ids) for g in generations]
    rollouts = to_rollouts(rows, generations, chat.pad_id)
    scored = to_rollouts(rows, [replace(g, logprobs=s) for g, s in zip(generations, scores,
                                                                      strict=True)],
                         chat.pad_id)  # fmt: skip
    mask = rollouts.response_mask.float()
    diff = max_diff(scored.logprobs, recompute(policy, rollouts, sampling_of("full", chat)), mask)
    assert diff < TOLERANCE, diff


@pytest.mark.anyio
async def test_fingerprint_follows_syncs(engines: Engines[VLLMEngine], policy: HFPolicy) -> None:
    """vLLM's worker holds the HF state's values (fused, padded, the linear weights
    repacked for oneDNN): same fingerprint after each sync, another after a change."""
    engine = await engines.get()
    with anyio.fail_after(60):
        await assert_fingerprints_follow_syncs(engine, policy)


@pytest.mark.anyio
async def test_colocated_sleep_and_wake(
    engines: Engines[VLLMEngine], policy: HFPolicy, chat: ChatFormat
) -> None:
    """Colocation's calls (on CPU vLLM's sleep itself does nothing: corun's side is what
    runs here): asleep, a generation is refused; woken, the engine samples what it did
    before; asleep without its weights, a sync wakes them, loads and verifies them."""
    engine = await engines.get()
    rows, sampling = prompts(chat), sampling_of("full", chat)
    with anyio.fail_after(60):
        before = [g.ids for g in await engine.generate(rows, sampling, 3)]
        await engine.sleep(keep_weights=True)
        with pytest.raises(EngineError, match="asleep"):
            await engine.generate(rows, sampling, 3)
        await engine.wake()
        assert [g.ids for g in await engine.generate(rows, sampling, 3)] == before
        await engine.sleep(keep_weights=False)
        synced = await sync_verified(engine, policy.weights(), engine.version + 1)
        assert synced == weights_fingerprint(policy.weights().values())
        with pytest.raises(EngineError, match="asleep"):  # the KV cache is still released
            await engine.generate(rows, sampling, 3)
        await engine.wake()
        assert len(await engine.generate(rows, sampling, 3)) == len(rows)


def running(engine: VLLMEngine) -> bool:
    """Whether vLLM has requests (read from the test: a snapshot, good enough to wait on)."""
    return bool(engine._llm.llm_engine.has_unfinished_requests())


@pytest.mark.anyio
async def test_concurrent_generations_share_the_engine(
    engines: Engines[VLLMEngine], chat: ChatFormat
) -> None:
    """A short call started while a long one runs joins its batch and finishes well
    before it (one lane call per generation would make it wait for the long one)."""
    engine = await engines.get()
    rows = prompts(chat, 4)
    ended: dict[str, float] = {}

    async def run(name: str, max_tokens: int) -> None:
        await engine.generate(rows, Sampling(max_tokens=max_tokens), 0)
        ended[name] = time.monotonic()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run, "long", 150)
            while not running(engine):  # noqa: ASYNC110 (vLLM, on its lane)
                await anyio.sleep(0.01)
            tasks.start_soon(run, "short", 4)
    assert ended["short"] < ended["long"], ended
    assert not running(engine)


@pytest.mark.anyio
async def test_cancelled_or_rejected_call_leaves_the_others(
    engines: Engines[VLLMEngine], chat: ChatFormat
) -> None:
    """Beside a running call: one cancelled mid-generation and one whose prompt vLLM
    rejects (a token outside the vocabulary) end alone; the running one completes."""
    engine = await engines.get()
    rows = prompts(chat, 16)
    long = Sampling(max_tokens=200)  # no stop: every row runs to its length
    ended: dict[str, float] = {}

    async def run_long() -> None:
        generations = await engine.generate(rows, long, 0)
        ended["long"] = time.monotonic()
        assert [len(g.ids) for g in generations] == [200] * len(rows)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run_long)
            while not running(engine):  # noqa: ASYNC110 (vLLM, on its lane)
                await anyio.sleep(0.01)
            with anyio.move_on_after(0.1) as cut:
                await engine.generate(rows, long, 1)
            assert cut.cancelled_caught
            with pytest.raises(EngineError, match="vLLM rejected a prompt"):
                await engine.generate([[0, 10**6]], long, 2)
            ended["others"] = time.monotonic()
        assert ended["others"] < ended["long"], ended  # both ended while it ran
        assert not running(engine)
        assert await engine.health()
        assert len(await engine.generate(rows, Sampling(max_tokens=2), 3)) == len(rows)


@pytest.mark.anyio
async def test_one_in_process_engine_at_a_time(
    engines: Engines[VLLMEngine], model_dir: Path
) -> None:
    """A second engine would share vLLM's process-wide state, and its shutdown would
    break the first: refused, naming the setting, before anything is built."""
    await engines.get()
    with anyio.fail_after(10), pytest.raises(corun.ConfigError, match="vllm-server"):
        await VLLMEngine.start(VLLMConfig(model=str(model_dir)))
    assert await (await engines.get()).health()


@pytest.mark.anyio
async def test_cancelled_generation_frees_the_engine(
    engines: Engines[VLLMEngine], policy: HFPolicy, chat: ChatFormat
) -> None:
    """Cancelled between decode steps: its requests are aborted and its admission
    released, so an update and a new generation run at once."""
    engine = await engines.get()
    long = Sampling(max_tokens=100, temperature=1.0)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(engine.generate, prompts(chat, 64), long, 0)
            core = engine._llm.llm_engine
            while not core.has_unfinished_requests():  # noqa: ASYNC110 (vLLM, on its lane)
                await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()
        assert not core.has_unfinished_requests()
        assert await engine.health()
        await assert_logprobs_follow_syncs(engine, policy, chat, sampling_of("top_p", chat), 1)


@pytest.mark.anyio
async def test_failed_reload_kills_the_engine(
    engines: Engines[VLLMEngine], policy: HFPolicy
) -> None:
    """A wrong shape half-loads vLLM's model: EngineError naming the tensor, then the
    engine is dead — health() false, every call fails at once — and still shuts down."""
    engine = await engines.get()
    await assert_failed_reload_kills(engine, policy)
    await engines.release()


# ------------------------------------------------------------------ a run, in process


@pytest.mark.anyio
async def test_hf_grpo_run_with_vllm(
    engines: Engines[VLLMEngine], model_dir: Path, tmp_path: Path, anyio_backend: str
) -> None:
    await engines.release()  # the run starts its own engine: one per process
    config = make_config(
        tmp_path / "run", hf_trainer(model_dir), run={"steps": 3, "seed": 1},
        loop={"baseline_eval": False}, data={"batch_size": 2},
    )  # fmt: skip
    trainer = corun.resolve_trainer("hf_grpo")(config)
    with anyio.fail_after(240):
        outcome = await corun.run(trainer, config)
    assert outcome.reason == "done"
    metrics = read_records(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in metrics if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in steps)
    assert all(r["rollout/response_len_mean"] > 0 for r in steps)
    syncs = [r["perf/sync_time_s"] for r in metrics if "perf/sync_time_s" in r]
    assert len(syncs) == 3 and all(s >= 0 for s in syncs)
    events = read_records(tmp_path / "run" / "events.jsonl")
    assert [e["version"] for e in events if e["event"] == "sync"] == [1, 2, 3]
    engine_down = next(e for e in events if e["event"] == "teardown:engine")
    assert engine_down["status"] == "ok"
    assert VLLMEngine._live is None  # the run's teardown shut its engine down


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_colocated_run_sleeps_while_training(
    engines: Engines[VLLMEngine], model_dir: Path, tmp_path: Path, anyio_backend: str
) -> None:
    """``engine_options.colocate``: every step runs sleep → train → sync → wake (the
    events, in order), the engine drops its weights before each sync, and the run
    trains exactly as the same run without colocation (vLLM's sleep does nothing on
    CPU; the update is not fused into the rollout's lane call, which changes nothing)."""
    await engines.release()
    losses = {}
    for colocate in (False, True):
        config = make_config(
            tmp_path / f"run-{colocate}",
            hf_trainer(model_dir, engine_options={"colocate": colocate}),
            run={"steps": 3, "seed": 1}, loop={"baseline_eval": False, "eval_interval": 3},
            data={"batch_size": 2},
        )  # fmt: skip
        with anyio.fail_after(240):
            await corun.run(corun.resolve_trainer("hf_grpo")(config), config)
        metrics = read_records(tmp_path / f"run-{colocate}" / "metrics.jsonl")
        losses[colocate] = [r["train/loss"] for r in metrics if "train/loss" in r]
    assert losses[True] == losses[False] and len(losses[True]) == 3
    events = read_records(tmp_path / "run-True" / "events.jsonl")
    phases = [(e["event"], e["step"]) for e in events
              if e["event"] in ("sleep", "step", "sync", "wake", "eval")]  # fmt: skip
    # Each event carries the steps trained when it ended: a sleep's is the step before.
    assert phases == [
        (name, step - (name == "sleep")) for step in (1, 2, 3)
        for name in ("sleep", "step", "sync", "wake")
    ] + [("eval", 3)]  # fmt: skip
    assert all(e["keep_weights"] is False for e in events if e["event"] == "sleep")
    plain = read_records(tmp_path / "run-False" / "events.jsonl")
    assert "sleep" not in {e["event"] for e in plain}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the backends: the test above
@pytest.mark.anyio
async def test_async_run_then_export_loads_in_vllm(
    engines: Engines[VLLMEngine], model_dir: Path, tmp_path: Path, chat: ChatFormat,
    anyio_backend: str,
) -> None:  # fmt: skip
    """Concurrency 2 with the decoupled correction: vLLM generates while the policy
    trains (drained at syncs), batches are one version stale within the bound; the
    checkpoint then exports to a directory vLLM serves with the trained weights."""
    await engines.release()
    config = make_config(
        tmp_path / "run",
        hf_trainer(model_dir, off_policy_correction="decoupled", rollout_correction="none"),
        run={"steps": 6, "seed": 1}, data={"batch_size": 2},
        loop={"baseline_eval": False, "concurrency": 2, "max_staleness": 1},
    )  # fmt: skip
    trainer = corun.resolve_trainer("hf_grpo")(config)
    with anyio.fail_after(240):
        await corun.run(trainer, config)
    steps = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 6 and all(math.isfinite(r["train/loss"]) for r in steps)
    assert all(r["async/staleness_max"] <= 1 for r in steps)
    assert any(r["async/staleness_max"] == 1 for r in steps)  # generation overlapped training
    exported = export(str(tmp_path / "run"), tmp_path / "exported")
    policy, _ = load_policy(f"hf:{exported}", "exported")
    assert_state_equal(policy.weights(), trainer.policy.weights())  # type: ignore[attr-defined]
    with anyio.fail_after(180):
        engine = await VLLMEngine.start(VLLMConfig(model=str(exported)))
        try:  # no weight update: what vLLM loaded from the directory is the trained policy
            rows = prompts(chat)
            sampling = sampling_of("full", chat)
            rollouts = to_rollouts(rows, await engine.generate(rows, sampling, 0), chat.pad_id)
            mask = rollouts.response_mask.float()
            diff = max_diff(rollouts.logprobs, recompute(policy, rollouts, sampling), mask)
            assert diff < TOLERANCE
        finally:
            await engine.shutdown()


# ----------------------------------------------------------- through `corun train`

BAD: dict[str, tuple[dict[str, Any], str]] = {
    "unknown vLLM option": (
        {"engine": "vllm", "engine_options": {"options": {"bogus_flag": 1}}},
        "`$.trainer.engine_options.options.bogus_flag`",
    ),
    "engine options for the local engine": (
        {"engine": "local", "engine_options": {"kv_cache_gib": 2}},
        "`$.trainer.engine_options.kv_cache_gib`",
    ),
    "kv_at_switch for a fleet (each member's own setting)": (
        {
            "engine": "remote",
            "inflight_at_sync": "interrupt",
            "engine_options": {"urls": ["http://127.0.0.1:9"], "kv_at_switch": "recompute"},
        },
        "`$.trainer.engine_options.kv_at_switch`",
    ),
    "kv_at_switch without interrupt": (
        {"engine": "vllm", "engine_options": {"kv_at_switch": "recompute"}},
        "`$.trainer.engine_options.kv_at_switch`",
    ),
    "a colocated server": (
        {"engine": "vllm-server", "engine_options": {"colocate": True}},
        "`$.trainer.engine_options.colocate`",
    ),
    "devices of an in-process engine": (
        {"engine": "vllm", "engine_options": {"devices": [1]}},
        "`$.trainer.engine_options.devices`",
    ),
    "colocated with the local engine": (
        {"engine": "local", "engine_options": {"colocate": True}},
        "`$.trainer.engine_options.colocate`",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD))
def test_bad_engine_settings_are_exit_2(
    start_corun: Callable[..., CorunRun], model_dir: Path, case: str
) -> None:
    settings, place = BAD[case]
    run = start_corun(hf_trainer(model_dir, **settings), **RUN_TABLES)
    code = run.wait_exit(timeout=120)
    assert_usage_error(code, run.stderr(), place)
    assert not (run.run_dir / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["generate", "sync"])
def test_ctrl_c_in_vllm_work(
    start_corun: Callable[..., CorunRun], model_dir: Path, phase: str
) -> None:
    """SIGINT while the engine generates (a long decode) or reloads weights (step 1's
    sync): exit 130, teardown in the documented order, nothing left running."""
    held = "tests.support.vllm_helpers:HeldGRPOTrainer"
    trainer = hf_trainer(model_dir, kind=held, hold_in=phase)
    run = start_corun(trainer, **RUN_TABLES)
    run.wait_phase(phase, timeout=240)  # vLLM's start comes first: ~20 s, minutes when busy
    left = children_of(run.proc.pid)
    run.send(signal.SIGINT)
    code = run.wait_exit(timeout=60)
    events = assert_interrupted(run, code, signal.SIGINT, complete=False)
    teardown = [e["event"] for e in events if e["event"].startswith("teardown:")]
    assert teardown == INTERRUPTED_TEARDOWN
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == ([] if phase == "generate" else [1])
    said = [line for line in run.stderr().splitlines() if line.startswith("corun:")]
    assert said == ["corun: SIGINT: stopping; again to skip saving"]
    assert_gone(left, "corun train")
