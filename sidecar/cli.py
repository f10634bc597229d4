"""`sluice` command: `serve` runs the sidecar; operator subcommands hang off the same parser."""
from __future__ import annotations

import argparse
import asyncio
import sys

EXIT_BAD_CONFIG = 2
EXIT_START_FAILED = 3


def _serve(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from sidecar import logs
    from sidecar.app import App
    from sidecar.config import ConfigError, SidecarConfig
    from sidecar.embedding import ModelLoadError
    from sidecar.noop import NoopProcessor
    from sidecar.processor import RequestProcessor
    from sidecar.routing import RoutingDirector
    from sidecar.server import serve

    try:
        config = SidecarConfig.from_env(listen=args.listen, metrics_listen=args.metrics_listen,
                                        log_level=args.log_level, drain_delay_s=args.drain_delay,
                                        grace_s=args.grace)
    except ConfigError as exc:
        print(f"sluice: bad configuration: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    logs.configure(config.log_level)
    try:
        if config.metrics_listen:
            host, _, port = config.metrics_listen.rpartition(":")
            start_http_server(int(port), addr=host)
        if args.noop:
            asyncio.run(serve(config, App(RoutingDirector()), new_processor=NoopProcessor))
        else:
            asyncio.run(serve(config))
    except (OSError, ModelLoadError) as exc:
        print(f"sluice: cannot start: {exc}", file=sys.stderr)
        return EXIT_START_FAILED
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the ext_proc sidecar")
    serve.add_argument("--listen", help="gRPC HOST:PORT (env SLUICE_LISTEN)")
    serve.add_argument("--metrics-listen", help="Prometheus HOST:PORT, '' to disable (env SLUICE_METRICS_LISTEN)")
    serve.add_argument("--log-level", help="DEBUG|INFO|WARNING|ERROR (env SLUICE_LOG_LEVEL)")
    serve.add_argument("--drain-delay", type=float, help="seconds NOT_SERVING before stopping (env SLUICE_DRAIN_DELAY_S)")
    serve.add_argument("--grace", type=float, help="seconds open streams get to finish (env SLUICE_GRACE_S)")
    serve.add_argument("--noop", action="store_true", help="change nothing (benchmark baseline)")
    serve.set_defaults(func=_serve)
    from sidecar.embedding.cli import add_subcommands as add_embedding_commands
    add_embedding_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
