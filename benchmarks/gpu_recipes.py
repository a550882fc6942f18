"""The shipped hf recipes on the run's device, for benchmarks/gpu_check.py: a few steps
of each with ``corun train``, as a user runs them, and of hf_grpo in each placement that
matters on a GPU — the transformers engine, vLLM colocated (sleep mode), vLLM apart (a
server on its own GPU, or on the trainer's with CUDA IPC where there is one), LoRA,
bfloat16, and FSDP2 over every visible GPU. Every weight sync in these runs is verified
by the engine's fingerprint (the hf trainers fail the run otherwise).

One row per run, from its own records: step time (``perf/train_time_s``, median after
the first step), generation tokens/s (sampled tokens over ``perf/generate_time_s``),
sync time, peak device memory (``perf/device_memory_peak_gib``; none on CPU), and
whether the engine's log-probs match the trainer's recomputation: the trainer's
``mismatch/k3`` stays under its documented bound (``trainer.mismatch_bound``,
``alert/mismatch_k3`` never raised; docs/corrections.md).

``--cpu-smoke`` (in CI) runs the placements of hf_grpo on CPU, tiny: the same commands
and code paths (vLLM's sleep does nothing on CPU; "apart" is a server reloading from a
file, the device-to-device transfer needs CUDA).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("hf_sft", "hf_grpo", "hf_grpo_vllm", "hf_ppo", "hf_agentic", "hf_agentic_async",
           "hf_agentic_sft", "hf_agentic_vllm")  # fmt: skip


@dataclass(frozen=True)
class Variant:
    name: str
    recipe: str
    overrides: tuple[str, ...] = ()
    ranks: int = 1


def variants(gpus: int, smoke: bool) -> list[Variant]:
    """Each shipped recipe as it is (on a GPU), then hf_grpo in each placement."""
    # Apart: the server on the second GPU (NCCL), or on the trainer's own (CUDA IPC).
    apart = () if smoke else (f"trainer.engine_options.devices=[{1 if gpus > 1 else 0}]",)
    placements = [
        Variant("hf_grpo, transformers engine", "hf_grpo"),
        Variant("hf_grpo, vLLM colocated", "hf_grpo_vllm",
                ("trainer.engine_options.colocate=true",)),
        Variant("hf_grpo, vLLM apart", "hf_grpo_vllm", ('trainer.engine="vllm-server"', *apart)),
        Variant("hf_grpo, LoRA r8", "hf_grpo", ("trainer.lora.rank=8",)),
        Variant("hf_grpo, bfloat16", "hf_grpo", ("trainer.dtype=bfloat16",)),
        Variant(f"hf_grpo, FSDP2 x{max(gpus, 2) if smoke else gpus}", "hf_grpo",
                ('run.parallel="fsdp"',), ranks=2 if smoke else max(gpus, 1)),
    ]  # fmt: skip
    return placements if smoke else [Variant(r, r) for r in RECIPES] + placements


def run(variant: Variant, device: str, steps: int, scratch: Path) -> dict[str, Any]:
    """``corun train`` of the variant for ``steps`` steps; its row's figures."""
    recipe = tomllib.loads((ROOT / "configs" / f"{variant.recipe}.toml").read_text())
    trainer = recipe["trainer"]
    run_dir = scratch / variant.name.replace(", ", "-").replace(" ", "_")
    command = [
        sys.executable, "-m", "corun", "train", variant.recipe, f"run.device={device}",
        f"run.steps={steps}", f"run.dir={run_dir}", f"run.nproc={variant.ranks}",
        f"loop.eval_interval={steps}", f"loop.save_interval={steps}", "log.progress=off",
        "data.batch_size=4", *(["trainer.eval_size=16"] if "eval_size" in trainer else []),
        *(['trainer.init_from=""'] if "init_from" in trainer else []), *variant.overrides,
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"name": variant.name, "failed": f"exit {done.returncode}: {tail[0]}"}
    return figures(variant.name, run_dir, 4 * int(trainer.get("samples_per_prompt", 1)))


def figures(name: str, run_dir: Path, sequences: int) -> dict[str, Any]:
    from corun.records.events import read_records

    rows = read_records(run_dir / "metrics.jsonl")
    events = read_records(run_dir / "events.jsonl")

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in rows if key in r]

    def typical(key: str) -> float | None:
        got = values(key)
        return statistics.median(got[1:] or got) if got else None

    generated = [len_ * sequences / s for len_, s in zip(values("rollout/response_len_mean"),
                 values("perf/generate_time_s"), strict=False) if s > 0]  # fmt: skip
    k3 = values("train/mismatch/k3")
    return {
        "name": name, "step_s": typical("perf/train_time_s"),
        "tokens_per_s": statistics.median(generated) if generated else None,
        "sync_s": typical("perf/sync_time_s"),
        "peak_gib": max(values("perf/device_memory_peak_gib"), default=None),
        "k3": max(k3) if k3 else None,
        "match": (not any(values("train/alert/mismatch_k3"))) if k3 else None,
        "verified": sum(1 for e in events if e["event"] == "sync" and e.get("weights")),
    }  # fmt: skip


def table(rows: list[dict[str, Any]], where: str) -> str:
    from benchmarks.report import Table, fmt, markdown_table

    def shown(value: float | None, digits: int) -> str:
        return "-" if value is None else fmt(value, digits)

    cells = []
    for row in rows:
        if "failed" in row:
            cells.append([row["name"], "failed", row["failed"], "", "", "", ""])
            continue
        match = "-" if row["match"] is None else ("yes" if row["match"] else "NO")
        cells.append([
            row["name"], shown(row["step_s"], 3), shown(row["tokens_per_s"], 0),
            shown(row["sync_s"], 3), shown(row["peak_gib"], 2),
            f"{shown(row['k3'], 5)} ({match})", str(row["verified"]),
        ])  # fmt: skip
    result = Table(
        "gpu_check", "recipes", f"The hf recipes on {where}, a few steps each",
        ["run", "step s", "generated tokens/s", "sync s", "peak GiB",
         "log-prob k3 max (within bound)", "syncs verified"],
        cells, [], "",
        ["From each run's metrics.jsonl and events.jsonl; step and sync: medians after the "
         "first; k3: the trainer's mismatch between the engine's and its own log-probs "
         "(bound: trainer.mismatch_bound)."],
    )  # fmt: skip
    return "\n".join(markdown_table(result, plot=False))


def check(device: str, gpus: int, smoke: bool, scratch: Path) -> tuple[str, bool]:
    """Every variant run; the table and whether all of them ran and matched."""
    steps = 2 if smoke else 4
    rows = [run(v, device, steps, scratch) for v in variants(gpus, smoke)]
    ok = all("failed" not in r and r["match"] is not False for r in rows)
    return table(rows, device), ok
