"""What runs inside vLLM's process, for both vLLM engines (vllm_engine.py, in process;
vllm_server.py, a server child): the logits processor that makes vLLM report corun's
behaviour log-probs, the weight-reload calls, and the server's launcher
(``python -m corun.engines.vllm_worker <api_server flags>``). Imports vLLM: the engines
import this module only where vLLM runs.

Behaviour log-probs. corun records each sampled token's log-prob under the
temperature-scaled distribution *before* top-p truncation (corun/contract/engine.py). No vLLM
``logprobs_mode`` reports that (measured against transformers, vLLM 0.32):
``raw_logprobs`` ignores the temperature (off by 0.16 at T=0.7), ``processed_logprobs``
renormalises after top-p (off by 0.1 at top-p 0.9), ``processed_logits`` reports
unnormalised logits. :class:`BehaviourLogprobs` closes the gap: vLLM applies
argmax-invariant processors after the temperature and before top-k/top-p, so subtracting
the log-normaliser there turns each row into log_softmax(logits / T), top-p then masks
other tokens to -inf without touching the sampled one, and ``processed_logits`` hands
back exactly the wanted value (max difference 7e-7). The shift changes no draw: softmax,
top-p and Gumbel-max are all shift-invariant.

Top log-probs. vLLM's top-k/top-p set every token they exclude to -inf before
``processed_logits`` is read, so a request's top tokens outside the nucleus (all but
the argmax, for greedy's top-k 1) would read -inf. A request that asks for top
log-probs and truncates is therefore sent untruncated, with corun's own top-p in its
``extra_args`` (vllm_common.nucleus_args; 0 for greedy: the argmax alone), and
:class:`BehaviourLogprobs` truncates it instead: it lowers the excluded tokens by
``vllm_common.OFFSET`` (256) rather than to -inf. They are never drawn (exp(-256) is 0
in float32, and Gumbel noise is far smaller), the sampled token's log-prob is
untouched, and the engine adds the offset back to the top log-probs it reads below
-OFFSET/2 (vllm_common.top_entries; exact to ~2e-5). Requests without top log-probs
are sent and truncated as before.

Weights fingerprint (corun/engines/fingerprint.py). On CPU, vLLM hands every linear
layer's weight to oneDNN, which repacks it into memory of its own, and leaves an empty
parameter behind (measured, vLLM 0.32: the tiny model's parameters then sum to another
value). The sum of such a weight is taken just before it is repacked
(:func:`record_packed_weights`, on every load and reload: the values vLLM's weight
loaders wrote, fused and padded) and kept on its layer; :func:`serving_fingerprint`
adds it to the sum of the parameters still held. Measured on the built-in tiny model:
equal to the fingerprint of the HF state dict after the start and after reloads (the
fused q/k/v and gate/up weights, and the vocabulary padded from 341 to 384 rows with
zeros, sum the same).

Adapters (LoRA). vLLM's worker loads an adapter from its directory into its LoRA
manager, then folds each layer's scaling (alpha / r) into its B matrix and packs the
q/k/v and gate/up parts together, so the tensors it holds are not the adapter's. The
sum of the A and B tensors vLLM's own loader produced — read from the file, in vLLM's
LoRA dtype, before the scaling is folded in — is kept on the loaded adapter together
with the directory it came from (:func:`record_adapter_loads`), as the repacked base
weights' sums are. With an adapter, :func:`serving_fingerprint` adds that sum for the
adapter loaded from the newest version's directory, if vLLM's manager holds one (an
error otherwise). It proves that vLLM's manager holds, from that directory, an adapter
whose values are the trainer's; not the scaling vLLM applies (alpha and r come from the
adapter_config.json the engine wrote), nor the per-slot copies its kernels read.

A CPU whose AMX tile state the kernel does not enable (a VM may hide it) still reports
AMX to torch, and vLLM's bfloat16 CPU attention then dies of an illegal instruction:
:func:`report_amx_truthfully` makes torch's report match what the process may use.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from functools import wraps
from typing import Any, cast

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from corun.engines.fingerprint import bits_sum, format_fingerprint
from corun.engines.token_versions import VersionRecord
from corun.engines.vllm_common import NUCLEUS, OFFSET


class BehaviourLogprobs(LogitsProcessor):
    """Rows become log-probs after the temperature, before top-k/top-p; rows with
    corun's own top-p lower the tokens outside their nucleus by OFFSET (see above)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._top_p: dict[int, float] = {}  # batch row → its nucleus (NUCLEUS extra arg)

    def is_argmax_invariant(self) -> bool:
        return True  # applied after the temperature, with the other argmax-invariant ones

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self._top_p
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, _, _ in batch_update.added:
            top_p = (getattr(params, "extra_args", None) or {}).get(NUCLEUS)
            rows.pop(index, None)
            if top_p is not None:
                rows[index] = float(top_p)
        for first, second, direction in batch_update.moved:
            moved, other = rows.pop(first, None), rows.pop(second, None)
            if moved is not None:
                rows[second] = moved
            if direction == MoveDirectionality.SWAP and other is not None:
                rows[first] = other

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
        rows = [row for row in self._top_p if row < logits.shape[0]]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            top_p = torch.tensor([self._top_p[row] for row in rows], device=logits.device)
            chosen = logits[index]
            logits[index] = chosen - OFFSET * (~_nucleus(chosen, top_p)).to(chosen.dtype)
        return logits


