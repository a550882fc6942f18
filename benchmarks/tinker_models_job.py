"""The job of ``corun bench tinker_models`` (benchmarks/tinker_models.py), a process
per model count: ``python -m benchmarks.tinker_models_job MODEL COUNT ROUNDS`` makes
COUNT rank-8 LoRA models on the base MODEL as ``corun serve tinker`` does
(trainers/hf/tinker.py), trains them round-robin for ROUNDS timed rounds after one of
warm-up, and prints one JSON line: each model step's milliseconds, the MiB of the
tensors all models hold (a shared tensor once), and the process's resident MiB. It
drives trainers/hf directly; the suite runs it as a process, never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks.tinker_models import RANK, ROWS, TOKENS


def job(model: str, count: int, rounds: int) -> dict[str, Any]:
    """In this process: ``count`` models on the base ``model``, ``rounds`` timed rounds."""
    import torch

    from corun.contract.training_api import AdamStep, Datum, LoraShape, ModelInfo
    from trainers.hf.policy import load_policy
    from trainers.hf.tinker import HFTrainingModel

    base, tokenizer = load_policy(model, "the base")
    info = ModelInfo("base", RANK, str(base.source), TOKENS + 1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (ROWS, TOKENS + 1), generator=generator)
    data = [Datum(row[:-1].tolist(), {"target_tokens": row[1:], "weights": torch.ones(TOKENS)})
            for row in ids]  # fmt: skip
    models = [HFTrainingModel(base, info, LoraShape(rank=RANK), seed) for seed in range(count)]
    times: list[float] = []
    for round_index in range(rounds + 1):
        for each in models:
            started = time.perf_counter()
            each.forward_backward(data, "cross_entropy", {}, backward=True)
            each.optim_step(AdamStep(learning_rate=1e-4))
            if round_index:  # the first round warms up (allocations, the optimizer state)
                times.append(time.perf_counter() - started)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for each in models for t in tensors(each)}  # fmt: skip
    return {"step_ms": sorted(1000 * t for t in times), "tensor_mib": sum(held.values()) / 2**20,
            "rss_mib": resident_mib()}  # fmt: skip


def tensors(model: Any) -> list[Any]:
    """A model's tensors: its weights and its optimizer's state."""
    state = [v for s in model.optimizer.state.values() for v in s.values() if hasattr(v, "shape")]
    return [*model.policy.parameters(), *model.policy.buffers(), *state]


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("count", type=int)
    parser.add_argument("rounds", type=int)
    args = parser.parse_args(argv)
    print(json.dumps(job(args.model, args.count, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
