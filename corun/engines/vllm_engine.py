"""vLLM in process as a rollout engine (corun/contract/engine.py's ``Engine``). What it
shares with the server engine (vllm_server.py) — sampling, admission, error mapping —
is in vllm_common.py, their settings in options.py.

Token ids in (``TokensPrompt``), token ids out, each with its behaviour log-prob (the
temperature-scaled distribution before top-p; how vLLM is made to report it is in
vllm_worker.py) and the policy version it was sampled with. Every prompt gets its own
vLLM seed derived from ``(seed, index)``, so a prompt's sample does not depend on what
else is in the batch, and repeated prompts (a GRPO group) draw differently.

Blocking calls run on a :class:`corun.Lane`, the engine's own unless one is passed:
one dedicated thread, not anyio's thread pool, because ``vllm.LLM`` is not thread-safe
and torch keeps an OpenMP thread team per OS thread (corun/execution/compute.py). Generation
drives vLLM's engine step by step and calls :func:`corun.cancel_point` between decode
steps, so cancelling a ``generate`` aborts its requests within one step instead of
waiting for the whole batch. A call from an already-cancelled task starts no vLLM work
(a lane call that completes defers its caller's cancellation to the next checkpoint).

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
prompt vLLM rejects is an :class:`EngineError` and the engine stays usable; a failed
weight reload leaves vLLM's model half-loaded, so the engine is marked dead and every
later call raises :class:`EngineError` at once (``health()`` is false); its message
names the tensor being loaded. Tests: tests/test_vllm.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
from torch import Tensor

from corun.base.errors import ConfigError
from corun.contract.engine import EngineError, Finish, Generation, Sampling
from corun.engines.options import OPTIONS, EngineOptions, VLLMConfig
from corun.engines.vllm_common import (
    DrainingEngine,
    one_line,
    rejected_options,
    sampling_fields,
    unsupported_model,
)
from corun.execution.compute import Lane, cancel_point


class VLLMEngine(DrainingEngine):
    """``vllm.LLM`` in this process; create with ``await VLLMEngine.start(config)``."""

    _live: VLLMEngine | None = None  # the started engine not yet shut down, if any

    def __init__(self, llm: Any, config: VLLMConfig, lane: Lane, owns_lane: bool) -> None:
        self._llm = llm
        self._config = config
        self._lane, self._owns_lane = lane, owns_lane
        super().__init__()
        self._dead: str | None = None  # why the engine cannot be used any more
        self._ids = itertools.count()

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
            await lane.run(engine._generate_blocking, [[0]], Sampling(max_tokens=1), 0)
        except _Problem as failed:
            await engine.shutdown()
            raise unsupported_model(failed.message, config.model) or EngineError(
                f"vLLM warm-up failed: {failed.message}"
            ) from None
        except BaseException:  # cancelled (or interrupted) during the warm-up
            await engine.shutdown()
            raise
        return engine

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        self._check()
        # A lane call that completes swallows its caller's cancellation until the next
        # checkpoint; a cancelled caller must not start vLLM work (a loop of calls
        # would otherwise never stop).
        await anyio.lowlevel.checkpoint_if_cancelled()
        async with self._admission.generation():
            self._check()
            version = self._version  # no update runs while a generation is admitted
            try:
                outputs = await self._lane.run(
                    self._generate_blocking, [list(p) for p in prompts], sampling, seed
                )
            except _Rejected as rejected:
                raise EngineError(f"vLLM rejected a prompt: {rejected.message}") from None
            except _Failed as failed:
                raise self._die(f"vLLM failed while generating: {failed.message}") from None
        return [
            Generation(ids, logprobs, [version] * len(ids), finish)
            for ids, logprobs, finish in outputs
        ]

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

    async def health(self) -> bool:
        return self._dead is None

    async def shutdown(self) -> None:
        """Tear vLLM down on its lane (bounded by the lane's close), then the lane."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        self._dead = self._dead or "the engine was shut down"
        with anyio.CancelScope(shield=True):
            try:
                await self._lane.run(_teardown, llm)
            finally:
                if VLLMEngine._live is self:
                    VLLMEngine._live = None
                if self._owns_lane:
                    await anyio.to_thread.run_sync(self._lane.close)

    # -- internals -------------------------------------------------------------------

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineError(f"vLLM engine unusable: {self._dead}")

    def _die(self, why: str) -> EngineError:
        self._dead = why
        return EngineError(why)

    def _generate_blocking(
        self, prompts: list[list[int]], sampling: Sampling, seed: int
    ) -> list[tuple[list[int], list[float], Finish]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self._llm.llm_engine
        index: dict[str, int] = {}
        internal: list[str] = []
        try:
            for i, prompt in enumerate(prompts):
                params = SamplingParams(
                    **sampling_fields(sampling, seed, i), detokenize=False,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )  # fmt: skip
                name = f"corun-{next(self._ids)}"
                internal.append(engine.add_request(name, TokensPrompt(prompt_token_ids=prompt),
                                                   params))  # fmt: skip
                index[name] = i
        except Exception as exc:  # vLLM's input checks: nothing ran yet
            _abort(engine, internal)
            raise _Rejected(one_line(exc)) from exc
        done: list[Any] = [None] * len(prompts)
        try:
            while engine.has_unfinished_requests():
                cancel_point()  # between decode steps: a cancelled generate stops here
                for output in engine.step():
                    if output.finished:
                        done[index[output.request_id]] = output.outputs[0]
        except Exception as exc:
            raise _Failed(one_line(exc)) from exc
        finally:
            if any(out is None for out in done):  # cancelled or failed: free the requests
                _abort(engine, internal)
        return [_unpack(out) for out in done]

    def _reload_blocking(self, state: dict[str, Tensor]) -> None:
        from corun.engines.vllm_worker import reload_state

        tensors = {name: t.detach() for name, t in state.items()}
        self._llm.collective_rpc(reload_state, args=(tensors,))
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache (requests still running)")


class _Problem(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Rejected(_Problem):
    """vLLM refused a request before running anything: the engine is still usable."""


class _Failed(_Problem):
    """vLLM failed while stepping: its state is unknown."""


def _unpack(out: Any) -> tuple[list[int], list[float], Finish]:
    ids = list(out.token_ids)
    logprobs = [float(step[token].logprob) for step, token in zip(out.logprobs, ids, strict=True)]
    return ids, logprobs, "stop" if out.finish_reason == "stop" else "length"


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
        "model": config.model, "dtype": "float32", "enforce_eager": True,
        "max_num_seqs": config.max_num_seqs,
        "seed": config.seed, "distributed_executor_backend": "uni",
        "logprobs_mode": "processed_logits", "logits_processors": [BehaviourLogprobs],
        "generation_config": "vllm", "disable_log_stats": True,
        "use_tqdm_on_load": False,  # a progress bar on stderr at every start
    }  # fmt: skip
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
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


def _teardown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