def _nucleus(log_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest set of most likely tokens whose mass reaches its top_p
    (corun/engines/decode.py's rule; top_p 0: the argmax alone)."""
    ordered, order = log_probs.sort(dim=-1, descending=True)
    probs = ordered.exp()
    keep = (probs.cumsum(dim=-1) - probs) < top_p[:, None]
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


# ---- the weights fingerprint

PACKED = "_corun_packed_bits"  # on a layer: the bit sum of the weight oneDNN repacked


def record_packed_weights() -> None:
    """Wrap vLLM's CPU GEMM dispatch (which repacks a linear layer's weight and empties
    the parameter) to keep the weight's bit sum on its layer first. Idempotent; a vLLM
    without that function (another platform, another version) needs none."""
    from vllm.model_executor.layers import utils

    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if dispatch is None or getattr(dispatch, "corun_records", False):
        return

    @wraps(dispatch)
    def recording(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = cast(torch.Tensor, layer.weight)
        before = bits_sum([weight]) if remove_weight and not weight.is_meta else None
        dispatch(layer, remove_weight)
        if before is not None and cast(torch.Tensor, layer.weight).numel() == 0:
            setattr(layer, PACKED, before)
        elif hasattr(layer, PACKED):
            delattr(layer, PACKED)

    recording.corun_records = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = recording


record_packed_weights()  # before vLLM loads a model: both engines import this module first


LOADED = "_corun_adapter"  # on a LoRAModel: (its directory, the bit sum of its tensors)


def record_adapter_loads() -> None:
    """Wrap vLLM's adapter loader (``LoRAModel.from_local_checkpoint``) to keep, on the
    adapter it returns, its directory and the bit sum of its A and B tensors as loaded,
    before vLLM folds the scaling into B. Idempotent; a vLLM without it needs none."""
    from vllm.lora.lora_model import LoRAModel

    method = LoRAModel.__dict__.get("from_local_checkpoint")
    if not isinstance(method, classmethod) or getattr(method, "corun_records", False):
        return
    load = method.__func__

    @wraps(load)
    def recording(cls: type, lora_dir: str, *args: Any, **kwargs: Any) -> Any:
        lora = load(cls, lora_dir, *args, **kwargs)
        tensors: list[torch.Tensor] = []
        for layer in lora.loras.values():
            tensors += [t for t in (layer.lora_a, layer.lora_b) if isinstance(t, torch.Tensor)]
        for full in lora.modules_to_save.values():
            tensors += [t for t in (full.weight, full.bias) if t is not None]
        setattr(lora, LOADED, (os.path.realpath(lora_dir), bits_sum(tensors)))
        return lora

    wrapper: classmethod[Any, ..., Any] = classmethod(recording)
    wrapper.corun_records = True  # type: ignore[attr-defined]
    LoRAModel.from_local_checkpoint = wrapper  # type: ignore[method-assign,assignment]


def serving_fingerprint(worker: Any, adapter_dir: str | None = None) -> str:
    """``llm.collective_rpc(serving_fingerprint, args=(adapter_dir,))``: the fingerprint
    of the worker's model, its repacked weights by the sums kept when they were
    repacked, plus the adapter vLLM loaded from ``adapter_dir`` if given (see above)."""
    model: torch.nn.Module = worker.model_runner.get_model()
    total = bits_sum(model.parameters())
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == 0:
            total += getattr(module, PACKED, 0)
    if adapter_dir is not None:
        total += _adapter_bits(worker, os.path.realpath(adapter_dir))
    return format_fingerprint(total)


def _adapter_bits(worker: Any, directory: str) -> int:
    manager = worker.model_runner.lora_manager
    for lora in manager._adapter_manager.list_adapters().values():
        source, bits = getattr(lora, LOADED, (None, 0))
        if source == directory:
            return int(bits)
    raise RuntimeError(f"vLLM's LoRA manager holds no adapter loaded from {directory}")


# ---- AMX

ARCH_PRCTL = 158  # x86-64 syscall number
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XTILEDATA = 0x1024, 0x1023, 18  # asm/prctl.h


def amx_permitted() -> bool:
    """Whether the kernel lets this process use AMX tiles (asking for them, as oneDNN
    does): not where the hypervisor leaves their state out (XTILEDATA). Elsewhere than
    Linux on x86-64 torch's report stands."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XTILEDATA)
    mask = ctypes.c_ulong(0)
    if libc.syscall(ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> XTILEDATA & 1)


def report_amx_truthfully() -> None:
    """torch reports AMX from the CPU's feature bits alone; where the process may not
    use AMX, make ``torch.cpu._is_amx_tile_supported`` (what vLLM asks) say so."""
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if supported is not None and supported() and not amx_permitted():
        torch.cpu._is_amx_tile_supported = lambda: False


# Before vLLM loads a model or an adapter: both engines import this module first.
record_adapter_loads()
report_amx_truthfully()


def reload_state(worker: Any, state: dict[str, torch.Tensor]) -> None:
    """``llm.collective_rpc(reload_state, args=(state,))`` in process: tensors by reference.

    ``reload_weights`` and not ``load_weights``: on CPU the loaded weights are repacked
    for oneDNN, so only a full reload (checkpoint format in, repacking again) works.
    vLLM takes the tensors one at a time, so a failure names the tensor it was loading
    (its own message is often empty: a bare AssertionError for a wrong shape).
    """
    loading: list[str] = []

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in state.items():
            loading[:] = [f"{name} (shape {list(tensor.shape)})"]
            yield name, tensor

    try:
        worker.model_runner.reload_weights(weights_iterator=weights())
    except Exception as exc:
        what = f"{type(exc).__name__}: {exc}" if str(exc).strip() else type(exc).__name__
        at = f" at {loading[0]}" if loading else ""
        raise RuntimeError(f"loading the weights failed{at}: {what}") from exc


class WeightSync:
    """Worker methods the server exposes through ``/collective_rpc`` (dev mode)."""

    model_runner: Any
    _corun_versions: VersionRecord | None = None

    def corun_reload(self, path: str, version: int | None = None) -> int:
        """Load the safetensors file at ``path`` as ``version``; returns the number of
        tensors. Under in-flight updates (:meth:`corun_track_versions`) the requests
        started and unfinished keep, in the record, how many tokens they had before."""
        from safetensors.torch import load_file

        state = load_file(path)
        reload_state(self, state)
        record = self._corun_versions
        if record is not None and version is not None:
            # model_runner.requests: every started request until it finishes, a
            # preempted one included; under pause(mode="keep") no step runs now.
            running = self.model_runner.requests.items()
            record.switched({rid: len(r.output_token_ids) for rid, r in running}, version)
        return len(state)

    def corun_track_versions(self, version: int) -> None:
        """Keep each request's versions from now on (token_versions.py): wraps this
        worker's ``execute_model`` to note the requests it schedules for the first time.
        Idempotent."""
        if self._corun_versions is not None:
            return
        record = self._corun_versions = VersionRecord(version)
        execute = cast(Any, self).execute_model  # the worker's, this class mixed into it

        @wraps(execute)
        def noting(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            record.scheduled(new.req_id for new in scheduler_output.scheduled_new_reqs)
            return execute(scheduler_output, *args, **kwargs)

        self.execute_model = noting  # the executor looks it up on the worker per step

    def corun_found(self, prefixes: list[str]) -> list[int | None]:
        """What the update now running finds of the requests with these id prefixes
        (token_versions.VersionRecord.found): streamed requests' versions as they go."""
        if self._corun_versions is None:
            return [None] * len(prefixes)
        return self._corun_versions.found(prefixes, self.corun_generated())

    def corun_versions(self, prefixes: list[str]) -> list[Any]:
        """The version records of the finished requests with these id prefixes, taken
        (None where none is kept)."""
        if self._corun_versions is None:
            return [None] * len(prefixes)
        return list(self._corun_versions.take(prefixes))

    def corun_generated(self) -> dict[str, int]:
        """The tokens each started, unfinished request has so far (for tests and
        diagnostics: what an update would find)."""
        return {rid: len(r.output_token_ids) for rid, r in self.model_runner.requests.items()}

    def corun_fingerprint(self, adapter_dir: str | None = None) -> str:
        """The fingerprint of the weights this worker serves, with the adapter loaded
        from ``adapter_dir`` if given (see above)."""
        return serving_fingerprint(self, adapter_dir)


PARENT_ENV = "CORUN_VLLM_PARENT"  # the pid of the process the server must not outlive
WORKDIR_ENV = "CORUN_VLLM_WORKDIR"  # the engine's temporary directory (log, weights)


def _exit_with_parent(parent: int, workdir: str) -> None:
    """Kill this process group when the parent dies (even by SIGKILL, which leaves the
    parent no chance to stop its children): a server never outlives its run. Its
    temporary directory goes too: nobody is left to read the log."""
    while os.getppid() == parent:
        time.sleep(0.5)
    if os.path.basename(workdir).startswith("corun-vllm-"):  # only what vllm_server made
        shutil.rmtree(workdir, ignore_errors=True)
    if os.getpgrp() == os.getpid():  # we lead our own group (corun.ChildProcess)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_parent() -> None:
    """Start the watch above on the parent named by ``CORUN_VLLM_PARENT`` (set by
    vllm_server.py), else on the current parent. Named, because importing this module
    (torch, vLLM) takes seconds: a parent that died meanwhile has already been replaced
    by init, and ``os.getppid()`` read now would watch init forever."""
    parent = int(os.environ.pop(PARENT_ENV, "0")) or os.getppid()
    workdir = os.environ.pop(WORKDIR_ENV, "")
    threading.Thread(target=_exit_with_parent, args=(parent, workdir), daemon=True).start()


def main(argv: list[str]) -> None:
    """The server: vLLM's OpenAI API server with the parent watch above."""
    import runpy

    watch_parent()
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
