"""Ray rollout workers against thread workers (corun/scale/ray_workers.py): the time per
rollout batch on a Ray actor vs on a compute lane in this process (the difference is
Ray's overhead: the call, the thread hop that awaits it, the batch through the object
store), and the time to publish weights (``ray.put`` of the state vs the in-process
``sync_weights``, which clones it for the worker threads) — for a tiny and a larger
TinyLM (the ``grpo`` trainer, through the registry). One local Ray cluster (1 actor),
every figure a ratio measured in this run::

    python -m benchmarks.ray_workers            # ~1 minute
    python -m benchmarks.ray_workers --quick    # the tiny model, fewer batches

Nothing is asserted: timings belong in benchmarks. Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from corun.base.rng import rollout_generator
from corun.contract.config_file import config_from_dict
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import RolloutContext, SetupContext
from corun.execution.compute import Lane
from corun.loop.clock import Clock
from corun.records.events import EventLog
from corun.scale.ray_workers import RayWorkers

MODELS = {"tiny": (32, 1, 2), "larger": (256, 4, 4)}  # d_model, n_layers, n_heads


async def measure(model: str, batches: int, publishes: int, tmp: Path) -> dict[str, Any]:
    d_model, n_layers, n_heads = MODELS[model]
    config = config_from_dict({
        "run": {"dir": str(tmp / model), "seed": 0},
        "loop": {"concurrency": 2, "workers": 1, "lane_threads": 1},
        "data": {"batch_size": 4},
        "rollout": {"backend": "ray"},
        "trainer": {"kind": "grpo", "task": "sort", "d_model": d_model, "n_layers": n_layers,
                    "n_heads": n_heads, "samples_per_prompt": 4, "eval_size": 16},
    })  # fmt: skip
    (tmp / model).mkdir(parents=True, exist_ok=True)
    trainer: Any = resolve_trainer(config.trainer.kind)(config)
    trainer.setup(SetupContext(config))
    dataset = trainer.dataset()
    clock = Clock.start(config.loop, 0, 0, 0, [])
    train, rollout_lane = Lane("train", torch_threads=1), Lane("rollout-0", torch_threads=1)
    workers = await RayWorkers.start(trainer, config, 1, clock, EventLog(tmp / model), train)

    def ctx(index: int) -> RolloutContext:
        return RolloutContext(index, rollout_generator(0, index, 0), 0, 0)

    try:
        await rollout_lane.run(trainer.rollout, dataset.batch(0), ctx(0))  # warm-up both
        await workers.rollout(0, dataset.batch(0), ctx(0), 0)
        thread_s, ray_s = [], []
        for index in range(1, batches + 1):  # interleaved: both see the same machine load
            inputs = dataset.batch(index)
            started = time.perf_counter()
            await rollout_lane.run(trainer.rollout, inputs, ctx(index))
            thread_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            await workers.rollout(0, inputs, ctx(index), 0)
            ray_s.append(time.perf_counter() - started)
        sync_s, put_s = [], []
        for version in range(1, publishes + 1):
            started = time.perf_counter()
            await train.run(trainer.sync_weights, version)
            sync_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            await workers.publish(version)
            put_s.append(time.perf_counter() - started)
    finally:
        await workers.stop()
        train.close()
        rollout_lane.close()

    def ms(xs: list[float]) -> float:
        return 1000 * statistics.median(xs)

    return {
        "model": model, "params": trainer.policy.num_params(),
        "thread_ms": ms(thread_s), "ray_ms": ms(ray_s), "overhead_ms": ms(ray_s) - ms(thread_s),
        "sync_ms": ms(sync_s), "put_ms": ms(put_s),
    }  # fmt: skip


def report(rows: list[dict[str, Any]]) -> None:
    print("rollout batch (median ms)         thread      ray   overhead  ray/thread")
    for r in rows:
        ratio = r["ray_ms"] / r["thread_ms"]
        print(f"  {r['model']:6} ({r['params']:>9,} params) {r['thread_ms']:8.1f} "
              f"{r['ray_ms']:8.1f} {r['overhead_ms']:8.1f}  {ratio:8.2f}x")  # fmt: skip
    print("weight publish (median ms)     in-process  ray.put  put/in-process")
    for r in rows:
        print(f"  {r['model']:6} ({r['params']:>9,} params) {r['sync_ms']:8.2f} "
              f"{r['put_ms']:8.2f}  {r['put_ms'] / r['sync_ms']:8.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, fewer batches")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models, batches, publishes = (["tiny"], 5, 5) if args.quick else (list(MODELS), 20, 20)
    with tempfile.TemporaryDirectory(prefix="corun-bench-ray-") as tmp:
        rows = [anyio.run(measure, m, batches, publishes, Path(tmp)) for m in models]
    report(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "batches": batches}, indent=1))


if __name__ == "__main__":
    main()
