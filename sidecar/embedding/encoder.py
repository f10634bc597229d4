"""Texts in, unit vectors out, on the calling thread: tokenize, plan runs, run, pool.

Blocking by design: the batcher calls it from its one worker thread, the CLI and the
benchmark directly. Not for two threads at once (the tokenizer's truncation state and
onnxruntime's thread pool are shared).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from sidecar.embedding.errors import NothingToEmbed
from sidecar.embedding.metrics import EmbedMetrics, NoMetrics
from sidecar.embedding.planning import plan_batches
from sidecar.embedding.tensors import mean_pool_normalize, pad_batch
from sidecar.embedding.tokens import encode_tail

# The graph's optional second output: token states after the first layers (scripts/model_graph.py).
STATES_OUTPUT = "token_states"


@dataclass(frozen=True, slots=True)
class WithStates:
    """A text's vector and, from the same model run, its token states [tokens, dim] float16
    (the semantic verifier's, sidecar/cache/alignment.py)."""
    vector: np.ndarray
    states: np.ndarray


Result = np.ndarray | WithStates | NothingToEmbed
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
        self.has_states = any(o.name == STATES_OUTPUT for o in session.get_outputs()[1:])
        self._wants_token_types = any(i.name == "token_type_ids" for i in session.get_inputs())
        self._pad_id = tokenizer.token_to_id("[PAD]") or 0

    def tokenize(self, text: str) -> list[int]:
        return encode_tail(self.tokenizer, text, self.max_tokens)

    def run(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """One model run over already tokenized texts: [len(token_ids), dim] float32."""
        (hidden,), mask = self._run(token_ids, [self._output])
        return mean_pool_normalize(hidden, mask)

    def run_with_states(self, token_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One model run: the vectors, and each text's token states [len(ids), dim] float16
        (the graph must have them: `has_states`)."""
        hidden, states, mask = self.run_unpooled(token_ids)
        return (mean_pool_normalize(hidden, mask),
                [states[row, :len(ids)].astype(np.float16) for row, ids in enumerate(token_ids)])

    def run_unpooled(self, token_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One model run's last hidden states and token states [texts, tokens, dim], float32,
        and its attention mask: for training and benchmarks that pool them their own ways."""
        (hidden, states), mask = self._run(token_ids, [self._output, STATES_OUTPUT])
        return hidden, states, mask

    def _run(self, token_ids: Sequence[Sequence[int]], outputs: list[str]) -> tuple[list[np.ndarray], np.ndarray]:
        input_ids, mask = pad_batch(token_ids, self._pad_id)
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if self._wants_token_types:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        started = time.perf_counter()
        fetched = self.session.run(outputs, feeds)
        self.metrics.model_run(len(token_ids), time.perf_counter() - started)
        return fetched, mask

    def encode_iter(self, texts: Sequence[str], with_states: Sequence[bool] | None = None
                    ) -> Iterator[tuple[list[int], list[Result]]]:
        """(indices into texts, their results) per model run, as each run finishes.

        Texts with nothing to embed come first, with a NothingToEmbed as their result.
        `with_states[i]`: text i's result is a WithStates (when the graph has them; else
        its vector alone, and the caller finds none).
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
        wants = with_states if with_states is not None and self.has_states else None
        for run in plan_batches(lengths, limit, self.run_overhead_tokens):
            indices = [tokenized[k][0] for k in run]
            if wants is None or not any(wants[i] for i in indices):
                yield indices, list(self.run([tokenized[k][1] for k in run]))
                continue
            vectors, states = self.run_with_states([tokenized[k][1] for k in run])
            yield indices, [WithStates(v, s) if wants[i] else v for i, v, s in zip(indices, vectors, states)]

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
