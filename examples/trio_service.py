"""A trio web service that trains its agents' policy while it serves (corun embedded):
``python examples/trio_service.py`` from the repository root.

See examples/service.py for the API; Ctrl-C stops it.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from the repository root
from examples.service import main


async def serve_host(app: Starlette, port: int, shutdown: Callable[[], Awaitable[None]]) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    await serve(app, config, shutdown_trigger=shutdown)  # type: ignore[arg-type]


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8009
    try:
        trio.run(main, serve_host, port, "runs/example-trio")
    except KeyboardInterrupt:
        print("stopped", flush=True)
