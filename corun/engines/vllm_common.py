"""What the two vLLM engines share (vllm_engine.py in process, vllm_server.py a server
child) besides their settings (options.py): the vLLM settings corun derives from them
(precision, graph mode, LoRA), the sampling fields and top log-probs, admission around
weight updates, the adapter versions an engine keeps loaded, and the mapping of vLLM's
failures to one-line errors that name the setting to blame."""

from __future__ import annotations

import itertools
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from corun.base.errors import ConfigError
from corun.base.rng import stable_seed
from corun.contract.engine import Adapter, Sampling
from corun.engines.lora import write_adapter
from corun.engines.options import (
    OPTIONS,
    WHERE,
    VLLMConfig,
    eager,
    memory_share,
    on_gpu,
    resolved_dtype,
)

# vLLM's max_lora_rank takes these (vllm.config.lora.MaxLoRARanks, vLLM 0.32).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_settings(config: VLLMConfig) -> dict[str, Any]:
    """vLLM's settings corun derives from ``config`` (``vllm.LLM`` keywords; the server
    passes them as flags): precision, graph mode, and LoRA when adapters are in use —
    ``max_loras`` adapters in a batch, one more in the worker's cache, so loading the
    newest never evicts one that a running generation uses."""
    settings: dict[str, Any] = {"dtype": resolved_dtype(config), "enforce_eager": eager(config)}
    if on_gpu():  # vLLM's CPU build takes neither (its KV cache: kv_cache_gib)
        settings["gpu_memory_utilization"] = memory_share(config)
        if config.colocate:
            settings["enable_sleep_mode"] = True
    else:
        # A prompt prefilled in chunks makes vLLM rewind its seeded generator after the
        # partial step, which a CPU generator cannot ("CPU Generator does not use
        # offset"): every request is seeded, so on CPU a prompt is prefilled whole (more
        # prompts than a step's token budget wait for the next step).
        settings["enable_chunked_prefill"] = False
    if config.lora_rank is not None:
        rank = next((r for r in LORA_RANKS if r >= config.lora_rank), None)
        if rank is None:
            raise ConfigError(
                f"`$.{WHERE}.lora_rank` = {config.lora_rank} (the [trainer.lora] rank): vLLM "
                f"takes LoRA ranks up to {LORA_RANKS[-1]}"
            )
        settings |= {
            "enable_lora": True, "max_lora_rank": rank, "max_loras": config.max_loras,
            "max_cpu_loras": config.max_loras + 1,
        }  # fmt: skip
    return settings


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
        "top_k": 1 if greedy else sampling.top_k or -1,
        "seed": request_seed(seed, index),
        "stop_token_ids": list(sampling.stop_ids),
        "ignore_eos": True,  # only stop_ids end a sequence, as corun's Sampling says
        "logprobs": sampling.top_logprobs,  # 0: the sampled token's log-prob only
        **({"top_p": 1.0, "top_k": -1} if nucleus_args(sampling) else {}),
    }


# Top log-probs (vllm_worker.py explains): a request that asks for them and truncates
# is truncated by corun's logits processor, which lowers the tokens outside its
# nucleus by OFFSET instead of vLLM's -inf, so that their log-probs can be read back.
NUCLEUS = "corun_nucleus"  # the SamplingParams.extra_args key: the request's top-p
OFFSET = 256.0  # exp(-256) is 0 in float32: a lowered token is never drawn


def nucleus_args(sampling: Sampling) -> dict[str, float] | None:
    """The ``extra_args`` (server: ``vllm_xargs``) of a request, if it needs any."""
    greedy = sampling.temperature == 0
    if not sampling.top_logprobs or not (greedy or sampling.top_p < 1):
        return None
    return {NUCLEUS: 0.0 if greedy else sampling.top_p}


def top_entries(
    entries: Iterable[tuple[int, float]], sampling: Sampling
) -> list[tuple[int, float]]:
    """The best ``top_logprobs`` of a step's (token, log-prob) pairs vLLM returned (its
    top k and the sampled token), best first; with corun's nucleus, the lowered ones
    raised back by OFFSET (a kept token is never below -OFFSET/2: its probability is
    no float32 zero, unless top_p is within float precision of 1)."""
    best = sorted(entries, key=lambda entry: entry[1], reverse=True)[: sampling.top_logprobs]
    if nucleus_args(sampling) is None:
        return best
    return [(token, lp + OFFSET if lp < -OFFSET / 2 else lp) for token, lp in best]


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


