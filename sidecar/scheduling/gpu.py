"""GPU signals for the scheduler: utilisation and memory of GPUs local to the sidecar, via NVML.

Absent GPUs are simply no signal: without the pynvml module (package nvidia-ml-py, in the `gpu`
extra) or without a driver, `GpuPoller.available` is False and nothing is polled.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from sidecar.scheduling import GpuLoad

log = logging.getLogger("sluice.gpu")


def load_nvml():
    """The initialised pynvml module, or None when there is no NVML here."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:   # ImportError, NVMLError (no driver / no GPU)
        log.info("no GPU signals: %s", exc)
        return None


def read_gpu(nvml, index: int) -> GpuLoad:
    """Utilisation and memory of one GPU; a figure it cannot give (NOT_SUPPORTED, as with MIG)
    is None, and only a GPU that gives neither raises."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    utilisation = _figure(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
    memory = _figure(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    used = memory.used / memory.total if memory is not None and memory.total else None
    if utilisation is None and used is None:
        raise RuntimeError(f"GPU {index} gives neither utilisation nor memory")
    return GpuLoad(utilisation=utilisation, memory_used=used)


def _figure(read: Callable[[], object]):
    try:
        return read()
    except Exception:   # NVMLError (NOT_SUPPORTED, ...): this figure only
        return None


class GpuPoller:
    """One task polls every GPU that a route maps a cluster to; reports (cluster, load, now)."""

    def __init__(self, report: Callable[[str, GpuLoad, float], None], interval_s: float = 2.0,
                 nvml=None, max_targets: int = 64):
        self._report, self._interval_s, self._max_targets = report, interval_s, max_targets
        self._nvml = nvml
        self._loaded = nvml is not None
        self._targets: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    @property
    def available(self) -> bool:
        if not self._loaded:
            self._nvml, self._loaded = load_nvml(), True
        return self._nvml is not None

    def ensure(self, cluster: str, index: int) -> None:
        if not self.available or self._targets.get(cluster) == index:
            return
        if len(self._targets) < self._max_targets:
            self._targets[cluster] = index
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def poll_once(self) -> None:
        self._deliver(self._read_all(dict(self._targets)))

    def _read_all(self, targets: dict[str, int]) -> list[tuple[str, int, GpuLoad | Exception]]:
        """NVML calls only (they may block): run on a worker thread."""
        readings: list[tuple[str, int, GpuLoad | Exception]] = []
        for cluster, index in targets.items():
            try:
                readings.append((cluster, index, read_gpu(self._nvml, index)))
            except Exception as exc:   # a GPU that vanished or an index out of range
                readings.append((cluster, index, exc))
        return readings

    def _deliver(self, readings: list[tuple[str, int, GpuLoad | Exception]]) -> None:
        """On the event loop: the scheduler's state is not for other threads to change."""
        now = time.monotonic()
        for cluster, index, reading in readings:
            if isinstance(reading, Exception):
                log.warning("cannot read GPU %d of cluster %s: %s", index, cluster, reading)
                if self._targets.get(cluster) == index:     # not remapped while it was read
                    self._targets.pop(cluster)
            else:
                self._report(cluster, reading, now)

    async def _run(self) -> None:
        while True:
            self._deliver(await asyncio.to_thread(self._read_all, dict(self._targets)))
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
