"""vLLM in process as a rollout engine (corun/engine.py's ``Engine``), and what it shares
with the server engine (vllm_server.py): settings, sampling, admission, error mapping.

Token ids in (``TokensPrompt``), token ids out, each with its behaviour log-prob (the
temperature-scaled distribution before top-p; how vLLM is made to report it is in
vllm_worker.py) and the policy version it was sampled with. Every prompt gets its own
vLLM seed derived from ``(seed, index)``, so a prompt's sample does not depend on what
else is in the batch, and repeated prompts (a GRPO group) draw differently.

Blocking calls run on a :class:`corun.Lane`, the engine's own unless one is passed:
one dedicated thread, not anyio's thread pool, because ``vllm.LLM`` is not thread-safe
and torch keeps an OpenMP thread team per OS thread (corun/compute.py). Generation
drives vLLM's engine step by step and calls :func:`corun.cancel_point` between decode
steps, so cancelling a ``generate`` aborts its requests within one step instead of
waiting for the whole batch.

What in-process vLLM does to its host, and what this module undoes: its CPU worker
replaces ``torch.set_num_threads`` with a no-op for the whole process (restored after
start-up) and seeds Python's, NumPy's and torch's global generators (their states are
restored). It also sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and
``VLLM_CPU_KVCACHE_SPACE`` in ``os.environ``: one in-process engine per process.

Failures: an option vLLM rejects, or a model its CPU attention cannot run (found by a
one-token warm-up at start), is a :class:`corun.ConfigError` naming the setting; a
prompt vLLM rejects is an :class:`EngineError` and the engine stays usable; a failed
weight reload leaves vLLM's model half-loaded, so the engine is marked dead and every
later call raises :class:`EngineError` at once (``health()`` is false).
"""

from __future__ import annotations

import itertools
import os
import random
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
import anyio.to_thread
import msgspec
import torch
from torch import Tensor

from corun import ConfigError, Lane, cancel_point, stable_seed
from corun.engine import EngineError, Finish, Generation, Sampling


class EngineOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer.engine_options]``: settings of both vLLM engines (the "local" engine
    takes none)."""

    # Prompt + completion tokens; vLLM sizes its buffers by it (default: the model's).
    max_model_len: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # VLLM_CPU_KVCACHE_SPACE: the KV cache's memory on CPU, GiB.
    kv_cache_gib: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 256  # sequences batched at once
    seed: int = 0  # vLLM's own seed (every request also carries its own)
    # More vllm.LLM keyword arguments (in process) or api_server flags (server: the key
    # with "-" for "_"), e.g. {enable_prefix_caching = false}; a wrong one is exit 2.
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # Server only: start-up deadline, and the deadline of every HTTP call.
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0


class VLLMConfig(EngineOptions, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An engine's settings and its model: a Hugging Face directory (config.json,
    safetensors, tokenizer)."""

    model: str


def request_seed(seed: int, index: int) -> int:
    return stable_seed("vllm-request", seed, index)


def sampling_fields(sampling: Sampling, seed: int, index: int) -> dict[str, Any]:
    """The fields vLLM's ``SamplingParams`` and its completions API share."""
    greedy = sampling.temperature == 0
    return {
        "max_tokens": sampling.max_tokens,
        # Greedy as top-k 1 at temperature 1, not temperature 0: an all-greedy vLLM batch
        # skips the logits processors and reports raw logits, while top-k 1 draws the
        # argmax and reports the log-prob under the T=1 distribution, which is what the
        # trainers recompute for greedy decoding (trainers/lm/model.py).
        "temperature": 1.0 if greedy else sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 1 if greedy else -1,
        "seed": request_seed(seed, index),
        "stop_token_ids": list(sampling.stop_ids),
        "ignore_eos": True,  # only stop_ids end a sequence, as corun's Sampling says
        "logprobs": 0,  # the sampled token's log-prob only
    }


def one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:500]


def unsupported_model(message: str, model: str) -> ConfigError | None:
    """The ConfigError for vLLM's CPU attention refusing the model's head size."""
    found = re.search(r"Unsupported CPU attention configuration: head_dim=(\d+)", message)
    if found is None:
        return None
    return ConfigError(
        f"{model}/config.json: head_dim {found[1]} is not supported by vLLM's CPU "
        "attention (head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"
    )