def rejected_options(exc: Exception, where: str, options: Mapping[str, Any]) -> ConfigError:
    """One line naming the option vLLM rejected (an unknown keyword or a bad value):
    by its config path when it is one of ``options``."""
    errors = getattr(exc, "errors", None)  # pydantic's ValidationError
    if callable(errors):
        first = errors()[0]
        place = ".".join(str(part) for part in first.get("loc", ())) or type(exc).__name__
        message = one_line(Exception(first.get("msg", exc)))
        if place in options:
            return ConfigError(f"`{OPTIONS}.{place}`: {message} (the {where})")
        return ConfigError(f"{where}: {place}: {message}")
    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
    if unknown:
        return ConfigError(f"`{OPTIONS}.{unknown[1]}`: not an option of the {where}")
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


# ---- the server's log


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# An error line of the server's log: vLLM's ERROR records, or an exception's last line
# ("ValueError: ..."); not a warning that merely contains the word "error".
ERROR_LINE = re.compile(r"\bERROR\b|^\w*(Error|Exception)\b")


def last_error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return one_line(Exception((errors or lines or ["(empty log)"])[-1]))[:300]


def start_error(log: str, config: VLLMConfig) -> ConfigError | None:
    """A ConfigError for a server that refused its flags or the model, naming the
    option's config path when one of ``options`` is to blame."""
    unknown = re.search(r"error: (unrecognized arguments: .*|argument .*)", log)
    if unknown:
        message = one_line(Exception(unknown[1]))
        for key in config.options:
            flag = key.replace("_", "-")
            if re.search(rf"(?<![\w-])--(no-)?{re.escape(flag)}(?![\w-])", message):
                return ConfigError(f"`{OPTIONS}.{key}`: the vLLM server says {message}")
        return ConfigError(f"vLLM server options: {message}")
    invalid = re.search(r"validation errors? for (\w+)\s*\n\s*(.*)\n\s*(.*)", log)
    if invalid:
        detail = f"{invalid[2].strip()}: {invalid[3].strip()}"
        return ConfigError(f"vLLM server {invalid[1]}: {detail}"[:400])
    return unsupported_model(log, config.model)


class DrainingEngine:
    """What both vLLM engines share: a version, and the admission every generation
    and update goes through (an update drains running generations: no partial
    rollouts, so ``interrupts`` is false)."""

    def __init__(self) -> None:
        self._version = 0
        self._admission = Admission()

    @property
    def version(self) -> int:
        return self._version

    @property
    def interrupts(self) -> bool:
        return False

    async def pause(self) -> None:
        await self._admission.pause()

    async def resume(self) -> None:
        self._admission.resume()


# ---- adapter versions


@dataclass(eq=False)
class LoadedAdapter:
    """An adapter version written for vLLM (peft's layout, in ``path``) under vLLM's
    name and int id, and how many running generations use it."""

    version: int
    name: str
    ident: int
    path: Path
    users: int = 0


class AdapterVersions:
    """The adapter versions an engine has loaded into vLLM, oldest first: every new
    generation uses the newest, a running one keeps the one it started with; at least
    ``keep`` stay loaded, and an older one is evicted only once no generation uses it.
    Their files live in a directory of the engine's own, removed by :meth:`close`."""

    def __init__(self, keep: int, root: Path | None = None) -> None:
        self.keep = keep
        self.loaded: list[LoadedAdapter] = []
        self._ids = itertools.count(1)  # vLLM's lora_int_id: unique, positive
        self._root = root  # default: a temporary directory, made at the first write

    @property
    def newest(self) -> LoadedAdapter | None:
        return self.loaded[-1] if self.loaded else None

    def write(self, adapter: Adapter, version: int) -> LoadedAdapter:
        """Blocking: ``adapter``'s files, under a new name and id (not yet loaded)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="corun-lora-"))
        ident = next(self._ids)
        entry = LoadedAdapter(version, f"corun-v{version}-{ident}", ident, self._root / str(ident))
        write_adapter(adapter, entry.path)
        return entry

    @contextmanager
    def using(self) -> Iterator[LoadedAdapter | None]:
        """The newest adapter, held for one generation (None: none loaded)."""
        entry = self.newest
        if entry is not None:
            entry.users += 1
        try:
            yield entry
        finally:
            if entry is not None:
                entry.users -= 1

    def evictable(self) -> list[LoadedAdapter]:
        """Takes out of :attr:`loaded` (and returns) the versions older than the newest
        ``keep`` that no generation uses: the engine unloads them, then :meth:`drop`."""
        old = [entry for entry in self.loaded[: -self.keep] if entry.users == 0]
        self.loaded = [entry for entry in self.loaded if entry not in old]
        return old

    @staticmethod
    def drop(entry: LoadedAdapter) -> None:
        shutil.rmtree(entry.path, ignore_errors=True)

    def close(self) -> None:
        self.loaded.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
