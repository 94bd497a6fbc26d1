"""The model repository at run time: which versions serve, hot swaps, health.

A load (at startup, by RPC, or when poll mode sees the repository change)
reads the model's config, loads each version its policy selects beside the
ones serving, warms it up and checks it against the golden probe, and only
then swaps the serving set in one assignment. Batches already running finish
on the version they started on. Versions that stop serving stay loaded as a
standby for `rollback_grace_s`, so loading them again is instant. A periodic
probe withdraws readiness from a version whose outputs drift.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import json
import logging
import pathlib
import time
from collections.abc import Callable

from services.common import errors
from services.common.tier import Tier
from services.common.tensors import TensorData, bytes_elements, check_bytes_elements, check_tensor_size
from services.model_server import metrics
from services.model_server.execution import (LoadedVersion, LoadFailed, compare, cuda_usable, first_line,
                                             golden_feeds, load_version)
from services.model_server.repository import (ConfigError, Golden, ModelConfig, load_config, load_golden, model_dirs,
                                              version_fingerprint)

log = logging.getLogger(__name__)

PROBE_TIER = -1  # below standard traffic: a probe waits while callers' batches are waiting
# Execution is not preemptive: a golden probe run as one batch (minilm's: 12 texts,
# padded to the longest, 256 tokens) holds the instance for as long as a full batch of
# long texts, and every VIP batch would wait behind it. Run in slices of one row, any
# caller's batch that waits goes between two of them, and waits for one probe text at most.
PROBE_SLICE_ROWS = 1
MAX_OVERRIDES_BYTES = 64 << 10  # a load's overrides: a few config fields


class ControlMode(enum.Enum):
    NONE = "none"  # load everything at startup; no changes afterwards
    EXPLICIT = "explicit"  # changes by RPC only
    POLL = "poll"  # changes follow the repository on disk


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


@dataclasses.dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str  # Triton's: READY, UNAVAILABLE, UNLOADING ...
    reason: str


class ModelManager:
    """Loads, swaps, probes and runs the models of one repository."""

    def __init__(self, repository: str, device: str = "auto", threads: int = 1, *,
                 control_mode: ControlMode = ControlMode.EXPLICIT, startup_models: tuple[str, ...] = ("*",),
                 rollback_grace_s: float = 600.0, probe_interval_s: float = 30.0, poll_interval_s: float = 5.0,
                 on_readiness: Callable[[str, bool], None] | None = None, slice_s: float = 0.0):
        self._repository = pathlib.Path(repository)
        self._slice_s = slice_s
        self._use_cuda = cuda_usable(device)
        self._threads = threads
        self._mode = control_mode
        self._startup_models = startup_models
        self._grace_s = rollback_grace_s
        self._probe_interval_s = probe_interval_s
        self._poll_interval_s = poll_interval_s
        self._on_readiness = on_readiness or (lambda model, ready: None)
        self._models: dict[str, Model] = {}
        self._tasks: set[asyncio.Task] = set()
        self._retiring: set[asyncio.Task] = set()
        self._seen: dict[str, str] = {}  # poll mode: model -> signature of its folder

    @property
    def providers(self) -> list[str]:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"] if self._use_cuda else ["CPUExecutionProvider"]

    @property
    def control_mode(self) -> ControlMode:
        return self._mode

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Loads the startup models (a model that fails is logged and left
        unloaded), then starts the probe and, in poll mode, the watcher."""
        names = [d.name for d in model_dirs(self._repository)]
        wanted = names if "*" in self._startup_models or self._mode is not ControlMode.EXPLICIT else [
            n for n in self._startup_models if n in names]
        missing = set(self._startup_models) - set(names) - {"*"}
        if missing:
            raise ConfigError(f"{self._repository}: no model folder for startup model(s) {sorted(missing)}")
        for name in wanted:
            try:
                await self.load(name)
            except errors.InfermeshError as exc:
                log.error("model %s not loaded at startup: %s", name, exc.message)
        if self._mode is ControlMode.POLL:
            self._seen = {name: self._signature(name) for name in names}
            self._spawn(self._poll_forever())
        if self._probe_interval_s > 0:
            self._spawn(self._probe_forever())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._retiring, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for model in self._models.values():
            for loaded in model.loaded().values():
                await loop.run_in_executor(None, loaded.close)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ load and unload

    async def load(self, name: str, overrides: dict | None = None) -> list[str]:
        """Loads or reloads a model per its version policy and swaps the
        verified versions in; returns the versions now serving. On any failure
        nothing changes for callers and the error says what failed."""
        started = time.perf_counter()
        folder = self._repository / name
        if not name or "/" in name or name.startswith(".") or not folder.is_dir():
            raise errors.NotFound(f"model repository {self._repository} has no model folder '{name}'")
        model = self._models.setdefault(name, Model(name))
        loop = asyncio.get_running_loop()
        # Read and checked before the model's lock is taken: a load whose files
        # are slow to read (or refused) never holds up the model's other loads.
        try:
            config, golden = await loop.run_in_executor(None, self._read_config, folder, overrides)
        except ConfigError as exc:
            return self._failed(model, "config", errors.InvalidArgument(f"failed to load model '{name}': {exc}"))
        except Exception as exc:  # a case the checks missed: still this model's failure alone
            log.exception("model %s: unexpected error reading its config", name)
            return self._failed(model, "error", errors.FailedPrecondition(
                f"failed to load model '{name}': reading {folder / 'config.json'} or its golden probe failed: "
                f"{_unexpected(exc)}"))
        async with model.lock:
            wanted = config.versions()
            if not wanted:
                return self._failed(model, "config", errors.InvalidArgument(
                    f"failed to load model '{name}': version policy '{config.version_policy.describe()}' selects none "
                    f"of the version folders {config.available_versions()} in {folder}"))
            fresh: dict[str, LoadedVersion] = {}
            loaded_now: list[LoadedVersion] = []
            try:
                for version in wanted:
                    reusable = self._reusable(model, config, version)
                    if reusable is not None and await self._still_right(reusable, golden, config):
                        fresh[version] = reusable
                        continue
                    loaded = await loop.run_in_executor(
                        None, load_version, config, version, self._use_cuda, self._threads, golden)
                    loaded.slice_s = self._slice_s
                    loaded_now.append(loaded)
                    fresh[version] = loaded
            except Exception as exc:
                for loaded in loaded_now:
                    self._retire(loaded)
                if not isinstance(exc, LoadFailed):  # a case the checks missed: still this model's failure alone
                    log.exception("model %s version %s: unexpected error while loading", name, version)
                    exc = LoadFailed("error", f"version {version} failed to load: {_unexpected(exc)}")
                return self._failed(model, exc.reason, errors.FailedPrecondition(
                    f"failed to load model '{name}': {exc.message}; the versions serving before "
                    f"({list(model.serving) or 'none'}) keep serving"))
            self._swap(model, config, golden, fresh)
        metrics.LOADS.labels(name, "ok").inc()
        metrics.SWAP_SECONDS.labels(name).observe(time.perf_counter() - started)
        log.info("model %s now serves version(s) %s (%.2fs from the load request)", name, list(fresh),
                 time.perf_counter() - started)
        return list(fresh)

    def _read_config(self, folder: pathlib.Path, overrides: dict | None) -> tuple[ModelConfig, Golden | None]:
        config = load_config(folder, overrides)
        if config.fallback and not (self._repository / config.fallback / "config.json").is_file():
            raise ConfigError(f"{folder / 'config.json'}: field 'fallback' names {config.fallback!r}, "
                              f"which has no folder with a config.json in {self._repository}")
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
        ignore_policy = {"version_policy": config.version_policy, "golden_probe": config.golden_probe,
                         "fallback": config.fallback, "warmup_batch_sizes": config.warmup_batch_sizes}
        return current if dataclasses.replace(current.config, **ignore_policy) == config else None

    async def _still_right(self, loaded: LoadedVersion, golden: Golden | None, config: ModelConfig) -> bool:
        """A standby or serving version is checked again before it (re)takes traffic."""
        if golden is None:
            return True
        passed, detail = await self._probe(loaded, golden, config)
        if not passed:
            log.warning("%s version %s no longer passes its golden probe (%s); reloading it", config.name,
                        loaded.version, detail)
        return passed

    def _swap(self, model: Model, config: ModelConfig, golden: Golden | None, fresh: dict[str, LoadedVersion]) -> None:
        old = model.serving
        model.config, model.golden, model.last_error = config, golden, ""
        model.serving = dict(fresh)  # the one assignment that moves traffic
        model.drifted = {}
        until = time.time() + self._grace_s
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
        self._publish(model)

    async def unload(self, name: str) -> None:
        """Takes the model out of service at once; batches already running finish, then it is freed."""
        model = self._models.get(name)
        if model is None or not (model.serving or model.standby):
            raise errors.NotFound(f"model '{name}' is not loaded")
        async with model.lock:
            leaving = list(model.loaded().values())
            model.serving, model.standby, model.drifted = {}, {}, {}
            model.last_error = "unloaded"
            for loaded in leaving:
                self._retire(loaded)
            self._publish(model)
        log.info("model %s unloaded; %d running batch(es) finish first", name, sum(lv.in_flight for lv in leaving))

    async def _expire(self, model: Model, version: str, loaded: LoadedVersion, until: float) -> None:
        await asyncio.sleep(self._grace_s)
        async with model.lock:
            standing = model.standby.get(version)
            if standing is None or standing != (loaded, until):  # reused and retired again since: a later timer's
                return
            del model.standby[version]
            self._retire(loaded)
            self._publish(model)
        log.info("model %s version %s: rollback grace over, unloaded", model.name, version)

    def _retire(self, loaded: LoadedVersion) -> None:
        async def close_when_idle():
            await loaded.wait_idle()
            await asyncio.get_running_loop().run_in_executor(None, loaded.close)

        task = asyncio.create_task(close_when_idle())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _publish(self, model: Model) -> None:
        """Metrics and health follow the model's state."""
        for gauge in (metrics.VERSIONS, metrics.MEMORY):  # drop the versions gone from this model
            for labels in list(gauge._metrics):  # noqa: SLF001
                if labels[0] == model.name:
                    gauge.remove(*labels)
        for version, loaded in model.loaded().items():
            state = "standby" if version not in model.serving else "unready" if version in model.drifted else "serving"
            metrics.VERSIONS.labels(model.name, version, state).set(1)
            metrics.MEMORY.labels(model.name, version).set(loaded.memory_bytes)
        self._on_readiness(model.name, bool(model.ready_versions()))

    # ------------------------------------------------------------ probes and polling

    async def _probe(self, loaded: LoadedVersion, golden: Golden, config: ModelConfig) -> tuple[bool, str]:
        try:
            results = await loaded.execute(golden_feeds(config, golden), [], PROBE_TIER,
                                           slice_rows=PROBE_SLICE_ROWS)
        except Exception as exc:  # a probe that cannot even run is a failed probe
            return False, f"the probe batch failed: {type(exc).__name__}: {exc}"
        return compare(results, golden, config)

    async def probe_all(self) -> None:
        """Runs every serving version's golden probe once; drift withdraws that
        version's readiness until a later probe passes. The golden file is
        re-read, so an operator's new expectations apply without a reload."""
        for model in list(self._models.values()):
            if model.config is None or model.config.golden_probe is None or not model.serving:
                continue
            try:
                golden = await asyncio.get_running_loop().run_in_executor(None, load_golden, model.config)
            except ConfigError as exc:
                log.error("model %s: cannot read its golden probe, readiness unchanged: %s", model.name, exc)
                continue
            changed = False
            for version, loaded in list(model.serving.items()):
                passed, detail = await self._probe(loaded, golden, model.config)
                metrics.PROBES.labels(model.name, version, "pass" if passed else "fail").inc()
                if model.serving.get(version) is not loaded:
                    continue  # swapped out while probing
                if not passed and version not in model.drifted:
                    log.error("model %s version %s failed its correctness probe, readiness withdrawn: %s",
                              model.name, version, detail)
                    model.drifted[version] = f"correctness probe failed: {detail}"
                    changed = True
                elif passed and version in model.drifted:
                    loaded.broken = ""
                    log.info("model %s version %s passes its correctness probe again: ready", model.name, version)
                    del model.drifted[version]
                    changed = True
            if changed:
                self._publish(model)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                await self.probe_all()
            except Exception:
                log.exception("correctness probe round failed")

    def _signature(self, name: str) -> str:
        """What poll mode compares: the config, the golden file and every version's files."""
        folder = self._repository / name
        digest = hashlib.blake2b(digest_size=16)
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    digest.update(path.name.encode() + b"\0" + path.read_bytes())
                elif path.is_dir():
                    digest.update(f"{path.name}:{version_fingerprint(path)};".encode())
        return digest.hexdigest()

    async def poll_once(self) -> None:
        """Poll mode: loads models that appeared or changed, unloads those removed."""
        loop = asyncio.get_running_loop()
        names = {d.name for d in await loop.run_in_executor(None, model_dirs, self._repository)}
        for name in sorted(names | set(self._seen)):
            signature = await loop.run_in_executor(None, self._signature, name) if name in names else ""
            if signature == self._seen.get(name):
                continue
            self._seen[name] = signature
            try:
                if name not in names:
                    model = self._models.get(name)
                    if model is not None and (model.serving or model.standby):
                        await self.unload(name)
                else:
                    await self.load(name)
            except errors.InfermeshError as exc:
                log.error("poll: model %s: %s", name, exc.message)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                await self.poll_once()
            except Exception:
                log.exception("repository poll failed")

    # ------------------------------------------------------------ queries

    def models(self) -> list[tuple[ModelConfig, list[str], list[str], dict[str, str]]]:
        """(config, loaded versions newest first, ready versions, version -> hash
        of its files) per model with a version loaded."""
        listed = []
        for name, model in sorted(self._models.items()):
            loaded = model.loaded()
            if loaded and model.config is not None:
                listed.append((model.config, list(loaded), model.ready_versions(),
                               {v: lv.revision for v, lv in loaded.items()}))
        return listed

    def instances(self, name: str) -> tuple[int, int, bool]:
        """(instances, reserved for VIP, whether those are lent out now) of the
        model's newest ready version, the one a request naming no version runs
        on; (0, 0, False) when none is ready."""
        model = self._models.get(name)
        ready = model.ready_versions() if model is not None else []
        if not ready:
            return 0, 0, False
        gate = model.serving[ready[0]].gate
        return gate.capacity, gate.reserved, gate.lending()

    def is_ready(self, name: str, version: str = "") -> bool:
        model = self._models.get(name)
        if model is None:
            return False
        return version in model.ready_versions() if version else bool(model.ready_versions())

    def all_ready(self) -> bool:
        """Triton's strict readiness: every loaded model has a ready version. A model
        whose load failed is loaded only if it served before (and still does), so a
        model that never served makes nobody wait for it."""
        return all(model.ready_versions() for model in self._models.values() if model.serving)

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        entries = []
        for folder in model_dirs(self._repository):
            model = self._models.get(folder.name)
            if model is None or not (model.serving or model.standby):
                reason = model.last_error if model is not None else ""
                entries.append(IndexEntry(folder.name, "", "UNAVAILABLE" if reason else "", reason))
                continue
            for version in model.serving:
                drift = model.drifted.get(version)
                entries.append(IndexEntry(folder.name, version, "UNAVAILABLE" if drift else "READY", drift or ""))
            for version, (_, until) in model.standby.items():
                entries.append(IndexEntry(folder.name, version, "UNAVAILABLE",
                                          f"standby for rollback until {time.strftime('%H:%M:%S', time.localtime(until))}"))
            if model.last_error:
                entries.append(IndexEntry(folder.name, "", "UNAVAILABLE", f"last load failed: {model.last_error}"))
        return [e for e in entries if e.state == "READY"] if ready_only else entries

    def config_of(self, name: str) -> ModelConfig:
        model = self._models.get(name)
        if model is None or model.config is None or not model.serving:
            raise errors.NotFound(f"model '{name}' is not loaded; loaded models: {self.loaded_names()}")
        return model.config

    def is_known(self, name: str) -> bool:
        """Whether `name` is a model of the repository this server has loaded at some time (a bounded set)."""
        return name in self._models

    def loaded_names(self) -> list[str]:
        return sorted(name for name, model in self._models.items() if model.serving)

    # ------------------------------------------------------------ execution

    def resolve(self, name: str, version: str) -> LoadedVersion:
        """The newest ready version, or the one asked for: serving, or standby
        (so a request already routed when a swap happened still runs)."""
        model = self._models.get(name)
        if model is None or not (model.serving or model.standby):
            raise errors.NotFound(f"model {errors.shown(name)} is not loaded; loaded models: {self.loaded_names()}")
        if not version:
            ready = model.ready_versions()
            if not ready:
                raise errors.Unavailable(f"model '{name}' has no ready version: {model.drifted}")
            return model.serving[ready[0]]
        loaded = model.serving.get(version) or model.standby.get(version, (None, 0.0))[0]  # per batch: no sorting
        if loaded is None:
            raise errors.NotFound(f"model '{name}' has no version '{version}' loaded; loaded versions: "
                                  f"{list(model.loaded())}")
        return loaded

    def _withdraw(self, name: str, loaded: LoadedVersion) -> None:
        """A version whose shard failed is not ready until a probe passes again."""
        model = self._models.get(name)
        if model is not None and model.serving.get(loaded.version) is loaded and loaded.version not in model.drifted:
            log.error("model %s version %s withdrawn from readiness: %s", name, loaded.version, loaded.broken)
            model.drifted[loaded.version] = loaded.broken
            self._publish(model)

    async def execute(self, model: str, version: str, inputs: list[TensorData], outputs: list[str],
                      tier: int = Tier.STANDARD, timeout_s: float | None = None) -> tuple[str, list[TensorData]]:
        """Runs one batch off the event loop; returns the version used and the outputs.
        `timeout_s` is the time left before the caller's deadline (see LoadedVersion.execute)."""
        loaded = self.resolve(model, version)
        by_name = _check_inputs(loaded.config, inputs)
        if bytes_elements(inputs) > INLINE_ELEMENTS:
            await asyncio.to_thread(_check_contents, loaded.config, inputs)
        else:
            _check_contents(loaded.config, inputs)
        known = {spec.name for spec in loaded.config.outputs}
        unknown = [name for name in outputs if name not in known]
        if unknown:
            raise errors.InvalidArgument(f"model '{model}' has no output(s) {unknown}; outputs: {sorted(known)}")
        try:
            result = await loaded.execute(by_name, outputs, tier, timeout_s)
        except errors.Unavailable:
            if loaded.broken:  # a shard failed on this batch
                self._withdraw(model, loaded)
            raise
        except errors.InfermeshError:
            raise
        except Exception as exc:
            log.exception("model %s version %s failed on a batch", model, loaded.version)
            raise errors.Internal(f"model '{model}' version {loaded.version} failed: {type(exc).__name__}") from exc
        return loaded.version, result


