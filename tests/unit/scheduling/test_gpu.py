"""GPU signals with a fake NVML (no GPU here or in CI)."""
import types

from sidecar.scheduling.gpu import GpuPoller, load_nvml, read_gpu
from sidecar.scheduling import GpuLoad


def fake_nvml(util=50, used=3, total=4):
    return types.SimpleNamespace(
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i) if i < 2 else (_ for _ in ()).throw(IndexError(i)),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=util),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=used, total=total))


def test_reads_utilisation_and_memory_as_fractions():
    assert read_gpu(fake_nvml(), 0) == GpuLoad(utilisation=0.5, memory_used=0.75)


def test_a_figure_the_gpu_cannot_give_leaves_the_other():
    def not_supported(handle):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")       # utilisation under MIG
    nvml = fake_nvml()
    nvml.nvmlDeviceGetUtilizationRates = not_supported
    assert read_gpu(nvml, 0) == GpuLoad(utilisation=None, memory_used=0.75)
    nvml.nvmlDeviceGetMemoryInfo = not_supported
    seen = []
    poller = GpuPoller(lambda cluster, load, now: seen.append(cluster), nvml=nvml)
    poller._targets = {"a": 0}
    poller.poll_once()                                      # neither figure: dropped, said once
    assert seen == [] and poller._targets == {}


def test_poller_reports_each_mapped_cluster_and_drops_missing_gpus():
    seen = []
    poller = GpuPoller(lambda cluster, load, now: seen.append((cluster, load)), nvml=fake_nvml())
    poller._targets = {"a": 0, "b": 1, "gone": 7}
    poller.poll_once()
    assert [c for c, _ in seen] == ["a", "b"]
    assert "gone" not in poller._targets


def test_no_nvml_means_no_signal():
    # On this machine (and CI) there is no GPU: the loader says so instead of raising.
    assert load_nvml() is None or hasattr(load_nvml(), "nvmlDeviceGetHandleByIndex")
    poller = GpuPoller(lambda *a: None)
    poller._nvml, poller._loaded = None, True
    assert not poller.available
    poller.ensure("a", 0)          # no task, no error
    assert poller._targets == {}
