"""In-flight weight updates on the in-process vLLM engine (``inflight_at_sync =
"interrupt"``: corun/engines/vllm_updates.py), on asyncio and trio.

A 160-token generation spans two updates of changed weights: each update returns while
it still runs, every token records the version that produced it (0, then 1, then 2, in
order, in every row), and its behaviour log-prob is the trainer's recomputation under
that version's weights — exactly with ``kv_at_switch = "recompute"`` (the running
requests' KV recomputed under the new weights); with ``"keep"`` (their KV from older
weights, as PipelineRL) exactly up to the first switch, and measurably off after it.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

pytest.importorskip("vllm")

from corun.engines.options import VLLMConfig
from corun.engines.vllm_engine import VLLMEngine
from tests.support.inflight import generate_across_syncs, mismatch_by_version
from tests.support.vllm_helpers import TOLERANCE
from trainers.hf.policy import ChatFormat, HFPolicy

pytestmark = pytest.mark.anyio


def running_tokens(engine: VLLMEngine) -> int:
    """The fewest tokens a running request has so far (0: none running yet)."""
    requests = engine._batcher._requests.values()  # the test peeks at the lane's state
    return min((len(batch.outputs[index].ids) for batch, index in requests), default=0)


@pytest.mark.parametrize("kv", ["keep", "recompute"])
async def test_generation_spans_two_inflight_updates(
    model_dir: Path, policy: HFPolicy, chat: ChatFormat, anyio_backend: str, kv: str
) -> None:
    config = VLLMConfig(model=str(model_dir), interrupt=True, kv_at_switch=kv)  # type: ignore[arg-type]
    with anyio.fail_after(120):
        engine = await VLLMEngine.start(config)
    try:
        assert engine.interrupts
        with anyio.fail_after(180):
            rows, generations, policies = await generate_across_syncs(
                engine, policy, chat, lambda: running_tokens(engine)
            )
    finally:
        await engine.shutdown()
    for generation in generations:
        assert len(generation.ids) == 160 and generation.finish == "length"
        assert generation.versions == sorted(generation.versions)
        assert set(generation.versions) == {0, 1, 2}
    found = mismatch_by_version(rows, generations, policies, chat)
    assert found[0][0] < TOLERANCE, found  # before any switch: the behaviour's weights
    later = max(found[1][0], found[2][0])
    if kv == "recompute":
        assert later < TOLERANCE, found
    else:  # the prefix's KV came from older weights: the log-probs say so
        assert later > 10 * TOLERANCE, found
