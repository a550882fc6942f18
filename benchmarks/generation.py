"""``corun bench generation``: each rollout engine against its library run bare, on the
same batch: the ``hf_grpo`` step's 16 word problems x 8 samples, 8 new tokens at
temperature 1, run to the end (no stop token: the same work on both sides).

- **transformers**: corun's transformers engine (``TransformersEngine.generate``: its
  lane, corun/engines/decode.py's KV-cache loop, behaviour log-probs) against
  ``model.generate`` (sampling, no log-probs), in one process, interleaved, at the
  built-in tiny Llama and a ~50M-parameter one (benchmarks/peers.py's);
- **vLLM**: corun's in-process vLLM engine (``VLLMEngine.generate``: behaviour
  log-probs, draining, versions) against ``vllm.LLM.generate`` with the same sampling
  and one log-prob per token, each in a fresh process (one vLLM per process), one after
  the other.

::

    python -m benchmarks.generation          # ~3 minutes
    python -m benchmarks.generation --quick  # fewer repeats, the tiny model alone

Medians of the repeats; ratios are corun's time over the bare library's (below 1: corun
is faster). Nothing is asserted; measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.peers import JOB, THREADS, big_model, job
from benchmarks.report import Note, Table, fmt, markdown_table
from corun.engines.options import VLLMConfig, eager


@dataclass(frozen=True)
class Grid:
    repeats: int
    big: bool  # the ~50M model too
    vllm: bool


GRIDS = {"full": Grid(9, True, True), "quick": Grid(3, False, True), "tiny": Grid(2, False, False)}


def prompts(model_dir: Path) -> tuple[list[list[int]], int]:
    """The hf_grpo step's prompt ids (batch 0, each prompt 8 times) and the pad id."""
    found = job("prompts", str(model_dir))
    return found["rows"], int(found["pad_id"])


def timed(call: Callable[[int], object], repeats: int) -> list[float]:
    call(-1)  # warm-up
    times = []
    for seed in range(repeats):
        started = time.perf_counter()
        call(seed)
        times.append(time.perf_counter() - started)
    return times


# ----------------------------------------------------------------------------- transformers


def transformers_pair(model_dir: Path, repeats: int) -> dict[str, float]:
    """Median seconds of corun's transformers engine and of ``generate``, interleaved."""
    import anyio
    from transformers import AutoModelForCausalLM

    from corun.contract.engine import Sampling
    from corun.engines.decode import left_pad
    from corun.engines.transformers_engine import TransformersEngine
    from corun.execution.compute import Lane

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    rows, pad_id = prompts(model_dir)
    sampling = Sampling(max_tokens=JOB.max_new_tokens, temperature=1.0)
    ids, mask = left_pad(rows, pad_id)
    lane = Lane("engine")
    engine = TransformersEngine(SimpleNamespace(model=model), pad_id, lane, owns_lane=True,
                                interrupt=False)  # fmt: skip

    def bare() -> None:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True,
                           temperature=1.0, top_p=1.0, top_k=0,
                           max_new_tokens=JOB.max_new_tokens,
                           min_new_tokens=JOB.max_new_tokens, pad_token_id=pad_id)  # fmt: skip

    async def interleaved() -> dict[str, float]:
        times: dict[str, list[float]] = {"corun": [], "bare": []}
        for seed in range(-1, repeats):  # one call each per round; round -1 warms up
            started = time.perf_counter()
            await engine.generate(rows, sampling, seed)
            middle = time.perf_counter()
            torch.manual_seed(seed)
            bare()
            if seed >= 0:
                times["corun"].append(middle - started)
                times["bare"].append(time.perf_counter() - middle)
        return {name: statistics.median(values) for name, values in times.items()}

    try:
        return anyio.run(interleaved)
    finally:
        lane.close()


# ----------------------------------------------------------------------------- vLLM


