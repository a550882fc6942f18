"""The Tinker API's state and what each request does to it: sessions, the models clients
create (a trainer's :class:`~corun.contract.training_api.TrainingModel` each, with its
:class:`~corun.serve.tinker.futures.Turns`), sampling sessions, and saved states.

Saved states are corun checkpoints under the run directory, named as the API names
them: ``tinker://<model_id>/weights/<name>`` (adapters and optimizer state: ``save_state``)
is ``<run dir>/tinker/<model_id>/weights/<name>/``, and ``sampler_weights/<name>`` holds
adapters alone (``save_weights_for_sampler``); beside each, ``tinker.json`` records the
base model and LoRA shape a new model needs to load it. A sampler save without a name
(``save_weights_and_get_sampling_client``) is a ``snapshot-<seq_id>``; the newest
:data:`SNAPSHOTS` of a model are kept.

Model compute runs on the server's compute lane, one request at a time per model, in
the client's order; sampling runs concurrently on the trainer's engines.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
import shutil
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import msgspec

from corun.base.config import ServeConfig
from corun.contract.engine import Sampling
from corun.contract.training_api import (
    AdamStep,
    LoraShape,
    ModelInfo,
    RequestError,
    TrainingBackend,
    TrainingModel,
)
from corun.execution.compute import Lane
from corun.serve.tinker import wire
from corun.serve.tinker.futures import Future, Futures, Reply, Turns, answer

T = TypeVar("T")
SCHEME = "tinker://"
KINDS = {"weights": "training", "sampler_weights": "sampler"}
SAVE_TYPES = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler"}
RECORD = "tinker.json"
SNAPSHOTS = 4
EVICTED = "evicted"  # <root>/<model_id>/evicted/: an evicted model's adapters and optimizer
MAX_TOPK = 64  # top-k prompt log-probs a request may ask for, per position
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]*$")


class Busy(Exception):
    """Too many requests waiting: answered 429 (the SDK retries)."""


@dataclass
class Model:
    model_id: str
    session_id: str
    base_model: str
    shape: LoraShape
    seed: int
    info: ModelInfo
    model: TrainingModel | None  # None: evicted (saved under EVICTED), reloaded on use
    turns: Turns
    snapshots: deque[Path] = field(default_factory=deque)


@dataclass(frozen=True)
class SamplerRef:
    base_model: str
    weights: Path | None  # None: the base model
    model_path: str | None


class TinkerService:
    """Everything the routes act on; :meth:`run` hosts its tasks."""

    def __init__(
        self, backend: TrainingBackend, config: ServeConfig, lane: Lane, root: Path
    ) -> None:  # fmt: skip
        self.backend = backend
        self.config = config
        self.lane = lane
        self.root = root
        self.futures = Futures(config.tinker_results)
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplerRef] = {}
        self.sessions: set[str] = set()
        self._creating: dict[str, Future] = {}
        self._recent: dict[str, None] = {}  # model ids, least recently used first
        self._sampling = 0
        self._tasks: anyio.abc.TaskGroup | None = None
        self._closed = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Host the model workers and sampling tasks until :meth:`close`, then wait for
        the requests running."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            await self._closed.wait()
        self._tasks = None

    def close(self) -> None:
        """Take no more work and drop the models' queued requests."""
        for model in self.models.values():
            model.turns.abandon()
        self._closed.set()

    def _spawn(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if self._tasks is None or self._closed.is_set():
            raise RequestError("the server is stopping")
        self._tasks.start_soon(fn)

    # ------------------------------------------------------------------ sessions

    def create_session(self) -> str:
        session_id = f"s{secrets.token_hex(4)}"
        self.sessions.add(session_id)
        return session_id

    def finish_session(self, session_id: str) -> None:
        """The session's models run what they hold, then are released."""
        self.sessions.discard(session_id)
        for model in [m for m in self.models.values() if m.session_id == session_id]:
            model.turns.close()

    # ------------------------------------------------------------------ models

    def create_model(self, request: wire.CreateModel) -> Future:
        lora = request.lora_config or wire.LoraConfig()
        shape = LoraShape(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
        seed = lora.seed if lora.seed is not None else request.model_seq_id

        async def build() -> Reply:
            model = await self._new_model(request.session_id, request.model_seq_id,
                                          request.base_model, shape, seed)  # fmt: skip
            return Reply.json({"model_id": model.model_id, "type": "create_model"})

        return self._creating_model(request.session_id, request.model_seq_id, build)

    def create_from_state(self, request: wire.LoadWeights) -> Future:
        """A new model loaded from a saved state (``create_training_client_from_state``)."""
        assert request.session_id is not None and request.model_seq_id is not None
        session_id, seq = request.session_id, request.model_seq_id

        async def build() -> Reply:
            directory, _ = self.resolve(request.path, "weights")
            base_model, shape = read_record(directory)
            model = await self._new_model(session_id, seq, base_model, shape, seq)
            await self.on_model(model, lambda m: m.load(directory, optimizer=request.optimizer))
            return Reply.json({"path": request.path, "model_id": model.model_id,
                               "type": "load_weights"})  # fmt: skip

        return self._creating_model(session_id, seq, build)

    def _creating_model(
        self, session_id: str, seq: int, build: Callable[[], Awaitable[Reply]]
    ) -> Future:
        model_id = model_name(session_id, seq)
        if model_id in self._creating:  # a retried request
            return self._creating[model_id]
        future = self._creating[model_id] = self.futures.create()

        async def create() -> None:
            future.set(await answer(build))

        self._spawn(create)
        return future

    async def _new_model(
        self, session_id: str, seq: int, base_model: str, shape: LoraShape, seed: int
    ) -> Model:
        if session_id not in self.sessions:
            raise RequestError(f"session_id {session_id!r}: no such session here")
        model = await self.lane.run(self.backend.create_model, base_model, shape, seed)
        model_id = model_name(session_id, seq)
        entry = Model(model_id, session_id, base_model, shape, seed, model.info, model,
                      Turns(self.config.tinker_queue))  # fmt: skip
        self._recent[model_id] = None
        await self.lane.run(self._evict_past_limit, entry)

        async def serve() -> None:
            await entry.turns.run()
            if session_id not in self.sessions:  # it finished: release the model
                self.models.pop(model_id, None)
                self._recent.pop(model_id, None)

        self._spawn(serve)
        self.models[model_id] = entry
        return entry

    async def on_model(self, model: Model, fn: Callable[[TrainingModel], T]) -> T:
        """``fn`` of ``model``'s trainer, on the lane: reloaded first if it was evicted,
        and the others past ``serve.tinker_max_models`` evicted, all in one lane call
        (no other model's work runs in between)."""
        return await self.lane.run(self._held_call, model, fn)

    def _held_call(self, model: Model, fn: Callable[[TrainingModel], T]) -> T:
        self._recent.pop(model.model_id, None)
        self._recent[model.model_id] = None  # the most recently used
        if model.model is None:
            saved = self.root / model.model_id / EVICTED
            reloaded = self.backend.create_model(model.base_model, model.shape, model.seed)
            reloaded.load(saved, optimizer=True)
            model.model = reloaded
            shutil.rmtree(saved, ignore_errors=True)
        self._evict_past_limit(model)
        return fn(model.model)

    def _evict_past_limit(self, keep: Model) -> None:
        """Save and drop the least recently used models past the bound (blocking; on the
        lane). A model with gradients not yet applied stays: they are not saved."""
        limit = self.config.tinker_max_models
        if not limit:
            return
        order = [keep if i == keep.model_id else self.models.get(i) for i in self._recent]
        held = [m for m in order if m is not None and m.model is not None]
        excess = len(held) - limit
        for victim in held:
            if excess <= 0:
                return
            if victim is keep or victim.model is None or victim.model.holds_gradients:
                continue
            victim.model.save(self.root / victim.model_id / EVICTED, optimizer=True)
            victim.model = None
            excess -= 1

    def model(self, model_id: str) -> Model:
        found = self.models.get(model_id)
        if found is None:
            raise RequestError(f"model_id {model_id!r}: no such model here")
        return found

    def in_turn(
        self, model_id: str, seq_id: int | None, kind: str,
        job: Callable[[Model], Awaitable[Reply]],
    ) -> Future:  # fmt: skip
        """Run ``job`` (a ``kind`` of request) on the model in its turn; an unknown model,
        or a request out of order, answered as the client's error."""
        try:
            model = self.model(model_id)
            return model.turns.submit(seq_id, self.futures, lambda: job(model), kind)
        except RequestError as exc:
            future = self.futures.create()
            future.set(Reply.error(str(exc), "user"))
            return future

    # ------------------------------------------------------------------ training

    async def forward_backward(
        self, model: Model, loss: Any, config: dict[str, float], forward_only: bool,
        data: list[Any],
    ) -> Reply:  # fmt: skip
        result = await self.on_model(
            model, lambda m: m.forward_backward(data, loss, config, not forward_only)
        )
        return Reply(wire.forward_backward_output(result), wire.PROTOBUF)

    async def optim_step(self, model: Model, request: wire.OptimStep) -> Reply:
        if request.adam_params is None:
            kind = (request.optimizer_params or {}).get("type", "?")
            raise RequestError(f"optimizer {kind!r}: corun serves AdamW (adam_params) only")
        step = AdamStep(**_fields(request.adam_params))
        metrics = await self.on_model(model, lambda m: m.optim_step(step))
        return Reply.json({"metrics": {f"{key}:mean": value for key, value in metrics.items()},
                           "type": "optim_step"})  # fmt: skip

    async def save(self, model: Model, request: wire.SaveWeights, kind: str) -> Reply:
        snapshot = request.path is None
        name = f"snapshot-{request.seq_id:06d}" if snapshot else str(request.path)
        directory = self.directory(model.model_id, kind, name)
        if directory.exists() and not (request.overwrite or snapshot):
            raise RequestError(f"{tinker_path(model.model_id, kind, name)} exists (overwrite: true "
                               "to replace it)")  # fmt: skip
        optimizer = kind == "weights"
        await self.on_model(model, lambda m: m.save(directory, optimizer=optimizer))
        write_record(directory, model.base_model, model.shape)
        path = tinker_path(model.model_id, kind, name)
        if not snapshot:
            return Reply.json({"path": path, "type": SAVE_TYPES[kind]})
        self._keep_snapshot(model, directory)
        session = f"{model.session_id}:sample:{request.sampling_session_seq_id or 0}"
        self.samplers[session] = SamplerRef(model.base_model, directory, path)
        return Reply.json({"sampling_session_id": session, "type": "save_weights_for_sampler"})

    def _keep_snapshot(self, model: Model, directory: Path) -> None:
        model.snapshots.append(directory)
        while len(model.snapshots) > SNAPSHOTS:
            shutil.rmtree(model.snapshots.popleft(), ignore_errors=True)

    async def load(self, model: Model, request: wire.LoadWeights) -> Reply:
        directory, _ = self.resolve(request.path, "weights")
        await self.on_model(model, lambda m: m.load(directory, optimizer=request.optimizer))
        return Reply.json({"path": request.path, "model_id": model.model_id,
                           "type": "load_weights"})  # fmt: skip

    # ------------------------------------------------------------------ sampling

    def create_sampler(self, request: wire.CreateSamplingSession) -> str:
        ref = self.sampler_ref(request.model_path, request.base_model)
        session = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        self.samplers[session] = ref
        return session

    def sampler_ref(self, model_path: str | None, base_model: str | None) -> SamplerRef:
        if model_path:
            directory, _ = self.resolve(model_path)
            return SamplerRef(read_record(directory)[0], directory, model_path)
        if not base_model:
            raise RequestError("a sampler needs model_path or base_model")
        if base_model not in self.backend.base_models():
            served = ", ".join(self.backend.base_models())
            raise RequestError(f"base_model {base_model!r} is not served here (served: {served})")
        return SamplerRef(base_model, None, None)

    def sample(self, request: wire.Sample) -> Future:
        """Start a sampling request; its checks answered as the client's error."""
        if self._sampling >= self.config.tinker_queue:
            raise Busy(f"{self._sampling} sampling requests are waiting")
        future = self.futures.create()
        try:
            job = self._sampling_job(request)
        except RequestError as exc:
            future.set(Reply.error(str(exc), "user"))
            return future
        self._sampling += 1

        async def run() -> None:
            try:
                future.set(await answer(job))
            finally:
                self._sampling -= 1

        self._spawn(run)
        return future

    def _sampling_job(self, request: wire.Sample) -> Callable[[], Awaitable[Reply]]:
        if request.sampling_session_id is not None:
            ref = self.samplers.get(request.sampling_session_id)
            if ref is None:
                raise RequestError(f"sampling_session_id {request.sampling_session_id!r}: unknown")
        else:
            ref = self.sampler_ref(request.model_path, request.base_model)
        prompt = wire.prompt_tokens(request.prompt)
        sampling, strings, eos = self.sampling(request, len(prompt))
        seed = request.sampling_params.seed
        seed = secrets.randbits(31) if seed is None else seed

        async def job() -> Reply:
            if ref.weights is not None and not ref.weights.is_dir():
                raise RequestError(f"{ref.model_path}: no longer held (snapshots are dropped)")
            generations = await self.backend.sample(
                ref.weights, [prompt] * request.num_samples, sampling, seed,
                stop_strings=strings, stop_at_eos=eos,
            )  # fmt: skip
            scored, top_k = None, request.topk_prompt_logprobs
            if request.prompt_logprobs or top_k:
                scored = await self.lane.run(
                    self.backend.prompt_logprobs, ref.weights, prompt, top_k
                )
            response = wire.sample_response(generations, scored, request.prompt_logprobs, top_k)
            return Reply(response, wire.PROTOBUF)

        return job

    def sampling(self, request: wire.Sample, prompt_len: int) -> tuple[Sampling, list[str], bool]:
        """The engine's sampling settings, stop strings, and whether EOS stops (the API:
        an explicit empty ``stop`` list disables every stop)."""
        params = request.sampling_params
        limit = self.backend.max_length
        unserved = {
            "topk_sample_logprobs": request.topk_sample_logprobs,
            "prompt_alt_tokens_k": request.prompt_alt_tokens_k,
        }  # fmt: skip
        for name, asked in unserved.items():
            if asked:
                raise RequestError(f"{name}: not served by corun yet")
        if not prompt_len or prompt_len >= limit:
            raise RequestError(f"prompt: {prompt_len} tokens; the model takes 1..{limit - 1}")
        if not 1 <= request.num_samples <= 1024:
            raise RequestError(f"num_samples = {request.num_samples}: expected 1..1024")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if not 1 <= max_tokens <= limit - prompt_len:
            raise RequestError(f"sampling_params.max_tokens = {max_tokens}: the prompt's "
                               f"{prompt_len} tokens leave 1..{limit - prompt_len}")  # fmt: skip
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise RequestError("sampling_params: temperature >= 0 and 0 < top_p <= 1")
        if not 0 <= request.topk_prompt_logprobs <= MAX_TOPK:
            raise RequestError(f"topk_prompt_logprobs = {request.topk_prompt_logprobs}: "
                               f"expected 0..{MAX_TOPK}")  # fmt: skip
        if params.top_k < -1:
            raise RequestError(f"sampling_params.top_k = {params.top_k}: expected -1 (off) or more")
        stop = [params.stop] if isinstance(params.stop, str) else params.stop
        ids = tuple(s for s in stop or [] if isinstance(s, int))
        strings = [s for s in stop or [] if isinstance(s, str)]
        sampling = Sampling(max_tokens, params.temperature, params.top_p, stop_ids=ids,
                            top_k=max(params.top_k, 0))  # fmt: skip
        return sampling, strings, stop != []

    # ------------------------------------------------------------------ names on disk

    def directory(self, model_id: str, kind: str, name: str) -> Path:
        if not NAME.match(name) or ".." in name:
            raise RequestError(f"path {name!r}: a name of letters, digits and _ . = - only")
        return self.root / model_id / kind / name

    def resolve(self, path: str, kind: str | None = None) -> tuple[Path, str]:
        """The directory of a ``tinker://`` path this server saved, and its kind."""
        parts = path.removeprefix(SCHEME).split("/") if path.startswith(SCHEME) else []
        if len(parts) != 3 or parts[1] not in KINDS:
            raise RequestError(
                f"path {path!r}: expected tinker://<model_id>/<weights|sampler_weights>/<name>"
            )
        if kind is not None and parts[1] != kind:
            raise RequestError(f"path {path!r}: a {parts[1]} path; this request loads {kind}")
        directory = self.directory(parts[0], parts[1], parts[2])
        if not (directory / RECORD).is_file():
            raise RequestError(f"path {path!r}: no such saved state here")
        return directory, parts[1]

    def checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        """The saved states of ``model_id``, as the REST API lists them."""
        found = []
        for kind, label in KINDS.items():
            for directory in sorted((self.root / model_id / kind).glob("*")):
                if (directory / RECORD).is_file():
                    found.append({
                        "checkpoint_id": f"{kind}/{directory.name}", "checkpoint_type": label,
                        "time": _mtime(directory),
                        "tinker_path": tinker_path(model_id, kind, directory.name),
                    })  # fmt: skip
        return found


def model_name(session_id: str, seq: int) -> str:
    return f"{session_id}:train:{seq}"  # the SDK computes it too: this form, exactly


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{kind}/{name}"


def write_record(directory: Path, base_model: str, shape: LoraShape) -> None:
    record = {"base_model": base_model, "lora_rank": shape.rank, "train_attn": shape.train_attn,
              "train_mlp": shape.train_mlp, "train_unembed": shape.train_unembed}  # fmt: skip
    (directory / RECORD).write_text(json.dumps(record))


def read_record(directory: Path) -> tuple[str, LoraShape]:
    try:
        record = json.loads((directory / RECORD).read_text())
        shape = LoraShape(int(record["lora_rank"]), bool(record["train_attn"]),
                          bool(record["train_mlp"]), bool(record["train_unembed"]))  # fmt: skip
        return str(record["base_model"]), shape
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RequestError(f"{directory / RECORD}: unreadable ({exc})") from None


def _mtime(directory: Path) -> str:
    stamp = directory.stat().st_mtime
    return datetime.datetime.fromtimestamp(stamp, datetime.UTC).isoformat()


def _fields(params: wire.AdamParams) -> dict[str, float]:
    return msgspec.structs.asdict(params)
