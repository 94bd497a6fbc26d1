"""The versions of each model at run time: load, verify, swap, standby, unload.

A load (at startup, by RPC, or when poll mode sees the repository change)
reads the model's config, loads each version its policy selects beside the
ones serving, warms it up and checks it against the golden probe, and only
then swaps the serving set in one assignment. Batches already running finish
on the version they started on. Versions that stop serving stay loaded as a
standby for `rollback_grace_s`, so loading them again is instant."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable

from services.common import errors
from services.model_server import metrics
from services.model_server.config import ManagerConfig
from services.model_server.execution import LoadedVersion, LoadFailed, first_line, load_version
from services.model_server.health import probe
from services.model_server.repository import (
    ConfigError,
    Golden,
    ModelConfig,
    load_config,
    load_golden,
    version_fingerprint,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Model:
    """One model's run-time state. `serving` is replaced, never mutated, so a
    reader always sees one whole serving set."""

    name: str
    config: ModelConfig | None = None
    golden: Golden | None = None
    serving: dict[str, LoadedVersion] = dataclasses.field(default_factory=dict)  # newest first
    standby: dict[str, tuple[LoadedVersion, float]] = dataclasses.field(default_factory=dict)  # until
    drifted: dict[str, str] = dataclasses.field(default_factory=dict)  # version -> why it is not ready
    last_error: str = ""
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    def ready_versions(self) -> list[str]:
        return [v for v in self.serving if v not in self.drifted]

    def loaded(self) -> dict[str, LoadedVersion]:
        """Every loaded version, serving or standby, newest first."""
        found = {**{v: lv for v, (lv, _) in self.standby.items()}, **self.serving}
        return {v: found[v] for v in sorted(found, key=int, reverse=True)}


class Versions:
    """The models of one repository and their loaded versions."""

    def __init__(
        self, config: ManagerConfig, use_cuda: bool, spawn: Callable, on_readiness: Callable[[str, bool], None]
    ):
        self._config = config
        self.repository = config.repository_path
        self._use_cuda = use_cuda
        self._spawn = spawn  # runs a coroutine as a task the manager cancels on close
        self._on_readiness = on_readiness
        self.models: dict[str, Model] = {}
        self.retiring: set[asyncio.Task] = set()  # versions closing once their running batches finish

    async def load(self, name: str, overrides: dict | None = None) -> list[str]:
        """Loads or reloads a model per its version policy and swaps the
        verified versions in; returns the versions now serving. On any failure
        nothing changes for callers and the error says what failed."""
        started = time.perf_counter()
        folder = self._config.repository_path / name
        if not name or "/" in name or name.startswith(".") or not folder.is_dir():
            raise errors.NotFound(f"model repository {self._config.repository_path} has no model folder '{name}'")
        model = self.models.setdefault(name, Model(name))
        loop = asyncio.get_running_loop()
        # Read and checked before the model's lock is taken: a load whose files
        # are slow to read (or refused) never holds up the model's other loads.
        try:
            config, golden = await loop.run_in_executor(None, self._read_config, folder, overrides)
        except ConfigError as exc:
            return self._failed(model, "config", errors.InvalidArgument(f"failed to load model '{name}': {exc}"))
        except Exception as exc:  # a case the checks missed: still this model's failure alone
            log.exception("model %s: unexpected error reading its config", name)
            return self._failed(
                model,
                "error",
                errors.FailedPrecondition(
                    f"failed to load model '{name}': reading {folder / 'config.json'} or its golden probe failed: "
                    f"{_unexpected(exc)}"
                ),
            )
        async with model.lock:
            wanted = config.versions()
            if not wanted:
                return self._failed(
                    model,
                    "config",
                    errors.InvalidArgument(
                        f"failed to load model '{name}': version policy '{config.version_policy.describe()}' selects none "
                        f"of the version folders {config.available_versions()} in {folder}"
                    ),
                )
            fresh: dict[str, LoadedVersion] = {}
            loaded_now: list[LoadedVersion] = []
            try:
                for version in wanted:
                    reusable = self._reusable(model, config, version)
                    if reusable is not None and await self._still_right(reusable, golden, config):
                        fresh[version] = reusable
                        continue
                    loaded = await loop.run_in_executor(
                        None, load_version, config, version, self._use_cuda, self._config.threads, golden
                    )
                    loaded.slice_s = self._config.slice_s
                    loaded_now.append(loaded)
                    fresh[version] = loaded
            except Exception as exc:
                for loaded in loaded_now:
                    self._retire(loaded)
                if not isinstance(exc, LoadFailed):  # a case the checks missed: still this model's failure alone
                    log.exception("model %s version %s: unexpected error while loading", name, version)
                    exc = LoadFailed("error", f"version {version} failed to load: {_unexpected(exc)}")
                return self._failed(
                    model,
                    exc.reason,
                    errors.FailedPrecondition(
                        f"failed to load model '{name}': {exc.message}; the versions serving before "
                        f"({list(model.serving) or 'none'}) keep serving"
                    ),
                )
            self._swap(model, config, golden, fresh)
        metrics.LOADS.labels(name, "ok").inc()
        metrics.SWAP_SECONDS.labels(name).observe(time.perf_counter() - started)
        log.info(
            "model %s now serves version(s) %s (%.2fs from the load request)",
            name,
            list(fresh),
            time.perf_counter() - started,
        )
        return list(fresh)

    def _read_config(self, folder: pathlib.Path, overrides: dict | None) -> tuple[ModelConfig, Golden | None]:
        config = load_config(folder, overrides)
        if config.fallback and not (self._config.repository_path / config.fallback / "config.json").is_file():
            raise ConfigError(
                f"{folder / 'config.json'}: field 'fallback' names {config.fallback!r}, "
                f"which has no folder with a config.json in {self._config.repository_path}"
            )
        return config, (load_golden(config) if config.golden_probe is not None else None)

    def _failed(self, model: Model, reason: str, error: errors.InfermeshError):
        model.last_error = error.message
        metrics.LOADS.labels(model.name, reason).inc()
        log.error("%s", error.message)
        raise error

    def _reusable(self, model: Model, config: ModelConfig, version: str) -> LoadedVersion | None:
        """A version already loaded from the same files with the same settings."""
        current = model.loaded().get(version)
        if current is None or current.broken or current.fingerprint != version_fingerprint(config.path / version):
            return None  # not loaded, lost a shard, or its files changed: load it afresh
        # Settings that change how a version is chosen or checked, not what it computes.
        with_new_policy = dataclasses.replace(
            current.config,
            version_policy=config.version_policy,
            golden_probe=config.golden_probe,
            fallback=config.fallback,
            warmup_batch_sizes=config.warmup_batch_sizes,
        )
        return current if with_new_policy == config else None

    async def _still_right(self, loaded: LoadedVersion, golden: Golden | None, config: ModelConfig) -> bool:
        """A standby or serving version is checked again before it (re)takes traffic."""
        if golden is None:
            return True
        passed, detail = await probe(loaded, golden, config)
        if not passed:
            log.warning(
                "%s version %s no longer passes its golden probe (%s); reloading it",
                config.name,
                loaded.version,
                detail,
            )
        return passed

    def _swap(self, model: Model, config: ModelConfig, golden: Golden | None, fresh: dict[str, LoadedVersion]) -> None:
        old = model.serving
        model.config, model.golden, model.last_error = config, golden, ""
        model.serving = dict(fresh)  # the one assignment that moves traffic
        model.drifted = {}
        until = time.time() + self._config.rollback_grace_s
        for version, loaded in old.items():
            if fresh.get(version) is loaded:
                continue
            if version in fresh:  # replaced in place: no rollback to identical numbering
                self._retire(loaded)
            else:
                model.standby[version] = (loaded, until)
                self._spawn(self._expire(model, version, loaded, until))
        for version, loaded in fresh.items():
            standing = model.standby.get(version)
            if standing is not None and standing[0] is loaded:
                del model.standby[version]
            elif standing is not None:  # an older copy of a version now reloaded
                del model.standby[version]
                self._retire(standing[0])
        self.publish(model)

    async def unload(self, name: str) -> None:
        """Takes the model out of service at once; batches already running finish, then it is freed."""
        model = self.models.get(name)
        if model is None or not (model.serving or model.standby):
            raise errors.NotFound(f"model '{name}' is not loaded")
        async with model.lock:
            leaving = list(model.loaded().values())
            model.serving, model.standby, model.drifted = {}, {}, {}
            model.last_error = "unloaded"
            for loaded in leaving:
                self._retire(loaded)
            self.publish(model)
        log.info("model %s unloaded; %d running batch(es) finish first", name, sum(lv.in_flight for lv in leaving))

    async def _expire(self, model: Model, version: str, loaded: LoadedVersion, until: float) -> None:
        await asyncio.sleep(self._config.rollback_grace_s)
        async with model.lock:
            standing = model.standby.get(version)
            if standing is None or standing != (loaded, until):  # reused and retired again since: a later timer's
                return
            del model.standby[version]
            self._retire(loaded)
            self.publish(model)
        log.info("model %s version %s: rollback grace over, unloaded", model.name, version)

    def _retire(self, loaded: LoadedVersion) -> None:
        async def close_when_idle():
            await loaded.wait_idle()
            await asyncio.get_running_loop().run_in_executor(None, loaded.close)

        task = asyncio.create_task(close_when_idle())
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)

    def publish(self, model: Model) -> None:
        """Metrics and health follow the model's state."""
        for gauge in (metrics.VERSIONS, metrics.MEMORY):  # drop the versions gone from this model
            for labels in list(gauge._metrics):  # noqa: SLF001 - prometheus_client keeps a metric's children private
                if labels[0] == model.name:
                    gauge.remove(*labels)
        for version, loaded in model.loaded().items():
            state = "standby" if version not in model.serving else "unready" if version in model.drifted else "serving"
            metrics.VERSIONS.labels(model.name, version, state).set(1)
            metrics.MEMORY.labels(model.name, version).set(loaded.memory_bytes)
        self._on_readiness(model.name, bool(model.ready_versions()))

    def resolve(self, name: str, version: str) -> LoadedVersion:
        """The newest ready version, or the one asked for: serving, or standby
        (so a request already routed when a swap happened still runs)."""
        model = self.models.get(name)
        if model is None or not (model.serving or model.standby):
            raise errors.NotFound(f"model {errors.shown(name)} is not loaded; loaded models: {self.loaded_names()}")
        if not version:
            ready = model.ready_versions()
            if not ready:
                raise errors.Unavailable(f"model '{name}' has no ready version: {model.drifted}")
            return model.serving[ready[0]]
        loaded = model.serving.get(version) or model.standby.get(version, (None, 0.0))[0]  # per batch: no sorting
        if loaded is None:
            raise errors.NotFound(
                f"model '{name}' has no version '{version}' loaded; loaded versions: {list(model.loaded())}"
            )
        return loaded

    def withdraw(self, name: str, loaded: LoadedVersion) -> None:
        """A version whose shard failed is not ready until a probe passes again."""
        model = self.models.get(name)
        if model is not None and model.serving.get(loaded.version) is loaded and loaded.version not in model.drifted:
            log.error("model %s version %s withdrawn from readiness: %s", name, loaded.version, loaded.broken)
            model.drifted[loaded.version] = loaded.broken
            self.publish(model)

    def config_of(self, name: str) -> ModelConfig:
        model = self.models.get(name)
        if model is None or model.config is None or not model.serving:
            raise errors.NotFound(f"model '{name}' is not loaded; loaded models: {self.loaded_names()}")
        return model.config

    def is_known(self, name: str) -> bool:
        """Whether `name` is a model of the repository this server has loaded at some time (a bounded set)."""
        return name in self.models

    def loaded_names(self) -> list[str]:
        return sorted(name for name, model in self.models.items() if model.serving)


def _unexpected(exc: Exception) -> str:
    return first_line(exc) + " (unexpected: the log has the traceback)"
