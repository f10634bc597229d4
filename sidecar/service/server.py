"""The gRPC side: Envoy's ExternalProcessor service and the standard health service.

Each ext_proc stream is one HTTP request; a fresh sans-IO processor handles it; when the stream
ends, the request gets its line in the request log and its span. Lifecycle: start -> SERVING;
SIGTERM (or Admin Drain) -> NOT_SERVING (Envoy's health check stops new streams), wait
drain_delay_s, refuse new streams, give open ones grace_s, exit. SIGHUP reloads the settings.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from typing import Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.extproc import codec
from sidecar.observability import logs, metrics
from sidecar.service import reload
from sidecar.observability.access_log import FLUSH_S, AccessLog
from sidecar.service.admin import AdminService, DrainStarted, admin_parts
from sidecar.service.app import App, build
from sidecar.config import SidecarConfig
from sidecar.deadlines import EXTEND_AFTER_S, EXTENDED_MESSAGE_TIMEOUT_S
from sidecar.extproc.events import Decide, ProtocolError, RequestHeaders, ResponseBody, ResponseHeaders, SkipResponse
from sidecar.observability.logs import Throttle
from sidecar.extproc.processor import RequestProcessor
from sidecar.protos import admin_pb2_grpc
from sidecar.service.reload import Reloader
from sidecar.pipeline import Exchange, Pipeline
from sidecar.pipeline.route_stage import RouteStage
from sidecar.observability.tracing import RequestTrace, Tracing, trace_id_of

log = logging.getLogger("sluice.server")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"




async def _done_within(task: asyncio.Future, seconds: float) -> bool:
    await asyncio.sleep(0)          # many waits end in their first step: no timer needed
    if task.done():
        return True
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return bool(done)


# One bug tripped by every request of a flood must not write a traceback for each.
_internal_error_log = Throttle()


def _internal_error(event) -> None:
    """Count a failed message; log it with its traceback at most once a minute (call in an
    exception handler)."""
    phase = type(event).__name__ if event is not None else "stream"
    metrics.child(metrics.INTERNAL_ERRORS, phase).inc()
    if _internal_error_log.due():
        log.exception("ext_proc %s failed (a bug; further failures within a minute are only "
                      "counted in sluice_internal_errors_total)", phase)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, pipeline: Pipeline, new_processor: Callable[..., object] = RequestProcessor,
                 access_log: AccessLog | None = None, tracing: Tracing | None = None,
                 refuse_on_error: bool = True):
        """refuse_on_error: a request whose handling raises before it is decided gets a 500
        (SidecarConfig.on_internal_error "refuse"), else it goes on undecided ("continue")."""
        self._pipeline = pipeline
        self._refuse_on_error = refuse_on_error
        self._new_processor = new_processor
        self._access_log = access_log
        self._tracing = tracing

    async def Process(self, request_iterator, context):
        processor = self._new_processor()
        ctx = processor.context
        exchange = self._pipeline.exchange(ctx)
        trace: RequestTrace | None = None
        decision: asyncio.Future | None = None
        metrics.OPEN_STREAMS.inc()
        try:
            async for request in request_iterator:
                started = time.perf_counter()
                event = codec.decode(request)
                if event is None:
                    continue
                try:
                    reply = processor.handle(event)
                    if isinstance(reply, Decide):
                        if self._tracing is not None:
                            trace = self._tracing.begin(ctx, parse_s=time.perf_counter() - started)
                        plan = self._decide_now(exchange, trace)
                        if plan is None:
                            decision = self._start_decision(exchange, trace)
                            try:
                                if not await _done_within(decision, EXTEND_AFTER_S):
                                    # Queued or waiting for a twin's answer: keep Envoy from timing
                                    # the message out (and failing open past the gate).
                                    yield codec.extend_message_timeout(EXTENDED_MESSAGE_TIMEOUT_S)
                                plan = await decision
                            finally:
                                decision.cancel()      # the client went away: leave queues at once
                        # The upstream request carries a traceparent (kept or new).
                        reply = processor.apply(trace.plan(plan) if trace is not None else plan)
                    elif isinstance(event, RequestHeaders):
                        if processor.awaits_body and not exchange.reads_response():
                            reply = processor.apply(SkipResponse())
                    elif isinstance(event, ResponseHeaders):
                        exchange.on_response_headers()
                    elif isinstance(event, ResponseBody):
                        reply = exchange.on_response_body(event.body, event.end_of_stream, reply)
                    response = codec.encode(reply)
                except ProtocolError:
                    raise
                except Exception:
                    # A bug: this request is refused or let go as configured, and the stream
                    # ends cleanly. Left to Envoy's failure_mode_allow, a fail-open Envoy would
                    # send it upstream past admission and limits, and a client who found the
                    # bug could repeat it at will (each with a traceback in the log).
                    response = codec.encode(processor.fail(event, self._refuse_on_error))
                    _internal_error(event)
                metrics.message_timer(type(event)).observe(time.perf_counter() - started)
                yield response
                if processor.finished:
                    # An immediate reply or the answer's last byte: Envoy sends nothing more,
                    # so end the stream now instead of waiting for its half-close (a wake-up
                    # and a read fewer; Envoy takes a server's OK as a clean end).
                    return
        except ProtocolError as exc:
            metrics.PROTOCOL_ERRORS.inc()
            log.error("ext_proc protocol error: %s", exc)
        except Exception:
            # A bug outside a message's handling (decoding it): the stream fails and Envoy
            # applies failure_mode_allow. Counted, and logged at most once a minute.
            _internal_error(None)
            raise
        finally:
            # Runs on normal end, client disconnect (cancellation) and errors alike.
            metrics.OPEN_STREAMS.dec()
            if decision is not None and not decision.done():
                # Cancelled, but not unwound yet; and on Python 3.11 a wait_for inside it may
                # swallow the cancellation and let it run on (to take a lease, a queue slot):
                # finish the request once it has, so on_finish releases what it took.
                decision.add_done_callback(lambda _: self._finish(exchange, trace))
            else:
                self._finish(exchange, trace)

    def _finish(self, exchange: Exchange, trace: RequestTrace | None) -> None:
        """The pipeline's end of the request, its count, its span and its log line."""
        ctx = exchange.ctx
        try:
            exchange.finish()
        except Exception:       # a bug there must not cost the request its metrics and log line
            log.exception("exchange.finish failed")
        if ctx.outcome is not None:
            metrics.count_request(ctx.route_name, ctx.cluster or "", ctx.outcome.value, ctx.status, ctx.response_read)
        self._record(exchange, trace)

    @staticmethod
    def _decide_now(exchange: Exchange, trace: RequestTrace | None):
        """Most decisions need no waiting and no task; a recorded span needs the task path (its
        stages' spans attach through the task's context)."""
        if trace is not None and trace.recording:
            return None
        return exchange.decide_now()

    @staticmethod
    def _start_decision(exchange: Exchange, trace: RequestTrace | None) -> asyncio.Future:
        if trace is not None:
            return trace.start(exchange.decide())
        return asyncio.ensure_future(exchange.decide())

    def _record(self, exchange: Exchange, trace: RequestTrace | None) -> None:
        """The request's span and its line in the request log; never fails the stream."""
        ctx = exchange.ctx
        try:
            if trace is not None:
                trace.finish(ctx)
            if self._access_log is not None and self._access_log.wanted:
                self._access_log.emit(ctx, trace.trace_id if trace is not None else trace_id_of(ctx.headers),
                                      exchange.sent_at)
        except Exception:
            log.exception("request log or span failed")


