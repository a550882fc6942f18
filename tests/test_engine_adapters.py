"""LoRA adapters in the in-process engines (``update_adapter``: the engine side of
``[trainer.lora]``), on the tiny Llama with a peft adapter on q_proj and v_proj whose
A and B are both random (``init_lora_weights=False``), so it changes the model.

- The "local" engine, draining or interrupting: after an adapter sync its fingerprint
  is the trained state's (base and adapter) and its greedy tokens are the adapted
  model's; an adapter tensor it has no place for, or one it lacks, is an EngineError
  naming it. The wrappers pass ``update_adapter`` on, and refuse it for an engine
  without adapters.
- vLLM in process: after an adapter sync its fingerprint verifies, its greedy tokens
  differ from the base model's and its log-probs are the adapted model's (1e-4); a
  generation running during the next adapter sync finishes on the adapter it started
  with (its tokens carry that version, its log-probs are that adapter's) while new
  generations use the new one; old versions are unloaded, ``max_loras`` stay.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import anyio
import peft
import pytest
import torch

from corun import Lane
from corun.contract.engine import Adapter, Engine, EngineError, EngineWrapper, Sampling
from corun.engines.fingerprint import sync_verified, weights_fingerprint
from corun.engines.lora import base_weights, takes_adapters
from corun.engines.transformers_engine import TransformersEngine
from corun.loop.deadlines import BoundedEngine
from tests.support.vllm_helpers import (
    TOLERANCE,
    assert_argmax,
    max_diff,
    prompts,
    recompute,
    sampling_of,
)
from trainers.hf.policy import ChatFormat, HFPolicy
from trainers.hf.rl import to_rollouts

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # engines: both elsewhere

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def with_lora(policy: HFPolicy) -> peft.PeftModel:
    """Inject a random (not a no-op) LoRA into ``policy.model``, in place."""
    torch.manual_seed(0)
    config = peft.LoraConfig(**LORA, init_lora_weights=False)  # type: ignore[arg-type]
    return peft.get_peft_model(policy.model, config)  # type: ignore[arg-type]


def adapter_of(model: peft.PeftModel) -> Adapter:
    tensors = peft.get_peft_model_state_dict(model)
    config = model.peft_config["default"].to_dict()
    return Adapter(config, {name: t.detach().clone() for name, t in tensors.items()})


def train(policy: HFPolicy, seed: int) -> None:
    """Change the adapter's weights only (a LoRA step)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if ".lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)


# ------------------------------------------------------------------ the local engine


@pytest.mark.parametrize("interrupt", [False, True])
@pytest.mark.anyio
async def test_local_engine_serves_the_adapter(
    policy: HFPolicy, chat: ChatFormat, interrupt: bool
) -> None:
    model = with_lora(policy)
    engine = TransformersEngine(
        policy, chat.pad_id, Lane("engine"), owns_lane=True, interrupt=interrupt
    )
    try:
        with anyio.fail_after(60):
            train(policy, seed=1)  # the engine's copy still has the old adapter
            served = await sync_verified(engine, policy.weights(), 1, adapter=adapter_of(model))
            rows = prompts(chat, 4)
            generations = await engine.generate(rows, sampling_of("greedy", chat), 0)
            assert await engine.fingerprint() == served  # interrupt: once loaded too
        assert all(g.versions == [1] * len(g.ids) for g in generations)
        assert_argmax(policy, to_rollouts(rows, generations, chat.pad_id))
        adapter = adapter_of(model)
        name = next(iter(adapter.tensors))
        stray = name.replace("q_proj", "k_proj")
        extra = Adapter(adapter.config, {**adapter.tensors, stray: adapter.tensors[name]})
        with pytest.raises(EngineError, match=r"k_proj\.lora_A\.default\.weight"):
            await engine.update_adapter(extra, 2)
        short = Adapter(adapter.config, {k: t for k, t in adapter.tensors.items() if k != name})
        with pytest.raises(EngineError, match=r"q_proj\.lora_A\.default\.weight"):
            await engine.update_adapter(short, 2)
        assert engine.version == 1
    finally:
        await engine.shutdown()


@pytest.mark.anyio
async def test_wrappers_pass_adapters_on(policy: HFPolicy, chat: ChatFormat) -> None:
    model = with_lora(policy)
    local = TransformersEngine(policy, chat.pad_id, Lane("engine"), owns_lane=True, interrupt=False)
    bounded = BoundedEngine("the 'local' engine", "trainer.engine_options", 30.0, 10.0)
    bounded.inner = EngineWrapper(local)
    train(policy, seed=2)
    with anyio.fail_after(30):
        await bounded.update_adapter(adapter_of(model), 3)
        assert local.version == 3
        assert await bounded.fingerprint() == weights_fingerprint(policy.weights().values())
        await bounded.shutdown()
    assert takes_adapters(bounded)
    plain = cast(Engine, object())  # an engine without update_adapter
    assert not takes_adapters(EngineWrapper(plain))
    with pytest.raises(EngineError, match="takes no LoRA adapters"):
        await EngineWrapper(plain).update_adapter(adapter_of(model), 4)
    bounded = BoundedEngine("the 'x' engine", "trainer.engine_options", 30.0, 10.0)
    bounded.inner = plain
    with pytest.raises(EngineError, match="the 'x' engine takes no LoRA adapters"):
        await bounded.update_adapter(adapter_of(model), 4)