def _check_inputs(config: ModelConfig, inputs: list[TensorData]) -> dict[str, TensorData]:
    # The router validated these already; the model server checks again
    # because it is also reachable on its own.
    by_name = {t.name: t for t in inputs}
    expected = {spec.name: spec for spec in config.inputs}
    if set(by_name) != set(expected) or len(by_name) != len(inputs):
        raise errors.InvalidArgument(
            f"model '{config.name}' takes inputs {sorted(expected)}, got {[t.name for t in inputs]}"
        )
    for name, tensor in by_name.items():
        spec = expected[name]
        if tensor.datatype != spec.datatype:
            raise errors.InvalidArgument(f"input '{name}' has datatype {tensor.datatype}; expected {spec.datatype}")
        if len(tensor.shape) != len(spec.shape) or any(d < 0 or s not in (-1, d) for s, d in zip(spec.shape, tensor.shape)):
            raise errors.InvalidArgument(f"input '{name}' of model '{config.name}' has shape {list(tensor.shape)}; "
                                         f"expected {list(spec.shape)} (-1: any size)")
        if tensor.rows > config.max_batch_size:
            raise errors.InvalidArgument(
                f"batch of {tensor.rows} rows exceeds max_batch_size {config.max_batch_size} of model '{config.name}'"
            )
        check_tensor_size(tensor, f"input '{name}' of model '{config.name}'")
    return by_name


# A batch whose BYTES elements are more than this is checked in a thread, off the event loop.
INLINE_ELEMENTS = 4096


def _check_contents(config: ModelConfig, inputs: list[TensorData]) -> None:
    """Each BYTES input holds exactly its shape's elements: the walk stops there,
    and what follows on the loop (splitting a batch into slices) may walk them."""
    for tensor in inputs:
        if tensor.datatype == "BYTES":
            check_bytes_elements(tensor.data, tensor.shape, f"input '{tensor.name}' of model '{config.name}'")


def _unexpected(exc: Exception) -> str:
    return first_line(exc) + " (unexpected: the log has the traceback)"


def parse_overrides(text: str) -> dict:
    """A load's "config" parameter: a JSON object of config fields, of at most MAX_OVERRIDES_BYTES."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_OVERRIDES_BYTES:
        raise errors.InvalidArgument(f"parameter 'config' is {size} bytes; at most {MAX_OVERRIDES_BYTES} are accepted")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.InvalidArgument(f"parameter 'config' is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise errors.InvalidArgument(f"parameter 'config' must be a JSON object of config fields, got {text[:80]!r}")
    return doc
