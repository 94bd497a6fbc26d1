"""GPU utilisation and memory through NVML, sampled into the metrics when a GPU is present."""

import asyncio
import logging
import types

from services.model_server import metrics

log = logging.getLogger(__name__)


def _nvml() -> types.ModuleType | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver, no library: nothing to sample
        log.info("NVML unavailable, no GPU metrics: %s", exc)
        return None
    return pynvml


def sample(nvml: types.ModuleType) -> None:
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        metrics.GPU_UTILIZATION.labels(str(index)).set(utilization.gpu / 100.0)
        metrics.GPU_MEMORY.labels(str(index)).set(memory.used)


async def sample_forever(interval_s: float) -> None:
    """Samples every interval until cancelled; returns at once without NVML."""
    loop = asyncio.get_running_loop()
    nvml = await loop.run_in_executor(None, _nvml)
    if nvml is None:
        return
    try:
        while True:
            try:
                await loop.run_in_executor(None, sample, nvml)
            except Exception:
                log.exception("NVML sample failed")
            await asyncio.sleep(interval_s)
    finally:
        nvml.nvmlShutdown()