class Sidecar:
    """The gRPC server: ext_proc, health and, when given, the Admin service, on one port."""

    def __init__(self, config: SidecarConfig, pipeline: Pipeline | None = None,
                 new_processor: Callable[..., object] = RequestProcessor, *,
                 access_log: AccessLog | None = None, tracing: Tracing | None = None, admin=None):
        self.config = config
        self.health = health_async.HealthServicer()
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(pipeline or Pipeline(RouteStage()), new_processor, access_log, tracing,
                              refuse_on_error=config.on_internal_error == "refuse"), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if admin is not None:
            admin_pb2_grpc.add_AdminServicer_to_server(admin, self.server)
        self.port = self.server.add_insecure_port(config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen}")

    async def start(self, serving: bool = True) -> None:
        """Listen; with serving=False the health service says NOT_SERVING until set_serving."""
        await self.server.start()
        await self.set_serving(serving)
        log.info("sluice sidecar listening for ext_proc on %s", self.config.listen)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", EXT_PROC_SERVICE):
            await self.health.set(service, status)

    async def stop(self, hurry: asyncio.Event | None = None) -> None:
        """NOT_SERVING for drain_delay_s, then grace_s for open streams; both end early once
        `hurry` is set (a second signal): open streams are then cancelled."""
        log.info("draining: NOT_SERVING for %.1fs, then %.1fs grace for open streams",
                 self.config.drain_delay_s, self.config.grace_s)
        hurry = hurry or asyncio.Event()
        await self.set_serving(False)
        await _until(hurry, asyncio.sleep(self.config.drain_delay_s))
        if not await _until(hurry, self.server.stop(self.config.grace_s)):
            await self.server.stop(0)         # gRPC shortens a pending stop to the new grace
        log.info("sidecar stopped")


