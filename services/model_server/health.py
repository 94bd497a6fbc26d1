"""Probes and health of the loaded models: the golden probe (at load, and
periodically on every serving version: drift withdraws readiness until a
later probe passes), readiness per model and version, the repository index,
and the catalog ListModels reports."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from services.model_server import metrics
from services.model_server.execution import LoadedVersion, compare, golden_feeds
from services.model_server.repository import ConfigError, Golden, ModelConfig, load_golden, model_dirs

if TYPE_CHECKING:
    from services.model_server.versions import Versions

log = logging.getLogger(__name__)

PROBE_TIER = -1  # below standard traffic: a probe waits while callers' batches are waiting
# Execution is not preemptive: a golden probe run as one batch (minilm's: 12 texts,
# padded to the longest, 256 tokens) holds the instance for as long as a full batch of
# long texts, and every VIP batch would wait behind it. Run in slices of one row, any
# caller's batch that waits goes between two of them, and waits for one probe text at most.
PROBE_SLICE_ROWS = 1


@dataclasses.dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str  # Triton's: READY, UNAVAILABLE, UNLOADING ...
    reason: str


async def probe(loaded: LoadedVersion, golden: Golden, config: ModelConfig) -> tuple[bool, str]:
    """Runs the golden probe on a version, below every caller's tier: (passed, what differed)."""
    try:
        results = await loaded.execute(golden_feeds(config, golden), [], PROBE_TIER, slice_rows=PROBE_SLICE_ROWS)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot even run is a failed probe
        return False, f"the probe batch failed: {type(exc).__name__}: {exc}"
    return compare(results, golden, config)


class Health:
    """The correctness probe's rounds, and what readiness and the index say."""

    def __init__(self, versions: Versions, probe_interval_s: float):
        self._versions = versions
        self._interval_s = probe_interval_s

    async def probe_all(self) -> None:
        """Runs every serving version's golden probe once; drift withdraws that
        version's readiness until a later probe passes. The golden file is
        re-read, so an operator's new expectations apply without a reload."""
        for model in list(self._versions.models.values()):
            if model.config is None or model.config.golden_probe is None or not model.serving:
                continue
            try:
                golden = await asyncio.get_running_loop().run_in_executor(None, load_golden, model.config)
            except ConfigError as exc:
                log.error("model %s: cannot read its golden probe, readiness unchanged: %s", model.name, exc)
                continue
            changed = False
            for version, loaded in list(model.serving.items()):
                passed, detail = await probe(loaded, golden, model.config)
                metrics.PROBES.labels(model.name, version, "pass" if passed else "fail").inc()
                if model.serving.get(version) is not loaded:
                    continue  # swapped out while probing
                if not passed and version not in model.drifted:
                    log.error(
                        "model %s version %s failed its correctness probe, readiness withdrawn: %s",
                        model.name,
                        version,
                        detail,
                    )
                    model.drifted[version] = f"correctness probe failed: {detail}"
                    changed = True
                elif passed and version in model.drifted:
                    loaded.broken = ""
                    log.info("model %s version %s passes its correctness probe again: ready", model.name, version)
                    del model.drifted[version]
                    changed = True
            if changed:
                self._versions.publish(model)

    async def probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.probe_all()
            except Exception:
                log.exception("correctness probe round failed")

    def models(self) -> list[tuple[ModelConfig, list[str], list[str], dict[str, str]]]:
        """(config, loaded versions newest first, ready versions, version -> hash
        of its files) per model with a version loaded."""
        listed = []
        for _, model in sorted(self._versions.models.items()):
            loaded = model.loaded()
            if loaded and model.config is not None:
                listed.append(
                    (model.config, list(loaded), model.ready_versions(), {v: lv.revision for v, lv in loaded.items()})
                )
        return listed

    def instances(self, name: str) -> tuple[int, int, bool]:
        """(instances, reserved for VIP, whether those are lent out now) of the
        model's newest ready version, the one a request naming no version runs
        on; (0, 0, False) when none is ready."""
        model = self._versions.models.get(name)
        ready = model.ready_versions() if model is not None else []
        if model is None or not ready:
            return 0, 0, False
        gate = model.serving[ready[0]].gate
        return gate.capacity, gate.reserved, gate.lending()

    def is_ready(self, name: str, version: str = "") -> bool:
        model = self._versions.models.get(name)
        if model is None:
            return False
        return version in model.ready_versions() if version else bool(model.ready_versions())

    def all_ready(self) -> bool:
        """Triton's strict readiness: every loaded model has a ready version. A model
        whose load failed is loaded only if it served before (and still does), so a
        model that never served makes nobody wait for it."""
        return all(model.ready_versions() for model in self._versions.models.values() if model.serving)

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        entries = []
        for folder in model_dirs(self._versions.repository):
            model = self._versions.models.get(folder.name)
            if model is None or not (model.serving or model.standby):
                reason = model.last_error if model is not None else ""
                entries.append(IndexEntry(folder.name, "", "UNAVAILABLE" if reason else "", reason))
                continue
            for version in model.serving:
                drift = model.drifted.get(version)
                entries.append(IndexEntry(folder.name, version, "UNAVAILABLE" if drift else "READY", drift or ""))
            for version, (_, until) in model.standby.items():
                entries.append(
                    IndexEntry(
                        folder.name,
                        version,
                        "UNAVAILABLE",
                        f"standby for rollback until {time.strftime('%H:%M:%S', time.localtime(until))}",
                    )
                )
            if model.last_error:
                entries.append(IndexEntry(folder.name, "", "UNAVAILABLE", f"last load failed: {model.last_error}"))
        return [e for e in entries if e.state == "READY"] if ready_only else entries