def vllm_alone(which: str, model_dir: Path, repeats: int) -> float:
    """Median seconds of one side, in this process: corun's engine or vLLM bare."""
    rows, _ = prompts(model_dir)
    if which == "bare":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        settings = VLLMConfig(model=str(model_dir), dtype="float32")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)  # as the engine's
        llm = LLM(model=str(model_dir), dtype="float32", seed=0, enforce_eager=eager(settings),
                  max_num_seqs=len(rows), disable_log_stats=True)  # fmt: skip
        requests = [TokensPrompt(prompt_token_ids=row) for row in rows]

        def bare(seed: int) -> None:
            params = SamplingParams(max_tokens=JOB.max_new_tokens, temperature=1.0, seed=seed,
                                    logprobs=0, ignore_eos=True)  # fmt: skip
            llm.generate(requests, params, use_tqdm=False)

        return statistics.median(timed(bare, repeats))
    import anyio

    from corun.contract.engine import Sampling
    from corun.engines.vllm_engine import VLLMEngine

    async def main() -> float:
        config = VLLMConfig(model=str(model_dir), dtype="float32", max_num_seqs=len(rows))
        engine = await VLLMEngine.start(config)
        sampling = Sampling(max_tokens=JOB.max_new_tokens, temperature=1.0)
        try:
            times = []
            for seed in range(-1, repeats):
                started = time.perf_counter()
                await engine.generate(rows, sampling, seed + 1)
                if seed >= 0:
                    times.append(time.perf_counter() - started)
            return statistics.median(times)
        finally:
            await engine.shutdown()

    return anyio.run(main)


def vllm_pair(model_dir: Path, repeats: int) -> dict[str, float]:
    """Each side in a fresh ``python -m benchmarks.generation --alone``."""
    found = {}
    for which in ("corun", "bare"):
        command = [sys.executable, "-m", "benchmarks.generation", "--alone", which,
                   str(model_dir), "--repeats", str(repeats)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              env={**os.environ, "WANDB_MODE": "disabled"})  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"vLLM {which}: exited {done.returncode}\n{done.stderr[-3000:]}")
        found[which] = float(json.loads(done.stdout.strip().splitlines()[-1])["median_s"])
    return found


# ----------------------------------------------------------------------------- corun bench


def suite(grid_name: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench generation``: each engine against its library run bare."""
    grid = GRIDS[grid_name]
    torch.set_num_threads(THREADS)
    tiny = Path(job("tiny-model"))
    models = [("tiny Llama", tiny)] + ([("~50M Llama", big_model(scratch)[0])] if grid.big else [])
    rows, ratios = [], []

    def add(engine: str, label: str, pair: dict[str, float]) -> None:
        ratio = pair["corun"] / pair["bare"]
        tokens = JOB.batch * JOB.max_new_tokens
        rows.append([
            f"{engine}, {label}", fmt(pair["corun"] * 1000, 1), fmt(pair["bare"] * 1000, 1),
            fmt(tokens / pair["corun"], 0), f"{ratio:.2f}",
        ])  # fmt: skip
        ratios.append((f"{engine}, {label}", ratio))

    for label, model_dir in models:
        note(f"transformers engine vs generate: {label}")
        add("transformers", label, transformers_pair(model_dir, grid.repeats))
    if grid.vllm and find_spec("vllm") is not None:
        note("vLLM engine vs vLLM bare: tiny Llama (a process each)")
        add("vLLM", "tiny Llama", vllm_pair(tiny, grid.repeats))
    return [Table(
        "generation", "bare", "Each rollout engine against its library run bare",
        ["engine, model", "corun ms", "bare ms", "corun tokens/s", "corun / bare"],
        rows, ratios, "the bare library's time on the same batch; below 1: corun is faster",
        [f"{JOB.batch} prompts (the hf_grpo step's), {JOB.max_new_tokens} new tokens each "
         "at temperature 1, run to the end; corun's engines also return each token's "
         "log-prob. transformers: one process, interleaved; vLLM: a fresh process each."],
    )]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, the tiny model")
    parser.add_argument("--alone", choices=("corun", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("model", nargs="?", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    if args.alone:  # one side of the vLLM pair (vllm_pair's child)
        print(json.dumps({"median_s": vllm_alone(args.alone, args.model, args.repeats)}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for table in suite("quick" if args.quick else "full", Path(tmp), print):
            print("\n".join(markdown_table(table, plot=False)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
