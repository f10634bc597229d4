"""`sluice embed` and `sluice similarity`: the serving pipeline from a shell.

Both build the engine exactly as the sidecar does (EmbeddingSettings.from_env, the
micro-batcher, normalisation, truncation), so what they print is what the cache sees.

    sluice embed < prompts.txt > vectors.jsonl   # one JSON array (or null) per line
    sluice similarity "reset my password" "how do I change my password"
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import TextIO

import numpy as np

from sidecar.config import ConfigError
from sidecar.embedding.errors import EmbeddingUnavailable, ModelLoadError
from sidecar.embedding.settings import EmbeddingSettings

EXIT_NO_VECTOR = 1
EXIT_BAD_CONFIG = 2
EXIT_LOAD_FAILED = 3
_ENV_HELP = ("settings from SLUICE_EMBED_* variables: MODEL_PATH, MODEL_SHA256, TOKENIZER_PATH, "
             "PROVIDER, INTRA_OP_THREADS, MAX_BATCH, WORKERS, MAX_WAIT_MS, MAX_QUEUE, MAX_TOKENS")


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    embed = subparsers.add_parser(
        "embed", help="embed each line of stdin; one JSON array per line on stdout",
        description="Embeds each line of standard input and writes one JSON array of floats per "
                    "line, in order; `null` (and a note on stderr) for a line with nothing to embed.",
        epilog=_ENV_HELP)
    embed.set_defaults(func=run_embed)
    similarity = subparsers.add_parser(
        "similarity", help="cosine similarity of two texts", epilog=_ENV_HELP)
    similarity.add_argument("a", help="first text")
    similarity.add_argument("b", help="second text")
    similarity.set_defaults(func=run_similarity)


def run_embed(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    return _run(lambda service: _embed_lines(service, stdin, stdout))


def run_similarity(args: argparse.Namespace, stdout: TextIO = sys.stdout) -> int:
    async def similarity(service) -> int:
        try:
            a, b = await asyncio.gather(service.embed(args.a), service.embed(args.b))
        except EmbeddingUnavailable as exc:
            print(f"sluice: {exc}", file=sys.stderr)
            return EXIT_NO_VECTOR
        print(f"{float(np.dot(a, b)):.6f}", file=stdout)
        return 0
    return _run(similarity)


def format_vector(vector: np.ndarray) -> str:
    """JSON array with each float32 written in its shortest round-trip form."""
    return "[" + ",".join(str(x) for x in vector.astype(np.float32)) + "]"


def _run(body: Callable) -> int:
    from sidecar.embedding.service import EmbeddingService  # onnxruntime only when used

    try:
        settings = EmbeddingSettings.from_env()
    except ConfigError as exc:
        print(f"sluice: bad configuration: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    async def main() -> int:
        service = EmbeddingService(settings)
        try:
            await service.warm_up()
            return await body(service)
        finally:
            await service.close()
    try:
        return asyncio.run(main())
    except ModelLoadError as exc:
        print(f"sluice: cannot load the embedding model: {exc}", file=sys.stderr)
        return EXIT_LOAD_FAILED


async def _embed_lines(service, stdin: TextIO, stdout: TextIO) -> int:
    """Reads on a thread and writes in input order, so lines are pipelined through the
    batcher and an interactive user sees each answer as soon as it is ready."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Queue = asyncio.Queue(maxsize=max(1, service.settings.max_queue // 2))

    async def read() -> None:
        number = 0
        while line := await loop.run_in_executor(None, stdin.readline):
            number += 1
            text = line[:-1] if line.endswith("\n") else line
            await pending.put((number, asyncio.ensure_future(service.embed(text))))
        await pending.put(None)

    async def write() -> None:
        while (item := await pending.get()) is not None:
            number, task = item
            try:
                stdout.write(format_vector(await task) + "\n")
            except EmbeddingUnavailable as exc:
                print(f"sluice: line {number}: {exc}", file=sys.stderr)
                stdout.write("null\n")
            stdout.flush()

    await asyncio.gather(read(), write())
    return 0
