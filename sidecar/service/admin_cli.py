"""`sluice admin clusters|purge|report-false-hit|drain|tail`: the Admin gRPC service of a running sidecar.

    sluice admin clusters [--json]          # per cluster: breaker, score, in flight, P95 TTFB, errors
    sluice admin purge --scope KEY | --all  # delete cached answers
    sluice admin report-false-hit --scope KEY --prompt TEXT   # that answer never serves TEXT again
    sluice admin drain                      # NOT_SERVING, then the graceful stop
    sluice admin tail [--route R] [--cluster C] [--outcome O] [--json]
                                            # each request's decision record, live

Each takes `--target`: the sidecar's gRPC address (default 127.0.0.1:50051, SLUICE_ADMIN_TARGET). The
service answers loopback callers only unless the sidecar runs with SLUICE_ADMIN_REMOTE=true.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_RPC_FAILED = 1
COLUMNS = ("cluster", "breaker", "score", "in_flight", "ttfb_p95", "error_rate", "requests")


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=os.environ.get("SLUICE_ADMIN_TARGET", "127.0.0.1:50051"),
                        help="the sidecar's gRPC HOST:PORT (env SLUICE_ADMIN_TARGET)")
    common.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    admin = subparsers.add_parser("admin", help="talk to a running sidecar's Admin service",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = admin.add_subparsers(dest="action", required=True)
    actions.add_parser("clusters", parents=[common], help="what the scheduler knows about each upstream cluster")
    purge = actions.add_parser("purge", parents=[common], help="delete cached answers")
    target = purge.add_mutually_exclusive_group(required=True)
    target.add_argument("--scope", help="one cache scope key (64 hex digits)")
    target.add_argument("--all", action="store_true", help="everything in the store")
    report = actions.add_parser("report-false-hit", parents=[common],
                                help="the answer the cache serves PROMPT in SCOPE is wrong: never serve it again")
    report.add_argument("--scope", required=True, help="the cache scope key (x-sluice-cache-scope)")
    report.add_argument("--prompt", required=True, help="the prompt that was served the wrong answer")
    actions.add_parser("drain", parents=[common], help="NOT_SERVING, then stop gracefully (as SIGTERM)")
    tail = actions.add_parser("tail", parents=[common], help="stream each request's decision record as it ends")
    tail.add_argument("--route", default="", help="only this route")
    tail.add_argument("--cluster", default="", help="only requests sent to this cluster")
    tail.add_argument("--outcome", default="", help="only this outcome (routed, answered, refused, ...)")
    tail.add_argument("--for", dest="for_s", type=float, default=None, help="stop after this many seconds")
    admin.set_defaults(func=run_admin)


def run_admin(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from sidecar.protos import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(args.target) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        if args.action == "tail":
            return _tail(stub, args)
        try:
            if args.action == "clusters":
                response = stub.ListClusters(admin_pb2.ListClustersRequest(), timeout=args.timeout)
            elif args.action == "purge":
                request = (admin_pb2.PurgeCacheRequest(all=True) if args.all
                           else admin_pb2.PurgeCacheRequest(scope=args.scope))
                response = stub.PurgeCache(request, timeout=args.timeout)
            elif args.action == "report-false-hit":
                response = stub.ReportFalseHit(admin_pb2.ReportFalseHitRequest(
                    scope=args.scope, prompt=args.prompt), timeout=args.timeout)
            else:
                response = stub.Drain(admin_pb2.DrainRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"sluice admin {args.action}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_RPC_FAILED
    if args.json:
        print(json.dumps(json_format.MessageToDict(response, preserving_proto_field_name=True,
                                                   always_print_fields_with_no_presence=True), indent=2))
    elif args.action == "clusters":
        print(cluster_table(response.clusters))
    elif args.action == "purge":
        print(f"deleted {response.deleted} cached answers")
    elif args.action == "report-false-hit":
        print(f"reported: the {response.tier} hit (stored prompt of {len(response.stored_prompt)} characters) "
              f"no longer serves this prompt" if response.reported else "nothing is served for this prompt: "
              "nothing reported")
    else:
        print("already draining" if response.already_draining else
              f"draining: NOT_SERVING for {response.drain_delay_s:g}s, then {response.grace_s:g}s "
              f"for open streams; the sidecar then exits")
    return 0


def _tail(stub, args: argparse.Namespace) -> int:
    import grpc

    from sidecar.protos import admin_pb2

    request = admin_pb2.TailRequest(route=args.route, cluster=args.cluster, outcome=args.outcome)
    stream = stub.Tail(request, timeout=args.for_s)
    try:
        for item in stream:
            if item.dropped:
                print(f"sluice admin tail: {item.dropped} records dropped (reading too slowly)", file=sys.stderr)
            print(item.json if args.json else summary(json.loads(item.json)), flush=True)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:      # --for ran out: done
            print(f"sluice admin tail: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_RPC_FAILED
    except KeyboardInterrupt:
        stream.cancel()
    return 0


def summary(entry: dict) -> str:
    """One readable line of a request record: what happened, then why."""
    why = entry.get("why") or {}
    parts = [entry.get("time", ""), entry.get("request_id") or "-", f"route={entry.get('route')}",
             f"outcome={entry.get('outcome')}", f"status={entry.get('status')}", f"cluster={entry.get('cluster')}"]
    cache = why.get("cache")
    if cache:
        detail = ",".join(f"{k}={v}" for k, v in cache.items() if k != "verdict")
        parts.append(f"cache={cache.get('verdict')}({detail})")
    candidates = [f"{c}:{score}" for c, score in (why.get("scores") or {}).items()]
    candidates += [f"{c}:dropped({reason})" for c, reason in (why.get("dropped") or {}).items()]
    if candidates:
        parts.append("candidates=" + ",".join(candidates))
    if why.get("picked"):
        parts.append("picked=" + ",".join(f"{k}={v}" for k, v in why["picked"].items()))
    admission = why.get("admission")
    if admission:
        parts.append("admission=" + ",".join(f"{k}={v}" for k, v in admission.items()))
    timeout = why.get("timeout")
    if timeout:
        parts.append(f"timeout={timeout['ms']}ms({timeout['from']})")
    if "prompt" in entry:
        parts.append(f"prompt={json.dumps(entry['prompt'], ensure_ascii=False)}")
    return " ".join(str(p) for p in parts)


def cluster_table(clusters) -> str:
    rows = [COLUMNS] + [(
        c.name, c.breaker,
        f"{c.score:.2f}" if c.HasField("score") else "-",
        str(c.in_flight),
        f"{c.ttfb_p95_s * 1000:.0f}ms" if c.HasField("ttfb_p95_s") else "-",
        f"{c.error_rate:.1%}" if c.HasField("error_rate") else "-",
        str(c.requests_in_window),
    ) for c in clusters]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