def rejected_options(exc: Exception, where: str) -> ConfigError:
    """One line naming the option vLLM rejected (an unknown keyword or a bad value)."""
    errors = getattr(exc, "errors", None)  # pydantic's ValidationError
    if callable(errors):
        first = errors()[0]
        place = ".".join(str(part) for part in first.get("loc", ())) or type(exc).__name__
        return ConfigError(f"{where}: {place}: {one_line(Exception(first.get('msg', exc)))}")
    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
    if unknown:
        return ConfigError(f"{where}: options.{unknown[1]} is not a vLLM engine option")
    return ConfigError(f"{where}: {one_line(exc)}")


class Admission:
    """Which generations may run: ``pause`` starts no new ones and waits for the running
    ones; ``resume`` lets waiting ones start. A weight update pauses around its reload,
    so every generation runs on one version (no partial rollouts: ``interrupts`` false)."""

    def __init__(self) -> None:
        self._running = 0
        self._pauses = 0  # pause() calls not yet resumed (user pauses and updates nest)
        # Created by a waiter, dropped once set: no event outlives its waiters, so an
        # engine can serve one event loop after another (asyncio, then trio).
        self._changed: anyio.Event | None = None

    async def _wait(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @asynccontextmanager
    async def generation(self) -> AsyncIterator[None]:
        while self._pauses:
            await self._wait()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._notify()

    async def pause(self) -> None:
        self._pauses += 1
        try:
            while self._running:
                await self._wait()
        except BaseException:  # cancelled while draining: this pause never happened
            self.resume()
            raise

    def resume(self) -> None:
        if self._pauses:
            self._pauses -= 1
            self._notify()


class VLLMEngine:
    """``vllm.LLM`` in this process; create with ``await VLLMEngine.start(config)``."""

    def __init__(self, llm: Any, config: VLLMConfig, lane: Lane, owns_lane: bool) -> None:
        self._llm = llm
        self._config = config
        self._lane, self._owns_lane = lane, owns_lane
        self._version = 0
        self._dead: str | None = None  # why the engine cannot be used any more
        self._admission = Admission()
        self._ids = itertools.count()

    @classmethod
    async def start(cls, config: VLLMConfig, lane: Lane | None = None) -> VLLMEngine:
        """Build the engine on ``lane`` (default: its own) and warm it up (one token)."""
        own = lane is None
        lane = lane or Lane("vllm")
        try:
            llm = await lane.run(_build, config)
            engine = cls(llm, config, lane, own)
            try:
                await lane.run(engine._generate_blocking, [[0]], Sampling(max_tokens=1), 0)
            except _Problem as failed:
                await engine.shutdown()
                raise unsupported_model(failed.message, config.model) or EngineError(
                    f"vLLM warm-up failed: {failed.message}"
                ) from None
        except BaseException:
            if own:
                lane.close()
            raise
        return engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def interrupts(self) -> bool:
        return False

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        self._check()
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

    async def pause(self) -> None:
        await self._admission.pause()

    async def resume(self) -> None:
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
        from trainers.hf.vllm_worker import reload_state

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
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings are about itself
    from vllm import LLM

    from trainers.hf.vllm_worker import BehaviourLogprobs

    set_num_threads = torch.set_num_threads
    states = (random.getstate(), torch.get_rng_state(), _numpy_state())
    kwargs: dict[str, Any] = {
        "model": config.model, "dtype": "float32", "enforce_eager": True,
        "max_num_seqs": config.max_num_seqs,
        "seed": config.seed, "distributed_executor_backend": "uni",
        "logprobs_mode": "processed_logits", "logits_processors": [BehaviourLogprobs],
        "generation_config": "vllm", "disable_log_stats": True,
    }  # fmt: skip
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    clash = sorted(kwargs.keys() & config.options.keys())
    if clash:
        raise ConfigError(f"vLLM options: {', '.join(clash)} are set by corun (see VLLMConfig)")
    try:
        return LLM(**kwargs, **config.options)
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise rejected_options(exc, f"vLLM engine for {config.model}") from None
    finally:
        torch.set_num_threads = set_num_threads  # type: ignore[assignment]
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        _numpy_state(states[2])


def _numpy_state(state: Any = None) -> Any:
    import numpy

    if state is not None:
        numpy.random.set_state(state)
    return numpy.random.get_state()


def _teardown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
