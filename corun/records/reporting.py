"""Where metrics go: ``metrics.jsonl``, wandb, and a progress display.

wandb is imported only when it is on (its import alone costs about a second), runs
with the run's own id so a resumed run reattaches to the same wandb run, and its
service process is ended at close (``wandb.teardown``), which ``finish`` alone
leaves running.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from corun.base.config import Config
from corun.contract.trainer import Image, is_alert
from corun.records.events import MetricsLog

# What the progress line shows, in this order, when a trainer logs it. A multi-track
# trainer's `train/<track>/loss` ranks as `train/loss`, so every track is shown.
_HEADLINE = ("train/loss", "rollout/reward_mean", "eval/accuracy", "eval/reward", "eval/loss")
_HEADLINE_MAX = 4


def headline_rank(key: str) -> tuple[int, str] | None:
    """Where ``key`` goes on the progress line (None: not shown)."""
    parts = key.split("/")
    base = f"{parts[0]}/{parts[-1]}" if len(parts) == 3 else key
    return (_HEADLINE.index(base), key) if base in _HEADLINE else None


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise, or nothing; shown from
    :meth:`start` on (a prerequisite run shows its own first)."""

    def __init__(self, mode: str, total: int, start: int) -> None:
        if mode == "auto":
            mode = "rich" if sys.stderr.isatty() else "plain"
        self.mode = mode
        self.total = total
        self.first_step = start
        self._last_printed = -1
        self._plain_every = max(1, total // 20)
        self._headline: dict[str, tuple[float, int]] = {}  # key -> (value, its step)
        self._bar: Any = None

    def start(self) -> None:
        if self.mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[headline]}"),
                transient=False,
            )
            self._task = self._bar.add_task(
                "train", total=self.total, completed=self.first_step, headline=""
            )
            self._bar.start()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._bar is None and self.mode != "plain":  # off: nothing shows the headline
            return
        for key, value in metrics.items():
            if headline_rank(key) is not None:
                self._headline[key] = (value, step)
        headline = self.headline(step)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, headline=headline)
        elif self.mode == "plain":
            self._print_plain(step, metrics, headline)

    def headline(self, step: int) -> str:
        """The headline metrics at ``step``: an evaluation's values stand as measured
        only at the step it ran; later they are marked with it, ``[eval at step 0:
        eval/reward=0.008]``, so a value carried over never reads as a new one."""
        ranked = sorted(self._headline, key=lambda k: headline_rank(k) or (0, k))
        fresh: list[str] = []
        carried: dict[int, list[str]] = {}
        for key in ranked[:_HEADLINE_MAX]:
            value, at = self._headline[key]
            text = f"{key}={value:.4g}"
            if at == step or not key.startswith("eval/"):
                fresh.append(text)
            else:
                carried.setdefault(at, []).append(text)
        fresh += [f"[eval at step {at}: {'  '.join(texts)}]" for at, texts in carried.items()]
        return "  ".join(fresh)

    def _print_plain(self, step: int, metrics: Mapping[str, float], headline: str) -> None:
        evals = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if evals:
            line = "  ".join(f"{k}={v:.4g}" for k, v in sorted(evals.items()))
            print(f"eval at step {step}/{self.total}  {line}", file=sys.stderr, flush=True)
        elif step != self._last_printed and (step % self._plain_every == 0 or step == self.total):
            self._last_printed = step
            print(f"step {step}/{self.total}  {headline}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """A one-line message for the person watching (nothing when progress is off)."""
        if self._bar is not None:
            self._bar.console.print(text)
        elif self.mode == "plain":
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class Reporter:
    """Fans one metrics record out to metrics.jsonl, wandb and the progress display."""

    def __init__(self, config: Config, run_dir: Path, start_step: int) -> None:
        self.config = config
        self.run_dir = run_dir
        # Records past the restored step were written after the checkpoint: drop them,
        # so metrics.jsonl reads as one uninterrupted run.
        self.metrics = MetricsLog(run_dir, keep_up_to_step=start_step if start_step else -1)
        self.progress = Progress(config.log.progress, config.run.steps, start_step)
        self._wandb: Any = None

    def start(self) -> None:
        """Show progress from now on."""
        self.progress.start()

    def start_wandb(self, run_id: str, extra: Mapping[str, Any]) -> None:
        if self.config.log.wandb == "disabled":
            return
        import msgspec
        import wandb

        self._wandb = wandb.init(
            project=self.config.log.project,
            name=self.config.run.name,
            id=run_id,
            resume="allow",
            mode=self.config.log.wandb,
            dir=str(self.run_dir),
            config={**msgspec.to_builtins(self.config), **extra},
        )

    def log(self, step: int, metrics: Mapping[str, float | Image]) -> None:
        images = {k: v for k, v in metrics.items() if isinstance(v, Image)}
        numbers = cast(Mapping[str, float], metrics)  # the common case: no images
        if images:
            numbers = {k: v for k, v in metrics.items() if not isinstance(v, Image)}
            self.metrics.log(step, {**numbers, **{k: str(v.path) for k, v in images.items()}})
        else:
            self.metrics.log(step, numbers)
        if self._wandb is not None:
            import wandb

            pictures = {k: wandb.Image(str(v.path), caption=v.caption) for k, v in images.items()}
            self._wandb.log({**numbers, **pictures}, step=step)
        self.progress.update(step, numbers)
        for key, value in numbers.items():
            if "alert" in key and is_alert(key) and value > 0:
                self.progress.note(f"corun: warning at step {step}: {key} = {value:.4g}")

    def close(self) -> None:
        """Flush and close every sink; each is attempted even if another fails."""
        self.progress.close()
        self.metrics.close()
        if self._wandb is not None:
            import wandb

            try:
                self._wandb.finish()
            finally:
                self._wandb = None
                wandb.teardown()
