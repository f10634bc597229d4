"""How many texts fit in one GPU run, from the GPU's free memory (NVML).

The sidecar often shares its GPU with a model server that takes most of the memory, so
a fixed batch that fits at start can fail later. pynvml (package nvidia-ml-py) is
imported only when asked for; without it, or without a GPU, the configured maximum holds.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("sluice.embedding")

# Activation memory per token of a run, generous for MiniLM-L6 in fp16 (hidden states,
# the 1536-wide feed-forward, 12 heads of attention scores at up to 256 tokens, and the
# allocator's slack): 128 KiB. Only a fraction of free memory is planned for.
BYTES_PER_TOKEN = 128 * 1024
FREE_FRACTION = 0.5


def batch_limit_for_memory(free_bytes: int | None, tokens_per_text: int, ceiling: int) -> int:
    """Most texts of `tokens_per_text` tokens that fit in FREE_FRACTION of free memory."""
    if free_bytes is None:
        return ceiling
    fits = int(free_bytes * FREE_FRACTION) // (BYTES_PER_TOKEN * max(tokens_per_text, 1))
    return max(1, min(ceiling, fits))


class FreeMemoryProbe:
    """Free memory of one GPU through NVML; None when NVML or the GPU is not there."""

    def __init__(self, device_index: int = 0):
        self._device_index = device_index
        self._handle = None
        self._pynvml = None
        self._lock = threading.Lock()
        self._broken = False

    def __call__(self) -> int | None:
        with self._lock:
            if self._broken:
                return None
            try:
                if self._handle is None:
                    import pynvml  # optional: the gpu extra (nvidia-ml-py)

                    pynvml.nvmlInit()
                    self._pynvml = pynvml
                    self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._device_index)
                return int(self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).free)
            except Exception as exc:  # ImportError, NVMLError: fall back to the fixed maximum
                log.info("GPU free memory unknown (%s); using the fixed max batch", exc)
                self._broken = True
                return None
