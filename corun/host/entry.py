"""The ``corun`` command's first lines: signals are handled before anything heavy is
imported (torch takes seconds), so a Ctrl-C during imports ends the process quietly
with 130 instead of a traceback from inside some library's import — or a Ctrl-C that
the library swallows."""

from __future__ import annotations

from corun.host.early_signals import exit_on_signals


def main() -> int:
    exit_on_signals()
    from corun.host.cli import main as cli_main

    return cli_main()
