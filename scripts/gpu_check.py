"""Check the embedding engine on a GPU machine: fidelity and speed of int8 (CPU) and fp16 (GPU).

For each model, through Sluice's own loader and encoder (the serving pipeline):
- fidelity: cosine of every reference text's vector to the fp32 reference
  (tests/data/embedding_reference.npy), must be >= 0.995;
- batch invariance: largest difference between a text embedded alone and in a
  mixed-length batch (fp16 kernels may pick other algorithms per shape; reported);
- speed: texts/s at batch 1, 8, 32 and 128 (texts per encoder call, which the planner
  may split into runs of similar length; paraphrase prompts when found, else the
  reference texts), each for a fixed time slice;
- on the GPU, free memory through NVML and the batch the engine would allow.

Runs in well under 5 minutes. Prints a table; --json writes the figures.

    python scripts/gpu_check.py --fp16 build/models/all-MiniLM-L6-v2-fp16.onnx [--json out.json]

Without a GPU, `--provider cpu` runs the same checks on the CPU (a dry run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sidecar.embedding.loader import LoadedModel, load  # noqa: E402
from sidecar.embedding.settings import EmbeddingSettings  # noqa: E402

BATCHES = (1, 8, 32, 128)
MIN_COSINE = 0.995
DATA = REPO / "tests" / "data"


def reference() -> tuple[list[str], np.ndarray]:
    meta = json.loads((DATA / "embedding_reference.json").read_text(encoding="utf-8"))
    return meta["texts"], np.load(DATA / "embedding_reference.npy")


def prompts(count: int) -> list[str]:
    """Paraphrase prompts as bench/embed.py reads them, else the reference texts, repeated."""
    from bench.embed import load_prompts, paraphrase_path

    path = paraphrase_path()
    texts = load_prompts(path, count) if path.is_file() else reference()[0]
    return (texts * (count // len(texts) + 1))[:count]


def fidelity(model: LoadedModel) -> dict:
    texts, expected = reference()
    alone = np.stack([model.encoder.embed([t])[0] for t in texts])
    together = np.stack(model.encoder.embed(texts))
    cosines = (alone * expected).sum(axis=1)
    return {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean()),
            "alone_vs_batch_max_abs": float(np.abs(alone - together).max())}


def speed(model: LoadedModel, texts: list[str], seconds: float) -> dict:
    result = {}
    encoder = model.encoder
    for batch in BATCHES:
        encoder.embed(texts[:batch])  # warm this shape
        done, started, offset = 0, time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            chunk = texts[offset:offset + batch]
            offset = (offset + batch) % (len(texts) - batch)
            encoder.embed(chunk)
            done += batch
        result[batch] = round(done / (time.perf_counter() - started), 1)
    return result


def check(name: str, settings: EmbeddingSettings, texts: list[str], seconds: float) -> dict:
    started = time.perf_counter()
    model = load(settings)
    row = {"model": name, "provider": model.provider, "load_s": round(time.perf_counter() - started, 2),
           "run_overhead_tokens": round(model.encoder.run_overhead_tokens, 1)}
    row.update(fidelity(model))
    row["texts_per_s"] = speed(model, texts, seconds)
    if model.provider == "CUDAExecutionProvider":
        from sidecar.embedding.gpu_memory import FreeMemoryProbe, batch_limit_for_memory

        free = FreeMemoryProbe()()
        row["gpu_free_bytes"] = free
        row["batch_limit_at_256_tokens"] = batch_limit_for_memory(free, 256, 4096)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16", type=Path, default=REPO / "build/models/all-MiniLM-L6-v2-fp16.onnx")
    parser.add_argument("--fp16-sha256", help="default: the .sha256 file beside the model")
    parser.add_argument("--provider", default="cuda", choices=("cuda", "auto", "cpu"))
    parser.add_argument("--seconds", type=float, default=3.0, help="per batch size and model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sha256 = args.fp16_sha256 or Path(str(args.fp16) + ".sha256").read_text().split()[0]
    texts = prompts(4096)
    rows = [
        check("int8 (packaged)", EmbeddingSettings(provider="cpu", intra_op_threads=0,
                                                   max_batch=max(BATCHES)), texts, args.seconds),
        check("fp16 (export_fp16)", EmbeddingSettings(model_path=str(args.fp16), model_sha256=sha256,
                                                      provider=args.provider, max_batch=max(BATCHES)),
              texts, args.seconds),
    ]
    print(f"{'model':20} {'provider':22} {'min cos':>8} {'alone/batch':>11} "
          + " ".join(f"{'b=' + str(b):>9}" for b in BATCHES) + "   (texts/s)")
    for row in rows:
        print(f"{row['model']:20} {row['provider']:22} {row['min_cosine']:8.5f} "
              f"{row['alone_vs_batch_max_abs']:11.2e} "
              + " ".join(f"{row['texts_per_s'][b]:9.0f}" for b in BATCHES))
    for row in rows:
        if "gpu_free_bytes" in row:
            print(f"GPU free memory {row['gpu_free_bytes']}; batch limit at 256 tokens "
                  f"{row['batch_limit_at_256_tokens']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    failed = [r["model"] for r in rows if r["min_cosine"] < MIN_COSINE]
    if failed:
        print(f"FAIL: min cosine below {MIN_COSINE} for {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
