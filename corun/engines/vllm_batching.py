"""Continuous batching for the in-process vLLM engine (vllm_engine.py): every call's
requests share the running ``vllm.LLM``, stepped by corun on the engine's lane.

Concurrent calls (an endpoint sends many) each hand their requests over (a list under
a lock) and repeat one lane call, :meth:`Batcher.drive`, until they are done. The lane
runs one call at a time, so one of them drives vLLM at any moment: between two decode
steps it adds every request handed over since (they join the running batch), steps,
and files each step's new tokens with their call. A drive returns when its own call's
requests are done, when another call's are (that call's lane call, queued behind it,
then returns them at once), when a weight update waits for the lane (it then runs
between two decode steps), or after a 50 ms slice (so the lane's other calls and
cancelled callers are not kept waiting); its caller then queues it again. A call never
waits for another's requests to finish. Cancelling a call aborts its requests within
one step (its own drive stops at the next step; a drive queued behind another's is
skipped and its requests aborted by a short lane call); the others go on.

Every token is stamped, as it is filed, with the version of the weights that produced
it: vLLM reports each step's new tokens (``RequestOutputKind.DELTA``), and
:attr:`Batcher.weights_version` is set on the lane by the reload that loads them. A
generation that spans an in-flight update (``inflight_at_sync = "interrupt"``) thus
carries both versions, each token with its behaviour log-prob under its own weights;
one on a LoRA adapter keeps the adapter's version throughout (the base never changes).

A call with a sink (``Requests.sink``: corun/contract/engine.py's streaming rules) also
hands each request's new tokens to it as they are filed, on the lane; a request the
sink declines is aborted in vLLM there and then (its call's other requests go on), its
tokens so far its generation.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from corun.contract.engine import Delta, Finish, Generation, Sampling, TokenSink
from corun.engines.vllm_common import nucleus_args, one_line, sampling_fields, top_entries
from corun.execution.compute import Lane, cancel_point, stop_requested

SLICE_S = 0.05  # the longest a drive steps before its caller queues it again
DISCARD_S = 10.0  # the longest a cancelled call waits for its requests to be aborted


class Batcher:
    """The requests of every running call of one ``vllm.LLM`` (``llm``; None once it is
    shut down), stepped on ``lane``."""

    def __init__(self, llm: Any, lane: Lane) -> None:
        self.llm = llm
        self.lane = lane
        self.weights_version = 0  # of the weights vLLM holds (set on the lane)
        self.update_waiting = False  # a weight update is queued: drives return at once
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _inbox, _unclaimed, each Requests's flags
        self._inbox: list[Requests] = []  # handed over, not yet added to vLLM
        self._unclaimed: set[Requests] = set()  # settled, its caller not yet told
        self._requests: dict[str, tuple[Requests, int]] = {}  # in vLLM (the lane's alone)

    async def run(self, batch: Requests) -> Requests:
        """Hand ``batch`` over and drive vLLM until it is settled; a cancelled call's
        requests are aborted before it returns."""
        with self._lock:
            self._inbox.append(batch)
        try:
            while not self._claim(batch):
                await self.lane.run(self.drive, batch)
        finally:
            if not self._claim(batch):  # cancelled while its drive was queued
                with anyio.move_on_after(DISCARD_S, shield=True):
                    await self.lane.run(self.discard, batch)
                self._claim(batch, leaving=True)  # no drive waits for it from now on
        return batch

    def _claim(self, batch: Requests, *, leaving: bool = False) -> bool:
        """Whether ``batch`` is settled; if so (or its caller is leaving), no drive
        returns early for its caller any more."""
        with self._lock:
            if batch.settled or leaving:
                batch.claimed = True
                self._unclaimed.discard(batch)
            return batch.settled

    def _settle(self, batch: Requests, problem: Problem | None = None) -> None:
        with self._lock:
            if not batch.settled:
                batch.settled, batch.problem = True, problem
                if not batch.claimed:
                    self._unclaimed.add(batch)

    # -- on the lane -----------------------------------------------------------------

    def drive(self, batch: Requests) -> None:
        """Step vLLM for every call until ``batch`` is settled, another call's is (its
        caller's lane call is queued behind this one), a weight update waits, the slice
        is over, or this call's caller is cancelled: then its requests are aborted, and
        only its."""
        llm = self.llm
        if llm is None:
            self.fail_all(Failed("the engine was shut down"))
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
                self._abort(engine, batch, Cancelled("was cancelled"))
                cancel_point()  # raises: the caller's cancellation goes on
            if time.monotonic() > until or self.update_waiting:
                return
            if not engine.has_unfinished_requests():  # not expected: fail, never spin
                self.fail_all(Failed("vLLM lost the requests of running generations"))
                return
            try:
                outputs = engine.step()
            except Exception as exc:  # vLLM's state is unknown: every call fails
                self.fail_all(Failed(one_line(exc)))
                return
            self._file(engine, outputs)

    def _add(self, engine: Any, batch: Requests) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling, extra = batch.sampling, nucleus_args(batch.sampling)
        batch.outputs = [None if batch.scoring else Tokens() for _ in batch.prompts]
        batch.left = len(batch.prompts)
        # A generation's tokens step by step (each stamped with its weights' version); a
        # score's prompt log-probs once.
        kind = RequestOutputKind.FINAL_ONLY if batch.scoring else RequestOutputKind.DELTA
        try:
            for i, prompt in enumerate(batch.prompts):
                # Scoring: the prompt's own log-probs (0 extra: the token's only), raw.
                fields = ({"max_tokens": 1, "prompt_logprobs": 0} if batch.scoring
                          else sampling_fields(sampling, batch.seed, i))  # fmt: skip
                params = SamplingParams(**fields, extra_args=extra, detokenize=False,
                                        output_kind=kind)  # fmt: skip
                name = f"corun-{next(self._ids)}"
                tokens = TokensPrompt(prompt_token_ids=prompt)
                internal = engine.add_request(name, tokens, params, lora_request=batch.adapter)
                batch.internal.append(internal)
                batch.names.append(name)
                self._requests[name] = (batch, i)
        except Exception as exc:  # vLLM's input checks: the call's requests never ran
            self._abort(engine, batch, Rejected(one_line(exc)))
        if not batch.prompts:
            self._settle(batch)

    def _file(self, engine: Any, outputs: list[Any]) -> None:
        """Each step's new tokens to their call, stamped with the version of the weights
        that produced them (and to its sink, which may decline the request: it is
        aborted); a call whose requests have all finished is settled."""
        for output in outputs:
            owner = self._requests.get(output.request_id)
            if owner is None:
                continue
            batch, index = owner
            finished = output.finished
            if batch.scoring:
                batch.outputs[index] = output
            else:
                version = self.weights_version if batch.adapter is None else batch.version
                tokens = batch.outputs[index]
                delta = tokens.extend(output.outputs[0], version, batch.sampling)
                if batch.sink is not None and delta.ids and not batch.sink(index, delta):
                    if not finished:  # declined: out of vLLM now, the others go on
                        _abort(engine, [batch.internal[index]])
                    finished = True
            if finished:
                del self._requests[output.request_id]
                batch.left -= 1
                if batch.left == 0:
                    self._settle(batch)

    def _abort(self, engine: Any, batch: Requests, problem: Problem) -> None:
        for name in batch.names:
            self._requests.pop(name, None)
        _abort(engine, batch.internal)
        self._settle(batch, problem)

    def discard(self, batch: Requests) -> None:
        """A cancelled call's requests, wherever they are: out of the inbox, or aborted."""
        with self._lock:
            if batch in self._inbox:
                self._inbox.remove(batch)
        if self.llm is None:
            self._settle(batch, Cancelled("was cancelled"))
        elif not batch.settled:
            self._abort(self.llm.llm_engine, batch, Cancelled("was cancelled"))

    def fail_all(self, problem: Problem) -> None:
        """Every running and handed-over call settled with ``problem``."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        owners = {batch for batch, _ in self._requests.values()} | set(inbox)
        self._requests.clear()
        for batch in owners:
            self._settle(batch, problem)


@dataclass
class Tokens:
    """One generation's tokens so far, each with its behaviour log-prob and the version
    of the weights that sampled it."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: Finish = "length"

    def extend(self, delta: Any, version: int, sampling: Sampling) -> Delta:
        """vLLM's CompletionOutput of one step (its new tokens alone), added; returned as
        a :class:`Delta`."""
        start = len(self.ids)
        ids, steps = list(delta.token_ids), list(delta.logprobs or ())
        self.ids += ids
        self.logprobs += [float(step[t].logprob) for step, t in zip(steps, ids, strict=True)]
        self.versions += [version] * len(ids)
        if sampling.top_logprobs:
            self.top += [top_entries(((t, float(lp.logprob)) for t, lp in step.items()),
                                     sampling) for step in steps]  # fmt: skip
        if delta.finish_reason is not None:
            self.finish = "stop" if delta.finish_reason == "stop" else "length"
        top = self.top[start:] if sampling.top_logprobs else None
        return Delta(ids, self.logprobs[start:], self.versions[start:], top)

    def generation(self, sampling: Sampling) -> Generation:
        top = self.top if sampling.top_logprobs else None
        return Generation(self.ids, self.logprobs, self.versions, self.finish, top)


