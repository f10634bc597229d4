"""Texts in, unit vectors out, on the calling thread: tokenize, plan runs, run, pool.

Blocking by design: the batcher calls it from its one worker thread, the CLI and the
benchmark directly. Not for two threads at once (the tokenizer's truncation state and
onnxruntime's thread pool are shared).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from sidecar.embedding.errors import NothingToEmbed
from sidecar.embedding.metrics import EmbedMetrics, NoMetrics
from sidecar.embedding.planning import plan_batches
from sidecar.embedding.tensors import mean_pool_normalize, pad_batch
from sidecar.embedding.tokens import encode_tail

Result = np.ndarray | NothingToEmbed
# Cost of one run in token-times until the loader measures it (about this on a CPU).
DEFAULT_RUN_OVERHEAD_TOKENS = 8.0


class Encoder:
    def __init__(self, session: ort.InferenceSession, tokenizer: Tokenizer, *, max_tokens: int,
                 max_batch: int, metrics: EmbedMetrics | None = None,
                 batch_limit: Callable[[int, int], int] | None = None):
        """batch_limit(tokens_per_text, max_batch) may lower the batch (GPU memory)."""
        self.session = session
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.metrics = metrics or NoMetrics()
        self.batch_limit = batch_limit or (lambda tokens, ceiling: ceiling)
        self.run_overhead_tokens = DEFAULT_RUN_OVERHEAD_TOKENS
        self._output = session.get_outputs()[0].name
        self._wants_token_types = any(i.name == "token_type_ids" for i in session.get_inputs())
        self._pad_id = tokenizer.token_to_id("[PAD]") or 0

    def tokenize(self, text: str) -> list[int]:
        return encode_tail(self.tokenizer, text, self.max_tokens)

    def run(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """One model run over already tokenized texts: [len(token_ids), dim] float32."""
        return mean_pool_normalize(*self.hidden_states(token_ids))

    def hidden_states(self, token_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """One model run over already tokenized texts, before pooling: the last hidden states
        [len(token_ids), longest, dim] and the attention mask [len(token_ids), longest]."""
        input_ids, mask = pad_batch(token_ids, self._pad_id)
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if self._wants_token_types:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        started = time.perf_counter()
        hidden = self.session.run([self._output], feeds)[0]
        self.metrics.model_run(len(token_ids), time.perf_counter() - started)
        return hidden, mask

    def encode_iter(self, texts: Sequence[str]) -> Iterator[tuple[list[int], list[Result]]]:
        """(indices into texts, their results) per model run, as each run finishes.

        Texts with nothing to embed come first, with a NothingToEmbed as their result.
        """
        tokenized: list[tuple[int, list[int]]] = []
        failed: list[tuple[int, NothingToEmbed]] = []
        for index, text in enumerate(texts):
            try:
                tokenized.append((index, self.tokenize(text)))
            except NothingToEmbed as exc:
                failed.append((index, exc))
        if failed:
            yield [i for i, _ in failed], [e for _, e in failed]
        if not tokenized:
            return
        lengths = [len(ids) for _, ids in tokenized]
        limit = max(1, self.batch_limit(max(lengths), self.max_batch))
        for run in plan_batches(lengths, limit, self.run_overhead_tokens):
            vectors = self.run([tokenized[k][1] for k in run])
            yield [tokenized[k][0] for k in run], list(vectors)

    def embed(self, texts: Sequence[str]) -> list[np.ndarray]:
        """All vectors in order; raises NothingToEmbed if any text has none."""
        results: list[Result | None] = [None] * len(texts)
        for indices, outcomes in self.encode_iter(texts):
            for index, outcome in zip(indices, outcomes):
                results[index] = outcome
        for outcome in results:
            if isinstance(outcome, NothingToEmbed):
                raise outcome
        return results  # type: ignore[return-value]
