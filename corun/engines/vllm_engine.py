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

The engine's parts: continuous batching of every call's requests on the lane, each
token stamped with the version of the weights that produced it (vllm_batching.py), and
weight updates — full weights after a drain or in flight (``inflight_at_sync =
"interrupt"``), LoRA adapter versions, vLLM's weight transfer (vllm_updates.py). A call
from an already-cancelled task starts no vLLM work (a lane call that completes defers
its caller's cancellation to the next checkpoint).

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

import logging
import os
import random
import warnings
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
from torch import Tensor

from corun.base.errors import ConfigError
from corun.contract.engine import EngineError, Generation, Sampling, ScoringRefused, TokenSink
from corun.engines.options import OPTIONS, EngineOptions, VLLMConfig
from corun.engines.vllm_batching import SCORING, Batcher, Failed, Rejected, Requests, prompt_scores
from corun.engines.vllm_common import (
    AdapterVersions,
    DrainingEngine,
    engine_settings,
    rejected_options,
    unsupported_model,
)
from corun.engines.vllm_updates import WeightUpdates, adapter_request
from corun.execution import guest
from corun.execution.compute import Lane


class VLLMEngine(WeightUpdates, DrainingEngine):
    """``vllm.LLM`` in this process; create with ``await VLLMEngine.start(config)``."""

    _live: VLLMEngine | None = None  # the started engine not yet shut down, if any

    def __init__(self, llm: Any, config: VLLMConfig, lane: Lane, owns_lane: bool) -> None:
        self._config = config
        self._lane, self._owns_lane = lane, owns_lane
        super().__init__()
        self._batcher = Batcher(llm, lane)
        self._dead: str | None = None  # why the engine cannot be used any more
        self._stopping = False
        self._adapters = AdapterVersions(config.max_loras)
        self._asleep: list[str] = []  # what vLLM's sleep released: "weights", "kv_cache"
        self._transferring = False  # a trainer's weight transfer started, not finished

    @property
    def _llm(self) -> Any:
        """The ``vllm.LLM``; None once shut down."""
        return self._batcher.llm

    @property
    def interrupts(self) -> bool:
        return self._config.interrupt

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
            warm = await engine._batcher.run(Requests([[0]], Sampling(max_tokens=1), 0))
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
        return await self.generate_stream(prompts, sampling, seed, None)

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int,
        sink: TokenSink | None,
    ) -> list[Generation]:  # fmt: skip
        """:meth:`generate`, each step's new tokens to ``sink`` as vLLM files them (a
        request it declines is aborted; corun/contract/engine.py's streaming rules)."""
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
                # Draining, no weight update runs while a generation is admitted; an
                # adapter update changes the version only for generations admitted
                # after it. Each token carries its own version (vllm_batching.py).
                rows = [list(p) for p in prompts]
                requests = Requests(rows, sampling, seed, adapter_request(adapter), self._version,
                                    sink=sink)  # fmt: skip
                batch = await self._batcher.run(requests)
            self._raise_problem(batch, "generating")
        return batch.generations()

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
                scoring = Requests(rows, SCORING, 0, adapter_request(adapter), scoring=True)
                batch = await self._batcher.run(scoring)
            self._raise_problem(batch, "scoring")
        return [prompt_scores(out, len(c)) for out, c in zip(batch.outputs, completions,
                                                              strict=True)]  # fmt: skip

    async def distributions(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Tensor]:
        raise ScoringRefused("vLLM returns top-k log-probs only, not whole rows")

    def _raise_problem(self, batch: Requests, doing: str) -> None:
        if isinstance(batch.problem, Failed):
            raise self._die(f"vLLM failed while {doing}: {batch.problem.message}")
        if isinstance(batch.problem, Rejected):
            raise EngineError(f"vLLM rejected a prompt: {batch.problem.message}")
        if batch.problem is not None:  # not expected: a cancelled call raises above
            raise EngineError(f"vLLM {doing} {batch.problem.message}")

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

    def _teardown_blocking(self) -> None:
        llm, self._batcher.llm = self._batcher.llm, None
        if llm is not None:
            self._batcher.fail_all(Failed("the engine was shut down"))
            with guest.collections_left_to_exit():  # two full ones, to free memory
                llm.llm_engine.engine_core.shutdown()


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
    if config.interrupt and config.kv_at_switch == "keep":  # no old KV for new requests
        kwargs["enable_prefix_caching"] = False
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
