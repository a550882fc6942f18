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
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


class BehaviourLogprobs(LogitsProcessor):
    """Rows become log-probs after the temperature, before top-k/top-p (see above)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True  # applied after the temperature, with the other argmax-invariant ones

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass  # stateless: every row gets the same shift

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))


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

    def corun_reload(self, path: str) -> int:
        """Load the safetensors file at ``path``; returns the number of tensors."""
        from safetensors.torch import load_file

        state = load_file(path)
        reload_state(self, state)
        return len(state)


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