# ------------------------------------------------------------------ vLLM in process


def running(engine: Any) -> bool:
    return bool(engine._llm.llm_engine.has_unfinished_requests())


async def assert_matches(
    engine: Engine, policy: HFPolicy, chat: ChatFormat, rows: list[list[int]], version: int
) -> list[list[int]]:
    """Greedy tokens at ``version``, their log-probs the policy's; returns the tokens."""
    greedy = sampling_of("greedy", chat)
    generations = await engine.generate(rows, greedy, 0)
    assert all(g.versions == [version] * len(g.ids) for g in generations)
    rollouts = to_rollouts(rows, generations, chat.pad_id)
    mask = rollouts.response_mask.float()
    diff = max_diff(rollouts.logprobs, recompute(policy, rollouts, greedy), mask)
    assert diff < TOLERANCE, f"version {version}: behaviour vs adapted model differ by {diff}"
    return [g.ids for g in generations]


@pytest.mark.slow
@pytest.mark.anyio
async def test_vllm_serves_adapter_versions(
    model_dir: Any, policy: HFPolicy, chat: ChatFormat
) -> None:
    pytest.importorskip("vllm")
    from corun.engines.options import VLLMConfig
    from corun.engines.vllm_engine import VLLMEngine

    model = with_lora(policy)
    rows = prompts(chat, 4)
    with anyio.fail_after(180):
        engine = await VLLMEngine.start(VLLMConfig(model=str(model_dir), lora_rank=8))
    try:
        with anyio.fail_after(120):
            await engine.update_weights(base_weights(policy.weights()), 0)
            base = [g.ids for g in await engine.generate(rows, sampling_of("greedy", chat), 0)]
            await sync_verified(engine, policy.weights(), 1, adapter=adapter_of(model))
            adapted = await assert_matches(engine, policy, chat, rows, 1)
            assert adapted != base
            await assert_adapter_kept_in_flight(engine, policy, chat, model)
            for version in (3, 4):  # older versions unloaded, max_loras (2) kept
                train(policy, seed=version)
                await sync_verified(engine, policy.weights(), version, adapter=adapter_of(model))
            assert len(engine._llm.llm_engine.list_loras()) == 2
            await assert_matches(engine, policy, chat, rows, 4)
    finally:
        await engine.shutdown()


async def assert_adapter_kept_in_flight(
    engine: Any, policy: HFPolicy, chat: ChatFormat, model: peft.PeftModel
) -> None:
    """A long generation started at version 1 runs through the sync to version 2 and
    ends on version 1's adapter; one started after the sync uses version 2's."""
    rows = prompts(chat, 16)
    long = Sampling(max_tokens=200)  # no stop: every row runs to its length
    first = copy.deepcopy(policy)
    out: dict[str, Any] = {}

    async def run_long() -> None:
        out["long"] = await engine.generate(rows, long, 7)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run_long)
        while not running(engine):  # noqa: ASYNC110 (vLLM, on its lane)
            await anyio.sleep(0.01)
        train(policy, seed=2)
        await sync_verified(engine, policy.weights(), 2, adapter=adapter_of(model))
        assert "long" not in out  # the sync did not wait for it
        await assert_matches(engine, policy, chat, prompts(chat, 2), 2)
    generations = out["long"]
    assert all(g.versions == [1] * 200 for g in generations)
    rollouts = to_rollouts(rows, generations, chat.pad_id)
    mask = rollouts.response_mask.float()
    assert max_diff(rollouts.logprobs, recompute(first, rollouts, long), mask) < TOLERANCE
    assert max_diff(rollouts.logprobs, recompute(policy, rollouts, long), mask) > TOLERANCE


# ------------------------------------------------------------------ the vLLM server


@pytest.mark.slow  # a server start (~40 s)
@pytest.mark.anyio
async def test_vllm_server_serves_adapter_versions(
    model_dir: Any, policy: HFPolicy, chat: ChatFormat
) -> None:
    pytest.importorskip("vllm")
    from corun.engines.options import VLLMConfig
    from corun.engines.vllm_server import VLLMServerEngine

    model = with_lora(policy)
    rows = prompts(chat, 4)
    config = VLLMConfig(model=str(model_dir), lora_rank=8, start_timeout_s=240)
    with anyio.fail_after(270):
        engine = await VLLMServerEngine.start(config)
    try:
        with anyio.fail_after(120):
            await engine.update_weights(base_weights(policy.weights()), 0)
            base = [g.ids for g in await engine.generate(rows, sampling_of("greedy", chat), 0)]
            for version in (1, 2, 3):  # version 1 unloaded at 3, max_loras (2) kept
                train(policy, seed=version)
                await sync_verified(engine, policy.weights(), version, adapter=adapter_of(model))
                assert await assert_matches(engine, policy, chat, rows, version) != base
            assert sorted(p.name for p in (engine._workdir / "adapters").iterdir()) == ["2", "3"]
    finally:
        await engine.shutdown()
