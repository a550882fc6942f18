"""Weight updates of the in-process vLLM engine (vllm_engine.py): full weights reloaded
from the trainer's state, LoRA adapter versions, and vLLM's weight-transfer calls driven
by a trainer elsewhere (a fleet member on CUDA).

A full-weight update either drains or goes in flight (``VLLMConfig.interrupt``, from
``trainer.inflight_at_sync = "interrupt"``):

- drain: the admission pause (vllm_common.py) waits for every running generation, then
  the weights reload and the prefix cache is dropped (its KV came from the old weights);
- in flight: the reload is a lane call that runs between two decode steps (a drive
  returns at once when one waits: vllm_batching.py), without waiting for any
  generation. Running requests go on with the new weights from their next token, and
  each token records the version that produced it. Their KV so far came from the old
  weights: ``kv_at_switch = "keep"`` keeps it, as PipelineRL does (vLLM is then built
  without prefix caching, so no new request reuses old weights' KV either);
  ``"recompute"`` preempts every running request and recomputes its prompt and tokens
  so far under the new weights (vLLM's ``reset_prefix_cache(reset_running_requests=
  True)``): no stale KV, at the cost of one prefill per running request.

An adapter version never drains: it is loaded between two decode steps, and every
generation admitted after it uses it (vllm_common.AdapterVersions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
from torch import Tensor

from corun.contract.engine import Adapter, EngineError, TransferTarget
from corun.engines.lora import require_lora
from corun.engines.options import VLLMConfig, engine_dtype
from corun.engines.vllm_batching import Batcher
from corun.engines.vllm_common import AdapterVersions, Admission, LoadedAdapter, one_line
from corun.execution.compute import Lane


class WeightUpdates:
    """The weight-update half of :class:`corun.engines.vllm_engine.VLLMEngine`."""

    _config: VLLMConfig
    _lane: Lane
    _batcher: Batcher
    _admission: Admission
    _adapters: AdapterVersions
    _version: int
    _asleep: list[str]
    _transferring: bool
    _dead: str | None  # why the engine cannot be used any more (a failed update, ...)

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineError(f"vLLM engine unusable: {self._dead}")

    def _die(self, why: str) -> EngineError:
        self._dead = why
        return EngineError(why)

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Reload every weight in place as ``version``: after draining, or in flight
        (see the module's docstring). ``state`` is read during the call only."""
        self._check()
        await anyio.lowlevel.checkpoint_if_cancelled()  # see VLLMEngine.generate
        if self._config.interrupt:
            await self._reload(dict(state), version)
            return
        await self._admission.pause()
        try:
            self._check()
            await self._reload(dict(state), version)
        finally:
            self._admission.resume()

    async def _reload(self, state: dict[str, Tensor], version: int) -> None:
        self._batcher.update_waiting = True  # running drives give the lane up
        try:
            await self._lane.run(self._reload_blocking, state, version)
        except Exception as exc:
            raise self._die(
                f"vLLM weight reload for version {version} failed ({one_line(exc)}); "
                "the engine is unusable"
            ) from None
        finally:
            self._batcher.update_waiting = False
        self._version = version

    async def update_adapter(self, adapter: Adapter, version: int) -> None:
        """Load ``adapter`` into vLLM as policy ``version`` (without draining), then
        unload the versions no longer kept. A refused adapter is an
        :class:`EngineError`; the engine goes on serving the previous."""
        self._check()
        require_lora(self._config.lora_rank, "the vLLM engine")
        await anyio.lowlevel.checkpoint_if_cancelled()  # see VLLMEngine.generate
        entry = await anyio.to_thread.run_sync(self._adapters.write, adapter, version)
        try:
            await self._lane.run(self._add_lora_blocking, entry)
        except Exception as exc:
            AdapterVersions.drop(entry)
            raise EngineError(
                f"vLLM refused the adapter for version {version}: {one_line(exc)}"
            ) from None
        self._adapters.loaded.append(entry)
        self._version = version
        old = self._adapters.evictable()
        if old:
            await self._lane.run(self._remove_loras_blocking, old)

    async def fingerprint(self) -> str:
        """The fingerprint of the weights vLLM's worker holds, with the newest adapter
        as its LoRA manager loaded it (vllm_worker.py)."""
        self._check()
        await anyio.lowlevel.checkpoint_if_cancelled()  # see VLLMEngine.generate
        newest = self._adapters.newest
        directory = None if newest is None else str(newest.path)
        try:
            return await self._lane.run(self._fingerprint_blocking, directory)
        except RuntimeError as exc:  # vLLM no longer holds the newest adapter
            raise EngineError(f"vLLM weights fingerprint: {one_line(exc)}") from None

    def transfer_target(self) -> TransferTarget | None:
        """A fleet member's vLLM on CUDA receives over NCCL (engines/start.py sets it)."""
        if self._config.weight_transfer != "nccl":
            return None
        dtype = str(engine_dtype(self._config)).removeprefix("torch.")
        return TransferTarget("nccl", self._config.workers, dtype)

    async def transfer_step(self, step: str, body: dict[str, Any]) -> None:
        """One of vLLM's weight-transfer calls, driven by a trainer elsewhere
        (corun/engines/weight_transfer.py): passed to vLLM's workers as vLLM's own
        HTTP server does. Generation pauses from the start of an update to its finish;
        a failed step leaves the engine unusable (its workers' state is unknown)."""
        self._check()
        if step == "start_weight_update" and not self._transferring:
            await self._admission.pause()
            self._transferring = True
        kwargs = {k: body[k] for k in ("init_info", "update_info") if k in body}
        try:
            await self._lane.run(self._transfer_blocking, step, kwargs)
        except Exception as exc:
            self._end_transfer()
            raise self._die(f"vLLM weight transfer ({step}) failed: {one_line(exc)}") from None
        if step == "finish_weight_update":
            self._version = int(body.get("weight_version", self._version))
            self._batcher.weights_version = self._version
            self._end_transfer()

    def _end_transfer(self) -> None:
        if self._transferring:
            self._transferring = False
            self._admission.resume()

    # -- on the lane -----------------------------------------------------------------

    def _reload_blocking(self, state: dict[str, Tensor], version: int) -> None:
        from corun.engines.vllm_worker import reload_state

        llm = self._batcher.llm
        if llm is None:
            raise RuntimeError("the engine was shut down")
        if "weights" in self._asleep:  # colocated: the weights back before they load
            llm.wake_up(["weights"])
            self._asleep.remove("weights")
        tensors = {name: t.detach() for name, t in state.items()}
        llm.collective_rpc(reload_state, args=(tensors,))
        # Tokens from the next step on come from these weights.
        self._batcher.weights_version = version
        if self._config.interrupt and self._config.kv_at_switch == "keep":
            return  # running requests keep their KV (no prefix cache to drop)
        if not llm.reset_prefix_cache(reset_running_requests=self._config.interrupt):
            raise RuntimeError("vLLM kept its prefix cache (requests still running)")

    def _transfer_blocking(self, step: str, kwargs: dict[str, Any]) -> None:
        llm = self._batcher.llm
        llm.collective_rpc(step, kwargs=kwargs)
        if step == "finish_weight_update" and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache (requests still running)")

    def _fingerprint_blocking(self, adapter_dir: str | None) -> str:
        from corun.engines.vllm_worker import serving_fingerprint

        llm = self._batcher.llm
        return str(llm.collective_rpc(serving_fingerprint, args=(adapter_dir,))[0])

    def _add_lora_blocking(self, entry: LoadedAdapter) -> None:
        llm = self._batcher.llm
        if llm is None:
            raise RuntimeError("the engine was shut down")
        if not llm.llm_engine.add_lora(adapter_request(entry)):
            raise RuntimeError(f"vLLM did not load {entry.path}")

    def _remove_loras_blocking(self, entries: list[LoadedAdapter]) -> None:
        llm = self._batcher.llm
        for entry in entries:
            if llm is not None:
                llm.llm_engine.remove_lora(entry.ident)
            AdapterVersions.drop(entry)


def adapter_request(entry: LoadedAdapter | None) -> Any:
    """vLLM's LoRARequest for a loaded adapter version (None: the base weights)."""
    if entry is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(entry.name, entry.ident, str(entry.path))
