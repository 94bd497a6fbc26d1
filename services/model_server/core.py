"""The model repository at run time: the model manager, over the versions of
each model (versions.py: load, verify, swap, standby, unload) and their probes
and health (health.py). It starts and stops them, follows the repository in
poll mode, and runs each batch on the version it resolves to."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable

from services.common import errors
from services.common.tensors import TensorData, bytes_elements, check_bytes_elements, check_tensor_size
from services.common.tier import Tier
from services.model_server.config import ControlMode, ManagerConfig
from services.model_server.execution import cuda_usable
from services.model_server.health import PROBE_TIER, Health, IndexEntry
from services.model_server.repository import ConfigError, ModelConfig, model_dirs, version_fingerprint
from services.model_server.versions import Model, Versions

log = logging.getLogger(__name__)

__all__ = ["PROBE_TIER", "ControlMode", "IndexEntry", "ManagerConfig", "Model", "ModelManager"]
MAX_OVERRIDES_BYTES = 64 << 10  # a load's overrides: a few config fields


class ModelManager:
    """Loads, swaps, probes and runs the models of one repository."""

    def __init__(self, config: ManagerConfig, on_readiness: Callable[[str, bool], None] | None = None):
        self._config = config
        self._use_cuda = cuda_usable(config.device)
        self._tasks: set[asyncio.Task] = set()
        self._seen: dict[str, str] = {}  # poll mode: model -> signature of its folder
        self.versions = Versions(config, self._use_cuda, self._spawn, on_readiness or (lambda model, ready: None))
        self.health = Health(self.versions, config.probe_interval_s)
        # The repository's models as the servicers see them.
        self.load, self.unload, self.resolve = self.versions.load, self.versions.unload, self.versions.resolve
        self.config_of, self.is_known = self.versions.config_of, self.versions.is_known
        self.loaded_names = self.versions.loaded_names
        self.probe_all, self.models, self.instances = self.health.probe_all, self.health.models, self.health.instances
        self.is_ready, self.all_ready, self.index = self.health.is_ready, self.health.all_ready, self.health.index

    @property
    def providers(self) -> list[str]:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"] if self._use_cuda else ["CPUExecutionProvider"]

    @property
    def control_mode(self) -> ControlMode:
        return self._config.control_mode

    async def start(self) -> None:
        """Loads the startup models (a model that fails is logged and left
        unloaded), then starts the probe and, in poll mode, the watcher."""
        names = [d.name for d in model_dirs(self._config.repository_path)]
        wanted = (
            names
            if "*" in self._config.startup_models or self._config.control_mode is not ControlMode.EXPLICIT
            else [n for n in self._config.startup_models if n in names]
        )
        missing = set(self._config.startup_models) - set(names) - {"*"}
        if missing:
            raise ConfigError(f"{self._config.repository}: no model folder for startup model(s) {sorted(missing)}")
        for name in wanted:
            try:
                await self.load(name)
            except errors.InfermeshError as exc:
                log.error("model %s not loaded at startup: %s", name, exc.message)
        if self._config.control_mode is ControlMode.POLL:
            self._seen = {name: self._signature(name) for name in names}
            self._spawn(self._poll_forever())
        if self._config.probe_interval_s > 0:
            self._spawn(self.health.probe_forever())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self.versions.retiring, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for model in self.versions.models.values():
            for loaded in model.loaded().values():
                await loop.run_in_executor(None, loaded.close)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _signature(self, name: str) -> str:
        """What poll mode compares: the config, the golden file and every version's files."""
        folder = self._config.repository_path / name
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
        names = {d.name for d in await loop.run_in_executor(None, model_dirs, self._config.repository_path)}
        for name in sorted(names | set(self._seen)):
            signature = await loop.run_in_executor(None, self._signature, name) if name in names else ""
            if signature == self._seen.get(name):
                continue
            self._seen[name] = signature
            try:
                if name not in names:
                    model = self.versions.models.get(name)
                    if model is not None and (model.serving or model.standby):
                        await self.versions.unload(name)
                else:
                    await self.versions.load(name)
            except errors.InfermeshError as exc:
                log.error("poll: model %s: %s", name, exc.message)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:
                log.exception("repository poll failed")

    async def execute(
        self,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        tier: int = Tier.STANDARD,
        timeout_s: float | None = None,
    ) -> tuple[str, list[TensorData]]:
        """Runs one batch off the event loop; returns the version used and the outputs.
        `timeout_s` is the time left before the caller's deadline (see LoadedVersion.execute)."""
        loaded = self.versions.resolve(model, version)
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
                self.versions.withdraw(model, loaded)
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
        if len(tensor.shape) != len(spec.shape) or any(
            d < 0 or s not in (-1, d) for s, d in zip(spec.shape, tensor.shape, strict=True)
        ):
            raise errors.InvalidArgument(
                f"input '{name}' of model '{config.name}' has shape {list(tensor.shape)}; "
                f"expected {list(spec.shape)} (-1: any size)"
            )
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
