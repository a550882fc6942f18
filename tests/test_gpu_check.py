"""benchmarks/gpu_check.py off a GPU: one line saying it skipped, exit 0; and its code
path end to end on CPU (``--cpu-smoke``: 2 gloo ranks with FSDP2 and LoRA, full and
adapter syncs to the transformers engine, each verified; then hf_grpo through
``corun train`` in each placement — transformers engine, vLLM colocated, vLLM apart,
LoRA, bfloat16, FSDP2 — every sync verified and the engine's log-probs within the
trainer's bound). Figures are never asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_gpu_check_skips_without_cuda() -> None:
    result = gpu_check(timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("gpu_check: skipped: no CUDA device")
    assert result.stdout.count("\n") == 1


@pytest.mark.slow
def test_gpu_check_cpu_smoke() -> None:
    result = gpu_check("--cpu-smoke", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {
        cells[0]: cells[1:]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and len(cells := line.strip("| ").split(" | ")) > 1
    }
    assert {"train step", "full-weight sync", "adapter sync"} <= rows.keys()
    assert "world size 2, FSDP2-sharded, float32 asked, float32 computed" in result.stdout
    placements = ["transformers engine", "vLLM colocated", "vLLM apart", "LoRA r8",
                  "bfloat16", "FSDP2 x2"]  # fmt: skip
    for placement in placements:
        cells = rows[f"hf_grpo, {placement}"]
        assert cells[-1] == "2" and cells[-2].endswith("(yes)"), (placement, cells)
