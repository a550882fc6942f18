"""``corun train|serve|validate|simulate|bench|recipes``: the only place that owns argv,
signals and exit codes.

A config is a TOML file, or the name of a recipe corun ships (configs/: ``corun train
grpo``); ``corun recipes`` lists them, ``corun recipes copy grpo [DEST]`` copies one out
to edit. ``corun bench`` runs the benchmark suites (benchmarks/), found through the entry
point group ``corun.bench`` when the command is ``bench`` and never imported by name.

``corun serve`` serves the OpenAI-compatible endpoint for a config's policy — its run's
latest checkpoint, or its initial weights — without training, and prints
``corun: serving <url>`` as its first line on stdout. Its records go to
``<run dir>/serve/``; it stops on a signal like a run does.

Exit status: 0 done, 1 training error, 2 usage or config error (one line, no
traceback), 130 after SIGINT, 143 after SIGTERM. A training error's last line on
stderr is ``corun: error: ...``: alone for the runtime's own (an engine's, a deadline's,
a collective's, a checkpoint write's), after its traceback for a trainer's exception.
A thread left stuck in a call (corun/loop/deadlines.py) does not keep the process alive.

Data parallel: with ``run.nproc`` = N > 1, ``corun train`` launches torchrun with N
ranks (corun/scale/launch.py); under torchrun (``torchrun --nproc-per-node N -m corun train
...``) each rank joins the process group first. Only rank 0 writes to the run
directory; the others keep their events, metrics and trace in a scratch directory
(``$CORUN_RANK_DIR/rank-<r>``: the launcher makes that directory and removes it at
exit, also after a killed rank; under a torchrun of one's own, a temporary one the
rank removes at exit) and read
the checkpoint rank 0 resumes from. A rank leaves with ``os._exit`` after its
teardown: a collective its peers abandoned must not hold the interpreter's exit.

Signals: the first SIGINT/SIGTERM stops the run (teardown runs in full, with a save
if configured) and arms a hard deadline (``run.hard_deadline_s``) after which the
process ends whatever hangs; a second skips the optional teardown steps; a third
ends the process at once. Before the run has started (the config, the trainer's
imports), a signal ends the process at once, quietly, with 130/143.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn

import anyio
import msgspec

from corun.base.config import Config, to_toml
from corun.base.errors import UsageError
from corun.contract.config_file import load_config
from corun.contract.engine import EngineError
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import Outcome, Trainer
from corun.execution import compute, device, distributed, procs
from corun.host.early_signals import exit_on_signals, flush_output
from corun.host.runs import run
from corun.loop.deadlines import DeadlineError
from corun.loop.session import Session
from corun.loop.teardown import RunControl
from corun.recipes import is_name, locate, names, shipped, summary
from corun.records import checkpoint
from corun.records.events import EVENTS_FILE, EventLog
from corun.scale import launch

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
BENCH_ENTRY_POINTS = "corun.bench"  # `suites`: the module behind `corun bench`
BENCH_TEXT = "run the throughput suites; report.md and plots in a run directory"
_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}
REPEAT_S = 1.0  # a rank's signals this close together are one stop (see _watch_signals)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        message = "\\n".join(message.splitlines())  # an argument with a line break in it
        print(f"corun: error: {message} (see corun --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="corun", description="One async loop template for RL post-training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text in (
        ("train", "train from a TOML config"),
        ("serve", "serve the config's policy on the OpenAI-compatible endpoint, no training"),
        ("validate", "print the resolved config (after overrides) and exit"),
        ("simulate", "run the loop template on a virtual clock against a latency model"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("config", help="a TOML config file, or a recipe's name (corun recipes)")
        sub.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="config overrides")
        if name == "simulate":  # corun/sim/simulate.py
            sub.add_argument("--fit", metavar="RUN_DIR", help="fit the model to a run's records")
            sub.add_argument("--out", metavar="DIR", help="default runs/simulate/<run.name>")
    text = "serve the config's rollout engine to a training run's fleet (engine = \"remote\")"
    engine = commands.add_parser("engine", help=text, description=text)
    serve = engine.add_subparsers(dest="action", required=True, parser_class=_Parser).add_parser(
        "serve", help=text, description=text)  # fmt: skip
    serve.add_argument("config", help="a TOML config file, or a recipe's name (corun recipes)")
    serve.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="config overrides")
    commands.add_parser("bench", help=BENCH_TEXT, add_help=False)  # its arguments: _bench's
    text = "list the recipes corun ships (corun train NAME trains one)"
    recipes = commands.add_parser("recipes", help=text, description=text)
    text = "copy a recipe out to edit it"
    copy = recipes.add_subparsers(dest="action", parser_class=_Parser).add_parser(
        "copy", help=text, description=text)  # fmt: skip
    copy.add_argument("name", help="the recipe's name")
    copy.add_argument("dest", nargs="?", default=".", help="a file or folder (default: .)")
    return parser


def main(argv: list[str] | None = None) -> int:
    exit_on_signals()  # until the run's own handlers (or launch's) replace these
    logging.basicConfig(format="corun: %(message)s", level=logging.WARNING)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("bench", "simulate"):
        _raise_on_signals()  # long work of their own, whose `finally` blocks must run
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "recipes":
            return _recipes(args.action, getattr(args, "name", ""), getattr(args, "dest", "."))
        _check_config(args.config)
        if args.command == "simulate":
            from corun.sim.simulate import cli_main

            return cli_main(args.config, args.overrides, args.fit, args.out)
        config = load_config(args.config, args.overrides)
        if args.command == "validate":
            print(to_toml(config), end="")
            return EXIT_OK
        serve_only = args.command in ("serve", "engine")
        if serve_only:
            config = _serve_config(config, fleet=args.command == "engine")
        if config.run.world_size > 1 and not distributed.launched_size() and not serve_only:
            trainer = resolve_trainer(config.trainer.kind)(config)
            distributed.check_supported(trainer, config, config.run.world_size)
            device.resolve(config.run.device)  # refused before any rank starts
            return launch.launch(args.config, args.overrides, config)
        if distributed.launched_size() > 1:
            return _rank_main(config, serve_only)
        trainer = resolve_trainer(config.trainer.kind)(config)
        return _leave(anyio.run(_train, trainer, config, serve_only, backend=config.run.backend))
    except UsageError as exc:
        print(f"corun: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the run's own handler was installed
        return _SIGNAL_EXIT["SIGINT"]


def _bench(argv: list[str]) -> int:
    """``corun bench ARGS``: the module the ``corun.bench`` entry point names (the
    benchmarks package's suite.py) parses them and runs its suites."""
    found = entry_points(group=BENCH_ENTRY_POINTS, name="suites")
    if not found:
        print("corun: error: no benchmark suites installed (entry point group "
              f"{BENCH_ENTRY_POINTS!r}); reinstall corun", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    suites = next(iter(found)).load()
    parser = _Parser(prog="corun bench", description=BENCH_TEXT)
    suites.add_arguments(parser)
    return int(suites.run(parser.parse_args(argv)))


def _check_config(config: str) -> None:
    """A bare name that is neither a file nor a recipe: one line naming the recipes."""
    if not Path(config).suffix and is_name(config) and not locate(config).exists():
        raise UsageError(f"{config}: no such config file or recipe (recipes: "
                         f"{', '.join(names())})")  # fmt: skip


def _recipes(action: str | None, name: str, dest: str) -> int:
    """``corun recipes``: each recipe and its summary; ``corun recipes copy NAME [DEST]``:
    the recipe as a file of one's own (never over an existing one)."""
    if action is None:
        width = max(map(len, names()))
        print("\n".join(f"{recipe:<{width}}  {summary(recipe)}" for recipe in names()))
        return EXIT_OK
    recipe = shipped(name)
    if recipe is None:
        raise UsageError(f"{name}: no such recipe (recipes: {', '.join(names())})")
    target = Path(dest) / recipe.name if Path(dest).is_dir() else Path(dest)
    if target.exists():
        raise UsageError(f"{target}: exists already; copy {recipe.stem} elsewhere or remove it")
    shutil.copyfile(recipe, target)
    print(f"corun: copied recipe {recipe.stem} to {target} (corun train {target})")
    return EXIT_OK


def _rank_main(config: Config, serve_only: bool) -> int:
    """One torchrun rank: join the group, train (rank 0 owning the run directory), leave."""
    world = distributed.init(config.run.collective_timeout_s, config.run.device)
    scratch: Path | None = None
    code = EXIT_ERROR
    try:
        trainer = resolve_trainer(config.trainer.kind)(config)
        distributed.check_supported(trainer, config, world.size)
        distributed.check_shared(config.run_dir)  # across nodes: one filesystem
        distributed.follow_stops()  # across nodes: a signal to one node stops all
        distributed.share_run_dir(config.run_dir)  # where every rank writes its shards
        if not world.writes:
            scratch = _scratch_dir(world.rank)
            config = _rank_config(config, scratch)
            trainer = resolve_trainer(config.trainer.kind)(config)
        code = anyio.run(_train, trainer, config, serve_only, backend=config.run.backend)
    except UsageError as exc:
        print(f"corun: error: rank {world.rank}: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    finally:
        distributed.finish(clean=code == EXIT_OK)
        if scratch is not None and not os.environ.get("CORUN_RANK_DIR"):
            shutil.rmtree(scratch, ignore_errors=True)
        flush_output()
        os._exit(code)


def _scratch_dir(rank: int) -> Path:
    root = os.environ.get("CORUN_RANK_DIR")
    if not root:
        return Path(tempfile.mkdtemp(prefix=f"corun-rank{rank}-"))
    path = Path(root) / f"rank-{rank}"
    shutil.rmtree(path, ignore_errors=True)
    return path


def _rank_config(config: Config, scratch: Path) -> Config:
    """A rank other than 0: its records in ``scratch``, resuming from the checkpoint
    rank 0 resumes from, no progress display and no wandb."""
    resume = checkpoint.resume_point(config)
    replace = msgspec.structs.replace
    return replace(
        config,
        run=replace(config.run, dir=str(scratch)),
        checkpoint=replace(config.checkpoint, resume=str(resume) if resume else False),
        log=replace(config.log, progress="off", wandb="disabled"),
    )


def _raise_on_signals() -> None:
    """SIGINT as KeyboardInterrupt, SIGTERM as SystemExit(143) (an ignored one stays so)."""
    for sig, handler in (
        (signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _terminate)
    ):  # fmt: skip
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(_SIGNAL_EXIT["SIGTERM"])


def _serve_config(config: Config, fleet: bool = False) -> Config:
    """``corun serve``'s config: the endpoint on, the run's latest checkpoint (if any)
    restored, records in ``<run dir>/serve``. ``fleet`` (``corun engine serve``): the
    rollout engine instead, records in ``<run dir>/engine-<pid>`` (several servers of
    one config may run on one machine)."""
    latest = checkpoint.latest(config.run_dir)
    replace = msgspec.structs.replace
    records = f"engine-{os.getpid()}" if fleet else "serve"
    return replace(
        config,
        run=replace(config.run, dir=str(config.run_dir / records)),
        checkpoint=replace(config.checkpoint, resume=str(latest) if latest else False),
        serve=replace(config.serve, enabled=True, fleet=fleet),
        log=replace(config.log, progress="off"),  # no steps to show
    )


async def _train(trainer: Trainer[Any], config: Config, serve_only: bool = False) -> int:
    session = Session(serve_only=serve_only)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch_signals, session.control, config)
        if serve_only:
            tg.start_soon(_announce, session)
        try:
            outcome = await run(trainer, config, session=session)
            code = _exit_code(outcome)
        except UsageError as exc:
            print(f"corun: error: {exc}", file=sys.stderr)
            code = EXIT_USAGE
        except (
            EngineError, distributed.CollectiveError, checkpoint.WriteError, DeadlineError
        ) as exc:  # fmt: skip
            print(f"corun: error: {exc}", file=sys.stderr)
            code = EXIT_ERROR
        except Exception as exc:  # the trainer's own: its traceback, then one line
            traceback.print_exc()
            print(f"corun: error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
            code = EXIT_ERROR
        finally:
            tg.cancel_scope.cancel()
    return code


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500]


def _leave(code: int) -> int:
    """``code``, or ``os._exit(code)`` when a thread is stuck in a call that was given up
    on (a deadline's, a teardown step's, an environment's): the interpreter would wait
    for it at exit forever, or abort in a daemon thread inside torch."""
    main = threading.main_thread()
    others = [t for t in threading.enumerate() if t is not main and not t.daemon]
    until = time.monotonic() + 2.0  # worker threads that are ending: give them a moment
    for thread in others:
        thread.join(max(0.0, until - time.monotonic()))
    if compute.abandoned_threads() or any(t.is_alive() for t in others):
        flush_output()
        os._exit(code)
    return code


async def _announce(session: Session) -> None:
    await session.wait_ready()
    if session.endpoint_url:
        print(f"corun: serving {session.endpoint_url}", flush=True)


def _exit_code(outcome: Outcome) -> int:
    if outcome.reason == "interrupted":
        return _SIGNAL_EXIT.get(outcome.signal or "SIGINT", 130)
    return EXIT_OK if outcome.reason == "done" else EXIT_ERROR


async def _watch_signals(control: RunControl, config: Config) -> None:
    # A torchrun rank may get one stop several times at once: a batch system (Slurm's
    # scancel --signal, its --signal before the time limit) signals every process of the
    # job, and the launcher and torchrun's agent pass the same signal on. Within
    # REPEAT_S of the last one counted, a signal counts as that one.
    repeats_s = REPEAT_S if distributed.launched_size() else 0.0
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        received, counted = 0, -math.inf
        async for signum in signals:
            if time.monotonic() - counted < repeats_s:
                continue
            counted = time.monotonic()
            received += 1
            name = signal.Signals(signum).name
            code = _SIGNAL_EXIT[name]
            if received == 1:
                print(f"corun: {name}: stopping; again to skip saving", file=sys.stderr)
                distributed.announce_stop(signum)  # the other nodes' ranks, if any
                _arm_hard_deadline(config, code)
                control.stop("interrupted", signal=name)
            elif received == 2:
                print(f"corun: {name}: skipping optional teardown steps", file=sys.stderr)
                control.stop("interrupted", signal=name)
            else:
                _hard_exit(config, code, "third signal")


def _arm_hard_deadline(config: Config, code: int) -> None:
    timer = threading.Timer(config.run.hard_deadline_s, _hard_exit, (config, code, "hard deadline"))
    timer.daemon = True
    timer.start()


def _hard_exit(config: Config, code: int, why: str) -> None:
    """End the process now: kill child process groups, record it, exit."""
    print(f"corun: {why}: exiting now", file=sys.stderr)
    procs.kill_all()
    if (config.run_dir / EVENTS_FILE).exists():
        log = EventLog(config.run_dir)
        log.emit("end", -1, reason="killed", why=why)
        log.close()
    os._exit(code)
