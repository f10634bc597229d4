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
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    utilisation = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return GpuLoad(utilisation=utilisation, memory_used=memory.used / memory.total if memory.total else None)


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
        now = time.monotonic()
        for cluster, index in list(self._targets.items()):
            try:
                self._report(cluster, read_gpu(self._nvml, index), now)
            except Exception as exc:   # a GPU that vanished or an index out of range
                log.warning("cannot read GPU %d of cluster %s: %s", index, cluster, exc)
                self._targets.pop(cluster, None)

    async def _run(self) -> None:
        while True:
            await asyncio.to_thread(self.poll_once)
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