@dataclass(eq=False)  # hashed by identity: the batcher keeps sets of them
class Requests:
    """One call's requests (a ``generate`` or ``score``): handed to the lane by its
    caller, settled on the lane (tokens filed, or a problem), read by the caller once
    settled."""

    prompts: list[list[int]]
    sampling: Sampling
    seed: int
    adapter: Any = None  # the vLLM LoRARequest its requests run with, if any
    version: int = 0  # the policy version when it was admitted (an adapter's, throughout)
    names: list[str] = field(default_factory=list)  # vLLM's request ids
    internal: list[str] = field(default_factory=list)  # the same, as vLLM aborts them
    # Per prompt: a generation's Tokens, or a score's vLLM RequestOutput.
    outputs: list[Any] = field(default_factory=list)
    left: int = 0  # requests not yet finished
    settled: bool = False  # nothing of it is left in vLLM (under the batcher's lock)
    claimed: bool = False  # its caller has it, or left (under the batcher's lock)
    problem: Problem | None = None
    scoring: bool = False  # a score call's: outputs are vLLM's RequestOutputs
    sink: TokenSink | None = None  # a streamed generation's: each request's new tokens

    def generations(self) -> list[Generation]:
        return [tokens.generation(self.sampling) for tokens in self.outputs]


class Problem(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Rejected(Problem):
    """vLLM refused a request before running anything: the engine is still usable."""


class Failed(Problem):
    """vLLM failed while stepping: its state is unknown."""


class Cancelled(Problem):
    """The call's caller was cancelled; its requests were aborted."""


SCORING = Sampling(max_tokens=1)  # a score call's (its requests' fields are their own)


def prompt_scores(out: Any, count: int) -> list[float]:
    """The log-probs vLLM reports for the last ``count`` tokens of a scored prompt."""
    ids, steps = list(out.prompt_token_ids), list(out.prompt_logprobs)
    first = len(ids) - count
    return [float(steps[i][ids[i]].logprob) for i in range(first, len(ids))]


def _abort(engine: Any, internal_ids: list[str]) -> None:
    try:
        engine.abort_request(internal_ids, internal=True)
    except Exception:  # a dead engine has nothing left to abort
        pass
