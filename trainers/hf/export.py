"""``python -m trainers.hf.export CHECKPOINT OUT``: an hf: policy's checkpoint (a
checkpoint directory, a run directory's newest, or a run's config) as a
``save_pretrained`` directory that transformers and vLLM load."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from corun.base.errors import UsageError
from trainers.hf.state import export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.hf.export", description=__doc__)
    parser.add_argument("checkpoint", help="checkpoint directory, or the run's .toml config")
    parser.add_argument("out", type=Path, help="directory to write")
    args = parser.parse_args(argv)
    try:
        print(export(args.checkpoint, args.out))
    except UsageError as exc:
        print(f"corun: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
