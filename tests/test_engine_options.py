"""The engines' precision and graph-mode settings (corun/engines/options.py) and
fingerprints of weights held in a lower precision (corun/engines/fingerprint.py).

- ``dtype = "auto"`` is bfloat16 where CUDA is available, float32 on CPU;
  ``enforce_eager`` unset is eager on CPU, CUDA graphs on a GPU; a wrong dtype is a
  usage error naming ``$.trainer.engine_options.dtype``. The "local" engine takes
  ``dtype`` (and the LoRA settings), not ``enforce_eager``.
- The "local" engine in bfloat16 holds its copy in bfloat16, generates, and a sync of
  the trainer's float32 state verifies against the state's fingerprint rounded to
  bfloat16 (the float32 fingerprint differs).
- vLLM's bfloat16 CPU attention asks torch whether the CPU has AMX: after vLLM's side
  of corun is imported, torch says yes only where the process may use AMX tiles (a VM
  may hide them, and vLLM would die of an illegal instruction).

vLLM in bfloat16 (in process, with the sync verified) was checked by hand on this CPU;
its float32 runs are tests/test_vllm.py and tests/test_engine_adapters.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import corun
from corun import Lane
from corun.contract.config_file import config_from_dict
from corun.contract.engine import Sampling
from corun.contract.trainer import SetupContext
from corun.engines.fingerprint import sync_verified, weights_fingerprint
from corun.engines.options import EngineOptions, VLLMConfig, eager, engine_dtype, resolved_dtype
from corun.engines.start import check_engine, check_placement
from corun.engines.transformers_engine import TransformersEngine
from corun.engines.vllm_common import engine_settings
from corun.engines.vllm_server import _placement
from corun.engines.weight_transfer import backend_for, server_env
from tests.support.config import make_config
from tests.support.vllm_helpers import perturb, prompts
from trainers.hf.policy import ChatFormat, HFPolicy


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_follows_the_device(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    auto = EngineOptions()
    assert resolved_dtype(auto) == ("bfloat16" if cuda else "float32")
    assert engine_dtype(auto) == (torch.bfloat16 if cuda else torch.float32)
    assert eager(auto) is not cuda
    chosen = EngineOptions(dtype="float16", enforce_eager=True)
    assert (resolved_dtype(chosen), engine_dtype(chosen), eager(chosen)) == (
        "float16", torch.float16, True,
    )  # fmt: skip


@pytest.mark.parametrize("cuda", [False, True])
def test_vllm_settings_follow_the_device(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    """On a GPU vLLM takes a memory share (0.3 on the trainer's GPU, 0.9 on its own,
    or as set) and, colocated, its sleep mode; its CPU build is given neither."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    apart = engine_settings(VLLMConfig(model="m", devices=[1], own_gpus=True))
    colocated = engine_settings(VLLMConfig(model="m", colocate=True))
    chosen = engine_settings(VLLMConfig(model="m", colocate=True, gpu_memory_utilization=0.5))
    if not cuda:
        gpu_only = {"gpu_memory_utilization", "enable_sleep_mode"}
        assert not gpu_only & (apart.keys() | colocated.keys())
        return
    assert apart["gpu_memory_utilization"] == 0.9 and "enable_sleep_mode" not in apart
    assert colocated["gpu_memory_utilization"] == 0.3 and colocated["enable_sleep_mode"] is True
    assert chosen["gpu_memory_utilization"] == 0.5


PLACEMENTS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "colocated above concurrency 1": (
        {"colocate": True},
        {"concurrency": 2, "max_staleness": 1},
        "loop.concurrency = 2",
    ),
    "a GPU this machine lacks": ({"devices": [0]}, {}, "this machine has 0 CUDA device"),
}


@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_engine_placement_is_checked_against_the_run(
    case: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    options, loop, why = PLACEMENTS[case]
    config = make_config(tmp_path, {"kind": "hf_grpo", "model": "hf:x"}, loop=loop)
    ctx = SetupContext(config)
    check_placement(EngineOptions(), ctx)
    with pytest.raises(corun.ConfigError) as refused:
        check_placement(EngineOptions(**options), ctx)
    setting = next(iter(options))
    assert str(refused.value).startswith(f"`$.trainer.engine_options.{setting}`")
    assert why in str(refused.value)


def test_local_engine_takes_dtype_not_graph_mode() -> None:
    check_engine("local", EngineOptions(dtype="bfloat16", lora_rank=8, max_loras=3), False)
    with pytest.raises(corun.ConfigError, match=r"`\$\.trainer\.engine_options\.enforce_eager`"):
        check_engine("local", EngineOptions(enforce_eager=False), False)


def test_wrong_dtype_names_the_setting() -> None:
    raw: dict[str, Any] = {
        "trainer": {"kind": "hf_grpo", "model": "hf:x", "engine_options": {"dtype": "fp8"}}
    }
    with pytest.raises(corun.ConfigError, match=r"`\$\.trainer\.engine_options\.dtype`"):
        config_from_dict(raw)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_local_engine_in_bfloat16(policy: HFPolicy, chat: ChatFormat) -> None:
    engine = TransformersEngine(
        policy, chat.pad_id, Lane("engine"), owns_lane=True, interrupt=False,
        dtype=torch.bfloat16,
    )  # fmt: skip
    try:
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        perturb(policy, seed=1)
        with anyio.fail_after(60):
            served = await sync_verified(engine, policy.weights(), 1, dtype=torch.bfloat16)
            assert served != weights_fingerprint(policy.weights().values())  # float32's
            rows = prompts(chat, 2)
            generations = await engine.generate(rows, Sampling(max_tokens=6), 0)
        assert [g.versions for g in generations] == [[1] * 6] * 2
        assert all(torch.tensor(g.logprobs).isfinite().all() for g in generations)
    finally:
        await engine.shutdown()


def test_amx_reported_only_where_usable() -> None:
    pytest.importorskip("vllm")
    from corun.engines.vllm_worker import amx_permitted

    if torch.cpu._is_amx_tile_supported():
        assert amx_permitted()


def test_server_apart_takes_weights_device_to_device() -> None:
    """A server on GPUs of its own (``devices``) takes the trained weights through
    vLLM's weight-transfer API: NCCL from another GPU, CUDA IPC on the trainer's own
    (NCCL does not join two ranks on one device), a file off CUDA; it runs tensor
    parallel over its GPUs unless set. (The transfer itself needs CUDA: it has not run
    here.)"""
    cuda0, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert backend_for([1, 2], cuda0) == "nccl"
    assert backend_for([0], cuda0) == "ipc"
    assert backend_for([1], cpu) is None and backend_for([], cuda0) is None
    apart = VLLMConfig(model="m", devices=[1, 2], weight_transfer="nccl")
    assert _placement(apart) == [
        "--tensor-parallel-size", "2", "--weight-transfer-config", '{"backend": "nccl"}',
    ]  # fmt: skip
    assert apart.workers == 2
    chosen = VLLMConfig(model="m", devices=[1, 2], options={"tensor_parallel_size": 1})
    assert _placement(chosen) == [] and chosen.workers == 1
    assert server_env("ipc") == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
