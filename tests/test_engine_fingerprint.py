"""Weight fingerprints (corun/engines/fingerprint.py) and the transformers engine's
fingerprint and top log-probs (corun/engines/transformers_engine.py, decode.py).

- The fingerprint is exact and independent of order, layout, fusing and zero padding
  (what vLLM does to the trained state), counts a tensor listed twice (tied weights)
  once, reads narrower floats as the float32 values they widen to, and any changed
  bit changes it.
- The "local" engine, draining or interrupting: after each sync its fingerprint is
  the trained state's, another after a change; a sync it silently skips
  (tests/support/faults.py's SkipReload) fails with one line naming the version. Its
  top log-probs are the policy's most likely tokens under the behaviour distribution.

The vLLM engines pass the same checks in tests/test_vllm.py and tests/test_vllm_server.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from torch import nn

from corun import Lane
from corun.engines.fingerprint import weights_fingerprint
from corun.engines.transformers_engine import TransformersEngine
from tests.support.vllm_helpers import (
    SAMPLINGS,
    assert_fingerprints_follow_syncs,
    assert_top_logprobs,
    prompts,
    sampling_of,
)
from trainers.hf.policy import ChatFormat, HFPolicy

# ---------------------------------------------------------------- the fingerprint


def test_fingerprint_ignores_order_layout_fusing_and_zero_padding() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 4, generator=generator) for _ in range(3))
    embedding = torch.randn(5, 4, generator=generator)
    trained = weights_fingerprint([q, k, v, embedding])
    fused = torch.cat([q, k, v])  # vLLM's qkv_proj
    padded = torch.cat([embedding, torch.zeros(3, 4)])  # a vocabulary padded with zeros
    assert weights_fingerprint([padded, fused]) == trained
    assert weights_fingerprint([padded.t(), fused.t().contiguous()]) == trained  # layout
    assert len(trained) == 16 and int(trained, 16) >= 0


def test_fingerprint_changes_with_any_bit() -> None:
    weight = torch.randn(64, generator=torch.Generator().manual_seed(1))
    changed = weight.clone()
    changed[17] = torch.nextafter(changed[17], torch.tensor(float("inf")))
    assert weights_fingerprint([changed]) != weights_fingerprint([weight])


def test_fingerprint_counts_shared_storage_once() -> None:
    """A state dict holds tied weights under two names (one tensor); an engine holds
    them once. A copy is another tensor and counts again."""
    weight = torch.randn(6, 4)
    assert weights_fingerprint([weight, weight.detach()]) == weights_fingerprint([weight])
    assert weights_fingerprint([weight, weight.clone()]) != weights_fingerprint([weight])


def test_fingerprint_of_other_dtypes() -> None:
    values = torch.randn(100, generator=torch.Generator().manual_seed(2))
    half = values.bfloat16()
    assert weights_fingerprint([half]) == weights_fingerprint([half.float()])  # exact widening
    wide = values.double()
    expected = sum(int(x) % 2**64 for x in wide.view(torch.int64).tolist()) % 2**64
    assert weights_fingerprint([wide]) == f"{expected:016x}"
    big = torch.tensor([2**62, 2**62, 2**62, 2**62, -1])  # sums past 2**64 wrap exactly
    assert weights_fingerprint([big]) == f"{(4 * 2**62 - 1) % 2**64:016x}"
    assert weights_fingerprint([torch.tensor([True, False, True])]) == f"{2:016x}"


# ---------------------------------------------------------------- the local engine


class TiedLM(nn.Module):
    """A model whose output head is its embedding (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


class Holder:
    def __init__(self, model: nn.Module) -> None:
        self.model = model


@pytest.fixture(params=["drain", "interrupt"])
async def local(
    request: pytest.FixtureRequest, policy: HFPolicy, chat: ChatFormat, anyio_backend: str
) -> AsyncIterator[TransformersEngine]:
    interrupt = request.param == "interrupt"
    lane = Lane("engine")
    engine = TransformersEngine(policy, chat.pad_id, lane, owns_lane=True, interrupt=interrupt)
    yield engine
    await engine.shutdown()


@pytest.mark.anyio
async def test_local_fingerprint_follows_syncs(
    local: TransformersEngine, policy: HFPolicy, chat: ChatFormat
) -> None:
    with anyio.fail_after(60):
        await assert_fingerprints_follow_syncs(local, policy)
        served = await local.fingerprint()
        # Interrupt: the published weights, then the same once a generation loads them.
        await local.generate(prompts(chat, 1), sampling_of("greedy", chat), 0)
        assert await local.fingerprint() == served


@pytest.mark.anyio
async def test_local_fingerprint_of_tied_weights(anyio_backend: str) -> None:
    """Tied weights: the state dict names the tensor twice, the engine's model holds it
    once, the interrupt snapshot keeps it one tensor: one fingerprint throughout."""
    trained = TiedLM()
    for interrupt in (False, True):
        engine = TransformersEngine(
            Holder(TiedLM()), 0, Lane("engine"), owns_lane=True, interrupt=interrupt
        )
        with anyio.fail_after(30):
            await engine.update_weights(trained.state_dict(), 1)
            assert await engine.fingerprint() == weights_fingerprint(trained.state_dict().values())
            assert await engine.fingerprint() == weights_fingerprint(trained.parameters())
            await engine.shutdown()


@pytest.mark.parametrize("case", list(SAMPLINGS))
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the engine's lane: both above
@pytest.mark.anyio
async def test_local_top_logprobs(
    policy: HFPolicy, chat: ChatFormat, case: str, anyio_backend: str
) -> None:
    engine = TransformersEngine(policy, chat.pad_id, Lane("engine"), owns_lane=True,
                                interrupt=False)  # fmt: skip
    try:
        with anyio.fail_after(60):
            await assert_top_logprobs(engine, policy, chat, sampling_of(case, chat))
    finally:
        await engine.shutdown()