async def _until(event: asyncio.Event, work) -> bool:
    """Await `work` unless `event` is set first; False if the event cut it short (`work` then
    goes on in its task)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        return False
    task.result()                             # its error, if any, is the caller's
    return True


async def serve(config: SidecarConfig, app: App | None = None,
                new_processor: Callable[..., object] = RequestProcessor,
                load_config: Callable[[], SidecarConfig] | None = None) -> None:
    """Run until SIGTERM or SIGINT (or an Admin Drain); a second signal cuts the drain short
    and cancels open streams, and the sidecar still closes cleanly (request log flushed). Envoy
    sees NOT_SERVING until the heavy parts (the embedding model) are loaded and warm. SIGHUP
    reloads the settings with `load_config` (sidecar/service/reload.py)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    access_log = AccessLog(config.access_log, config.log_prompts)
    app = app or build(config)
    tracing = Tracing.from_config(config)

    def drain() -> DrainStarted:
        started = DrainStarted(sidecar.config.drain_delay_s, sidecar.config.grace_s, stopping.is_set())
        stopping.set()
        return started

    scheduler, store = admin_parts(app)
    admin = AdminService(scheduler, store, drain, allow_remote=config.admin_remote,
                         report_false_hit=app.pipeline.report_false_hit, feed=access_log.feed)
    sidecar = Sidecar(config, app.pipeline, new_processor, access_log=access_log, tracing=tracing, admin=admin)

    def apply(new: SidecarConfig) -> None:
        logs.set_level(new.log_level)
        access_log.enabled, access_log.log_prompts = new.access_log, new.log_prompts
        sidecar.config = new
        app.pipeline.reload()                     # the guard re-reads its word files

    reloader = Reloader(config, load_config or reload.load_config, apply)
    loop.add_signal_handler(signal.SIGHUP, reloader.reload)
    await sidecar.start(serving=False)
    try:
        await app.start()
    except BaseException:
        await sidecar.service.server.stop(0)
        raise
    # What start-up made (modules, the model's session, route tables) lives as long as the
    # process: out of the cyclic collector's reach, a full collection scans only what requests
    # made since (~10% of the per-request CPU at 16 concurrent streams, measured with callgrind).
    gc.collect()
    gc.freeze()
    await sidecar.set_serving(True)
    log.info("sluice sidecar serving")
    watcher = (asyncio.create_task(reloader.watch(config.config_file, config.config_watch_s))
               if config.config_file and config.config_watch_s else None)
    flusher = asyncio.create_task(_flush_every(access_log, FLUSH_S))
    signalled = False
    hurry = asyncio.Event()

    def on_signal() -> None:
        nonlocal signalled
        if signalled and not hurry.is_set():
            log.warning("second signal: stopping now, open streams cancelled")
            hurry.set()
        signalled = True
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stopping.wait()
    access_log.feed.close()             # tails end: they would hold the drain to its grace
    if watcher is not None:
        watcher.cancel()
    await sidecar.stop(hurry)           # the flusher runs on: a drain can last grace_s and more
    flusher.cancel()
    await app.close()
    tracing.close()
    access_log.flush()


async def _flush_every(access_log: AccessLog, seconds: float) -> None:
    """A quiet sidecar's last request lines reach stdout within `seconds` too."""
    while True:
        await asyncio.sleep(seconds)
        access_log.flush()
