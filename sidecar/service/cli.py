"""`sluice` command: `serve` runs the sidecar; operator subcommands hang off the same parser."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

# Before numpy loads: threaded OpenBLAS made a 10k-vector cache scan 25x slower on a busy 2-core
# box (bench/index.py); the sidecar's parallelism is its event loop and the model's own threads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

EXIT_BAD_CONFIG = 2
EXIT_START_FAILED = 3


def _serve(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from sidecar.observability import logs
    from sidecar.service.app import App
    from sidecar.config import ConfigError
    from sidecar.embedding import EmbeddingSettings, ModelLoadError
    from sidecar.service.event_loop import loop_factory
    from sidecar.extproc.noop import NoopProcessor
    from sidecar.service.reload import load_config
    from sidecar.pipeline import Pipeline
    from sidecar.pipeline.route_stage import RouteStage
    from sidecar.service.server import serve

    def load():
        """Flags win over the config file, which wins over SLUICE_* variables (also on SIGHUP)."""
        return load_config(listen=args.listen, metrics_listen=args.metrics_listen, log_level=args.log_level,
                           drain_delay_s=args.drain_delay, grace_s=args.grace, config_file=args.config_file,
                           access_log=False if args.noop else None)

    def bad_config(exc: ConfigError) -> int:
        print(f"sluice: bad configuration: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    try:
        config = load()
        new_loop, loop_name = loop_factory(config.event_loop)
        if config.cache and config.semantic and not args.noop:
            EmbeddingSettings.from_env()          # read again by the app; checked before anything starts
    except ConfigError as exc:
        return bad_config(exc)
    logs.configure(config.log_level)
    logging.getLogger("sluice.server").info("event loop: %s", loop_name)
    try:
        if config.metrics_listen:
            host, port = config.metrics_address
            start_http_server(port, addr=host)
        with asyncio.Runner(loop_factory=new_loop) as runner:
            if args.noop:
                runner.run(serve(config, App(Pipeline(RouteStage())), new_processor=NoopProcessor, load_config=load))
            else:
                runner.run(serve(config, load_config=load))
    except ConfigError as exc:      # any other setting found bad while starting: no traceback either
        return bad_config(exc)
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
    serve.add_argument("--config-file", help="KEY=VALUE file of SLUICE_* settings, re-read on SIGHUP (env SLUICE_CONFIG_FILE)")
    serve.add_argument("--noop", action="store_true", help="change nothing, log no requests (benchmark baseline)")
    serve.set_defaults(func=_serve)
    from sidecar.service.admin_cli import add_subcommands as add_admin_commands
    add_admin_commands(commands)
    from sidecar.embedding.cli import add_subcommands as add_embedding_commands
    add_embedding_commands(commands)
    from sidecar.service.cache_check import add_subcommands as add_cache_commands
    add_cache_commands(commands)
    from sidecar.guard.cli import add_subcommands as add_guard_commands
    add_guard_commands(commands)
    from sidecar.service.lint import add_subcommands as add_lint_commands
    add_lint_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
