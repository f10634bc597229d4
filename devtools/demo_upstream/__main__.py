"""CLI: python -m devtools.demo_upstream --port P --name NAME [options]."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any, Callable

from aiohttp import web

from .config import OPTIONS, Config
from .server import DemoUpstream


def _cli_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m devtools.demo_upstream", description="Mock OpenAI-compatible LLM server for tests and benchmarks.")
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="demo", help="sent back in the x-upstream-name header")
    parser.add_argument("--access-log", action="store_true", help="log every request to stderr")
    defaults = Config()
    for name, (convert, help_text) in OPTIONS.items():
        default = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_cli_type(convert),
            default=default,
            help=f"{help_text} (default {default})",
        )
    return parser


async def serve(args: argparse.Namespace) -> None:
    config = Config(**{name: getattr(args, name) for name in OPTIONS})
    upstream = DemoUpstream(args.name, config)
    runner_options: dict[str, Any] = {}
    if args.access_log:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    else:
        runner_options["access_log"] = None
    # handler_cancellation: a client that leaves cancels its handler, which is
    # how disconnects are counted and their batch slots freed.
    runner = web.AppRunner(upstream.app(), handler_cancellation=True, shutdown_timeout=1.0, **runner_options)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, args.host, args.port, backlog=4096)
        await site.start()
        port = runner.addresses[0][1]
        # Parents wait for this exact line to know the port is open.
        print(f"demo-upstream {args.name} listening on {args.host}:{port}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
