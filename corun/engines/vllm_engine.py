"""vLLM in process as a rollout engine (corun/contract/engine.py's ``Engine``). What it
shares with the server engine (vllm_server.py) — sampling, admission, error mapping —
is in vllm_common.py, their settings in options.py.

Token ids in (``TokensPrompt``), token ids out, each with its behaviour log-prob (the
temperature-scaled distribution before top-p; how vLLM is made to report it is in
vllm_worker.py), the policy version it was sampled with and, on request, the step's
top log-probs. Every prompt gets its own vLLM seed derived from ``(seed, index)``, so
a prompt's sample does not depend on what else is in the batch, and repeated prompts
(a GRPO group) draw differently.

Blocking calls run on a :class:`corun.Lane`, the engine's own unless one is passed:
one dedicated thread, not anyio's thread pool, because ``vllm.LLM`` is not thread-safe
and torch keeps an OpenMP thread team per OS thread (corun/execution/compute.py).

Continuous batching. Concurrent ``generate`` calls (an endpoint sends many) share the
running engine: each hands its requests over (a list under a lock) and repeats one lane
call, :meth:`VLLMEngine._drive`, until they are done. The lane runs one call at a time,
so one of them drives vLLM at any moment: between two decode steps it adds every
request handed over since (they join the running batch), steps, and files each
finished output with its call. A drive returns when its own call's requests are done,
when another call's are (that call's lane call, queued behind it, then returns them at
once), or after a 50 ms slice (so the lane's other calls and cancelled callers are not
kept waiting); its caller then queues it again. A call never waits for another's
requests to finish. Cancelling a ``generate`` aborts its requests within one step (its
own drive stops at the next step; a drive queued behind another's is skipped and its
requests aborted by a short lane call); the others go on. A call from an
already-cancelled task starts no vLLM work (a lane call that completes defers its
caller's cancellation to the next checkpoint). Weight updates drain as before: the
admission pause (vllm_common.py) waits for every running call.

What in-process vLLM does to its host, and what this module undoes: its CPU worker
replaces ``torch.set_num_threads`` with a no-op for the whole process (restored after
start-up) and seeds Python's, NumPy's and torch's global generators (their states are
restored). It also sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and
``VLLM_CPU_KVCACHE_SPACE`` in ``os.environ``. One in-process engine per process, and
enforced: vLLM's parallel state is process-wide, so a second engine's shutdown would
break the first (a second ``start`` is a ConfigError). vLLM's import-time log lines and
FutureWarnings are kept off the run's stderr (``VLLM_LOGGING_LEVEL`` still decides).

Failures: an option vLLM rejects (named by its path,
``$.trainer.engine_options.options.<key>``), or a model its CPU attention cannot run
(found by a one-token warm-up at start), is a :class:`corun.ConfigError`; a
prompt vLLM rejects is an :class:`EngineError` for its call and the engine stays
usable; a failure while stepping fails every running call and marks the engine dead; a
failed weight reload leaves vLLM's model half-loaded, so the engine is marked dead and
every later call raises :class:`EngineError` at once (``health()`` is false); its
message names the tensor being loaded. Tests: tests/test_vllm.py.

Precision and graph mode: ``[trainer.engine_options] dtype`` and ``enforce_eager``
with their per-device defaults (options.py). Colocation (``colocate``):
:meth:`VLLMEngine.sleep` and :meth:`VLLMEngine.wake` around each train step
(corun/loop/colocation.py); asleep, a generation is refused and a weight update wakes
the weights before loading them. LoRA (``lora_rank`` set): vLLM is built
with LoRA support, and :meth:`VLLMEngine.update_adapter` writes each adapter version
into the engine's own directory and loads it as a vLLM LoRA adapter on the lane,
between two decode steps, without draining: every generation admitted from then on
runs with it, one already running goes on with the one it started with (its tokens
carry that version). ``max_loras`` versions stay loaded, an older one is unloaded once
no generation uses it (vllm_common.AdapterVersions). Tests: tests/test_engine_adapters.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
from torch import Tensor

from corun.base.errors import ConfigError
from corun.contract.engine import (
    Adapter,
    EngineError,
    Finish,
    Generation,
    Sampling,
    ScoringRefused,
    TransferTarget,
)
from corun.engines.lora import require_lora
from corun.engines.options import OPTIONS, EngineOptions, VLLMConfig, engine_dtype
from corun.engines.vllm_common import (
    AdapterVersions,
    DrainingEngine,
    LoadedAdapter,
    engine_settings,
    nucleus_args,
    one_line,
    rejected_options,
    sampling_fields,
    top_entries,
    unsupported_model,
)
from corun.execution import guest
from corun.execution.compute import Lane, cancel_point, stop_requested

SLICE_S = 0.05  # the longest a drive steps before its caller queues it again
DISCARD_S = 10.0  # the longest a cancelled call waits for its requests to be aborted


class VLLMEngine(DrainingEngine):
    """``vllm.LLM`` in this process; create with ``await VLLMEngine.start(config)``."""

    _live: VLLMEngine | None = None  # the started engine not yet shut down, if any

    def __init__(self, llm: Any, config: VLLMConfig, lane: Lane, owns_lane: bool) -> None:
        self._llm = llm
        self._config = config
        self._lane, self._owns_lane = lane, owns_lane
        super().__init__()
        self._dead: str | None = None  # why the engine cannot be used any more
        self._stopping = False
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _inbox, _unclaimed, each _Batch's flags
        self._inbox: list[_Batch] = []  # handed over, not yet added to vLLM
        self._unclaimed: set[_Batch] = set()  # settled, its caller not yet told
        self._requests: dict[str, tuple[_Batch, int]] = {}  # in vLLM (the lane's alone)
        self._adapters = AdapterVersions(config.max_loras)
        self._asleep: list[str] = []  # what vLLM's sleep released: "weights", "kv_cache"
        self._transferring = False  # a trainer's weight transfer started, not finished

    @classmethod
    async def start(cls, config: VLLMConfig, lane: Lane | None = None) -> VLLMEngine:
        """Build the engine on ``lane`` (default: its own) and warm it up (one token).

        One at a time per process: vLLM's parallel state is process-wide, and the
        shutdown of a second engine would tear down the first one's as well.
        """
        if VLLMEngine._live is not None:
            raise ConfigError(
                '`$.trainer.engine` = "vllm": an in-process vLLM engine already runs in '
                'this process (one per process); use "vllm-server"'
            )
        own = lane is None
        lane = lane or Lane("vllm")
        try:
            # Building cannot be cut short (no cancel points in vLLM's start-up): a
            # cancellation lands at the warm-up below, which then tears vLLM down.
            llm = await lane.run(_build, config)
        except BaseException:
            if own:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(lane.close)
            raise
        engine = cls(llm, config, lane, own)
        VLLMEngine._live = engine
        try:
            warm = await engine._run(_Batch([[0]], Sampling(max_tokens=1), 0))
        except BaseException:  # cancelled (or interrupted) during the warm-up
            await engine.shutdown()
            raise
        if warm.problem is not None:
            await engine.shutdown()
            raise unsupported_model(warm.problem.message, config.model) or EngineError(
                f"vLLM warm-up failed: {warm.problem.message}"
            )
        return engine

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        self._check()
        if self._asleep:
            raise EngineError("vLLM is asleep (colocated: the trainer is stepping)")
        # A lane call that completes swallows its caller's cancellation until the next
        # checkpoint; a cancelled caller must not start vLLM work (a loop of calls
        # would otherwise never stop).
        await anyio.lowlevel.checkpoint_if_cancelled()
        async with self._admission.generation():
            self._check()
            with self._adapters.using() as adapter:  # the newest, to the end of the call
                # No weight update runs while a generation is admitted; an adapter
                # update changes the version only for generations admitted after it.
                version = self._version
                rows = [list(p) for p in prompts]
                batch = await self._run(_Batch(rows, sampling, seed, _request(adapter)))
            self._raise_problem(batch, "generating")
        return [_unpack(out, version, sampling) for out in batch.outputs]

    async def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Each completion token's log-prob (temperature 1): vLLM's prompt log-probs of
        the prompt and completion together, one token generated and dropped. Only an
        engine started to score (``VLLMConfig.scores_only``) reports them."""
        if not self._config.scores_only:
            raise ScoringRefused("this vLLM engine was started to sample, not to score")
        self._check()
        if self._asleep:
            raise EngineError("vLLM is asleep (colocated: the trainer is stepping)")
        await anyio.lowlevel.checkpoint_if_cancelled()  # see generate
        async with self._admission.generation():
            self._check()
            with self._adapters.using() as adapter:
                rows = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
                scoring = _Batch(rows, SCORING, 0, _request(adapter), scoring=True)
                batch = await self._run(scoring)
            self._raise_problem(batch, "scoring")
        return [_prompt_scores(out, len(c)) for out, c in zip(batch.outputs, completions,
                                                               strict=True)]  # fmt: skip

    async def distributions(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Tensor]:
        raise ScoringRefused("vLLM returns top-k log-probs only, not whole rows")

    def _raise_problem(self, batch: _Batch, doing: str) -> None:
        if isinstance(batch.problem, _Failed):
            raise self._die(f"vLLM failed while {doing}: {batch.problem.message}")
        if isinstance(batch.problem, _Rejected):
            raise EngineError(f"vLLM rejected a prompt: {batch.problem.message}")
        if batch.problem is not None:  # not expected: a cancelled call raises above
            raise EngineError(f"vLLM {doing} {batch.problem.message}")

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Reload every weight in place, then drop the prefix cache (its KV entries were
        computed with the old weights). ``state`` is read during the call only."""
        self._check()
        await anyio.lowlevel.checkpoint_if_cancelled()  # see generate
        await self._admission.pause()
        try:
            self._check()
            try:
                await self._lane.run(self._reload_blocking, dict(state))
            except Exception as exc:
                raise self._die(
                    f"vLLM weight reload for version {version} failed ({one_line(exc)}); "
                    "the engine is unusable"
                ) from None
            self._version = version
        finally:
            self._admission.resume()

    async def update_adapter(self, adapter: Adapter, version: int) -> None:
        """Load ``adapter`` into vLLM as policy ``version`` (without draining: see the
        module's docstring), then unload the versions no longer kept. A refused
        adapter is an :class:`EngineError`; the engine goes on serving the previous."""
        self._check()
        require_lora(self._config.lora_rank, "the vLLM engine")
        await anyio.lowlevel.checkpoint_if_cancelled()  # see generate
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
        await anyio.lowlevel.checkpoint_if_cancelled()  # see generate
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
            self._end_transfer()

    def _end_transfer(self) -> None:
        if self._transferring:
            self._transferring = False
            self._admission.resume()

    async def sleep(self, keep_weights: bool) -> None:
        """Colocation (``colocate``): vLLM's sleep mode gives the GPU memory back while
        the trainer steps — level 1 offloads the weights to CPU memory, level 2 drops
        them (a weight update follows, which wakes them first); the KV cache is dropped
        either way. On CPU vLLM's sleep does nothing, and the same calls run."""
        self._check()
        await self._lane.run(self._llm.sleep, 1 if keep_weights else 2)
        self._asleep = ["weights", "kv_cache"]

    async def wake(self) -> None:
        """Take back what :meth:`sleep` released and serve again."""
        self._check()
        if self._asleep:
            await self._lane.run(self._llm.wake_up, list(self._asleep))
            self._asleep = []

    async def health(self) -> bool:
        return self._dead is None

    async def shutdown(self) -> None:
        """Tear vLLM down on its lane (bounded by the lane's close), then the lane."""
        if self._llm is None or self._stopping:
            return
        self._stopping = True
        self._dead = self._dead or "the engine was shut down"
        with anyio.CancelScope(shield=True):
            try:
                await self._lane.run(self._teardown_blocking)
            finally:
                if VLLMEngine._live is self:
                    VLLMEngine._live = None
                await anyio.to_thread.run_sync(self._adapters.close)
                if self._owns_lane:
                    await anyio.to_thread.run_sync(self._lane.close)

    # -- internals -------------------------------------------------------------------

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineError(f"vLLM engine unusable: {self._dead}")

    def _die(self, why: str) -> EngineError:
        self._dead = why
        return EngineError(why)

    async def _run(self, batch: _Batch) -> _Batch:
        """Hand ``batch`` over and drive vLLM until it is settled (see the module's
        docstring); a cancelled call's requests are aborted before it returns."""
        with self._lock:
            self._inbox.append(batch)
        try:
            while not self._claim(batch):
                await self._lane.run(self._drive, batch)
        finally:
            if not self._claim(batch):  # cancelled while its drive was queued
                with anyio.move_on_after(DISCARD_S, shield=True):
                    await self._lane.run(self._discard, batch)
                self._claim(batch, leaving=True)  # no drive waits for it from now on
        return batch

    def _claim(self, batch: _Batch, *, leaving: bool = False) -> bool:
        """Whether ``batch`` is settled; if so (or its caller is leaving), no drive
        returns early for its caller any more."""
        with self._lock:
            if batch.settled or leaving:
                batch.claimed = True
                self._unclaimed.discard(batch)
            return batch.settled

    def _settle(self, batch: _Batch, problem: _Problem | None = None) -> None:
        with self._lock:
            if not batch.settled:
                batch.settled, batch.problem = True, problem
                if not batch.claimed:
                    self._unclaimed.add(batch)

    # -- on the lane -----------------------------------------------------------------

    def _drive(self, batch: _Batch) -> None:
        """Step vLLM for every call until ``batch`` is settled, another call's is (its
        caller's lane call is queued behind this one), the slice is over, or this
        call's caller is cancelled: then its requests are aborted, and only its."""
        llm = self._llm
        if llm is None:
            self._fail_all(_Failed("the engine was shut down"))
            return
        engine = llm.llm_engine
        until = time.monotonic() + SLICE_S
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for new in inbox:  # between two steps: new requests join the running batch
                self._add(engine, new)
            with self._lock:
                if batch.settled:  # this call's: its caller takes it when this returns
                    batch.claimed = True
                    self._unclaimed.discard(batch)
                if self._unclaimed or batch.settled:  # another's waits behind this call
                    return
            if stop_requested():
                self._abort(engine, batch, _Cancelled("was cancelled"))
                cancel_point()  # raises: the caller's cancellation goes on
            if time.monotonic() > until:
                return
            if not engine.has_unfinished_requests():  # not expected: fail, never spin
                self._fail_all(_Failed("vLLM lost the requests of running generations"))
                return
            try:
                outputs = engine.step()
            except Exception as exc:  # vLLM's state is unknown: every call fails
                self._fail_all(_Failed(one_line(exc)))
                return
            self._file(outputs)

    def _add(self, engine: Any, batch: _Batch) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling, extra = batch.sampling, nucleus_args(batch.sampling)
        batch.outputs, batch.left = [None] * len(batch.prompts), len(batch.prompts)
        try:
            for i, prompt in enumerate(batch.prompts):
                # Scoring: the prompt's own log-probs (0 extra: the token's only), raw.
                fields = ({"max_tokens": 1, "prompt_logprobs": 0} if batch.scoring
                          else sampling_fields(sampling, batch.seed, i))  # fmt: skip
                params = SamplingParams(
                    **fields, extra_args=extra, detokenize=False,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )  # fmt: skip
                name = f"corun-{next(self._ids)}"
                tokens = TokensPrompt(prompt_token_ids=prompt)
                internal = engine.add_request(name, tokens, params, lora_request=batch.adapter)
                batch.internal.append(internal)
                batch.names.append(name)
                self._requests[name] = (batch, i)
        except Exception as exc:  # vLLM's input checks: the call's requests never ran
            self._abort(engine, batch, _Rejected(one_line(exc)))
        if not batch.prompts:
            self._settle(batch)

    def _file(self, outputs: list[Any]) -> None:
        """Each finished output to its call; a call whose outputs are all in is settled."""
        for output in outputs:
            owner = self._requests.pop(output.request_id, None) if output.finished else None
            if owner is None:
                continue
            batch, index = owner
            batch.outputs[index] = output if batch.scoring else output.outputs[0]
            batch.left -= 1
            if batch.left == 0:
                self._settle(batch)

    def _abort(self, engine: Any, batch: _Batch, problem: _Problem) -> None:
        for name in batch.names:
            self._requests.pop(name, None)
        _abort(engine, batch.internal)
        self._settle(batch, problem)

    def _discard(self, batch: _Batch) -> None:
        """A cancelled call's requests, wherever they are: out of the inbox, or aborted."""
        with self._lock:
            if batch in self._inbox:
                self._inbox.remove(batch)
        if self._llm is None:
            self._settle(batch, _Cancelled("was cancelled"))
        elif not batch.settled:
            self._abort(self._llm.llm_engine, batch, _Cancelled("was cancelled"))

    def _fail_all(self, problem: _Problem) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        owners = {batch for batch, _ in self._requests.values()} | set(inbox)
        self._requests.clear()
        for batch in owners:
            self._settle(batch, problem)

    def _reload_blocking(self, state: dict[str, Tensor]) -> None:
        from corun.engines.vllm_worker import reload_state

        if "weights" in self._asleep:  # colocated: the weights back before they load
            self._llm.wake_up(["weights"])
            self._asleep.remove("weights")
        tensors = {name: t.detach() for name, t in state.items()}
        self._llm.collective_rpc(reload_state, args=(tensors,))
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache (requests still running)")

    def _transfer_blocking(self, step: str, kwargs: dict[str, Any]) -> None:
        self._llm.collective_rpc(step, kwargs=kwargs)
        if step == "finish_weight_update" and not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache (requests still running)")

    def _fingerprint_blocking(self, adapter_dir: str | None) -> str:
        from corun.engines.vllm_worker import serving_fingerprint

        return str(self._llm.collective_rpc(serving_fingerprint, args=(adapter_dir,))[0])

    def _add_lora_blocking(self, entry: LoadedAdapter) -> None:
        if self._llm is None:
            raise RuntimeError("the engine was shut down")
        if not self._llm.llm_engine.add_lora(_request(entry)):
            raise RuntimeError(f"vLLM did not load {entry.path}")

    def _remove_loras_blocking(self, entries: list[LoadedAdapter]) -> None:
        for entry in entries:
            if self._llm is not None:
                self._llm.llm_engine.remove_lora(entry.ident)
            AdapterVersions.drop(entry)

    def _teardown_blocking(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            self._fail_all(_Failed("the engine was shut down"))
            with guest.collections_left_to_exit():  # two full ones, to free memory
                llm.llm_engine.engine_core.shutdown()


@dataclass(eq=False)  # hashed by identity: the engine keeps sets of them
class _Batch:
    """One ``generate`` call's requests: handed to the lane by its caller, settled on
    the lane (outputs filed, or a problem), read by the caller once settled."""

    prompts: list[list[int]]
    sampling: Sampling
    seed: int
    adapter: Any = None  # the vLLM LoRARequest its requests run with, if any
    names: list[str] = field(default_factory=list)  # vLLM's request ids
    internal: list[str] = field(default_factory=list)  # the same, as vLLM aborts them
    outputs: list[Any] = field(default_factory=list)  # vLLM's CompletionOutput per prompt
    left: int = 0  # outputs not yet filed
    settled: bool = False  # nothing of it is left in vLLM (under the engine's lock)
    claimed: bool = False  # its caller has it, or left (under the engine's lock)
    problem: _Problem | None = None
    scoring: bool = False  # a score call's: outputs are vLLM's RequestOutputs


class _Problem(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Rejected(_Problem):
    """vLLM refused a request before running anything: the engine is still usable."""


class _Failed(_Problem):
    """vLLM failed while stepping: its state is unknown."""


class _Cancelled(_Problem):
    """The call's caller was cancelled; its requests were aborted."""


def _request(entry: LoadedAdapter | None) -> Any:
    """vLLM's LoRARequest for a loaded adapter version (None: the base weights)."""
    if entry is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(entry.name, entry.ident, str(entry.path))


def _unpack(out: Any, version: int, sampling: Sampling) -> Generation:
    ids = list(out.token_ids)
    steps = list(out.logprobs)
    logprobs = [float(step[token].logprob) for step, token in zip(steps, ids, strict=True)]
    finish: Finish = "stop" if out.finish_reason == "stop" else "length"
    generation = Generation(ids, logprobs, [version] * len(ids), finish)
    if sampling.top_logprobs:
        generation.top = [
            top_entries(((token, float(lp.logprob)) for token, lp in step.items()), sampling)
            for step in steps
        ]
    return generation


SCORING = Sampling(max_tokens=1)  # a score call's (its requests' fields are their own)


def _prompt_scores(out: Any, count: int) -> list[float]:
    """The log-probs vLLM reports for the last ``count`` tokens of a scored prompt."""
    ids, steps = list(out.prompt_token_ids), list(out.prompt_logprobs)
    first = len(ids) - count
    return [float(steps[i][ids[i]].logprob) for i in range(first, len(ids))]


def _abort(engine: Any, internal_ids: list[str]) -> None:
    try:
        engine.abort_request(internal_ids, internal=True)
    except Exception:  # a dead engine has nothing left to abort
        pass


def _build(config: VLLMConfig) -> Any:
    """Construct ``vllm.LLM`` (on the engine's lane) and undo its process-wide effects."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
    _quiet_vllm()
    from vllm import LLM

    from corun.engines.vllm_worker import BehaviourLogprobs

    set_num_threads = torch.set_num_threads
    states = (random.getstate(), torch.get_rng_state(), _numpy_state())
    kwargs: dict[str, Any] = {
        "model": config.model, **engine_settings(config),
        "max_num_seqs": config.max_num_seqs,
        "seed": config.seed, "distributed_executor_backend": "uni",
        "logprobs_mode": "processed_logits", "logits_processors": [BehaviourLogprobs],
        "generation_config": "vllm", "disable_log_stats": True,
        "use_tqdm_on_load": False,  # a progress bar on stderr at every start
    }  # fmt: skip
    if config.scores_only:  # prompt log-probs under processed_logits would be logits
        kwargs.update(logprobs_mode="raw_logprobs", logits_processors=[])
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.weight_transfer is not None:  # a fleet member on CUDA (transfer_step)
        kwargs["weight_transfer_config"] = {"backend": config.weight_transfer}
    clash = sorted(kwargs.keys() & config.options.keys())
    if clash:
        own = clash[0] in EngineOptions.__struct_fields__
        instead = f"use `$.trainer.engine_options.{clash[0]}`" if own else "not an option"
        raise ConfigError(f"`{OPTIONS}.{clash[0]}`: set by corun ({instead})")
    try:
        return LLM(**kwargs, **config.options)
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise rejected_options(exc, f"vLLM engine for {config.model}", config.options) from None
    finally:
        torch.set_num_threads = set_num_threads
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        _numpy_state(states[2])


def _quiet_vllm() -> None:
    """Keep vLLM's import-time chatter off the run's stderr: its loggers propagate to
    the root logger (corun's "corun: " lines) until vLLM configures them at engine
    start, and it triggers torch's FutureWarnings on import. VLLM_LOGGING_LEVEL, if
    set, still decides."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings are about itself
    try:
        logging.getLogger("vllm").setLevel(level.upper())
    except ValueError:  # a level name vLLM may know and logging does not: vLLM decides
        pass
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")


def _numpy_state(state: Any = None) -> Any:
    import numpy

    if state is not None:
        numpy.random.set_state(state)
    return numpy.random.get_state()
