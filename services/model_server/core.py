"""Model execution: ONNX Runtime sessions for each loaded model version.

ONNX Runtime releases the GIL while it runs, so each version runs in its own
single-thread executor: the event loop stays free and batches for one session
do not fight over the cores that its intra-op pool already uses.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import heapq
import itertools
import logging
import pathlib
import time

import numpy as np
import onnxruntime as ort

from services.common import errors
from services.common.tensors import NUMPY_DTYPES, TensorData, from_numpy, to_numpy
from services.model_server import metrics
from services.model_server.repository import ModelConfig, scan

log = logging.getLogger(__name__)


def has_nvidia_gpu() -> bool:
    return pathlib.Path("/proc/driver/nvidia/version").exists()


def choose_providers(device: str) -> list[str]:
    """CUDA when asked for or when a GPU is present and ORT can use it; CPU always as fallback."""
    available = ort.get_available_providers()
    wants_cuda = device == "cuda" or (device == "auto" and has_nvidia_gpu())
    if wants_cuda and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        raise RuntimeError(f"device=cuda but ONNX Runtime offers only {available}")
    return ["CPUExecutionProvider"]


class PriorityGate:
    """One batch at a time on a session; batches waiting for it go highest
    priority first, FIFO within a priority. (The executor alone would be FIFO:
    a VIP batch would wait behind every standard batch already sent.)"""

    def __init__(self):
        self._busy = False
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()

    @contextlib.asynccontextmanager
    async def turn(self, priority: int):
        if self._busy or self._waiting:
            future = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (-priority, next(self._order), future))
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._pass_on()  # it was our turn: hand it on
                raise
        self._busy = True
        try:
            yield
        finally:
            self._pass_on()

    def _pass_on(self) -> None:
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)
                return
        self._busy = False


@dataclasses.dataclass
class LoadedVersion:
    """One version of one model, ready to run batches."""

    config: ModelConfig
    version: str
    session: ort.InferenceSession
    tokenizer: object | None
    executor: concurrent.futures.ThreadPoolExecutor
    gate: PriorityGate = dataclasses.field(default_factory=PriorityGate)

    def run(self, inputs: dict[str, TensorData], outputs: list[str]) -> list[TensorData]:
        """Runs one batch synchronously (call it in the executor)."""
        feeds = self._feeds(inputs)
        wanted = outputs or [spec.name for spec in self.config.outputs]
        graph_names = [self.config.graph_outputs.get(name, name) for name in wanted]
        results = self.session.run(graph_names, feeds)
        specs = {spec.name: spec for spec in self.config.outputs}
        return [from_numpy(name, np.asarray(value), specs[name].datatype) for name, value in zip(wanted, results)]

    def _feeds(self, inputs: dict[str, TensorData]) -> dict[str, np.ndarray]:
        if self.tokenizer is None:
            return {name: to_numpy(tensor) for name, tensor in inputs.items()}
        (text,) = inputs.values()
        texts = []
        for i, item in enumerate(to_numpy(text).reshape(-1)):
            try:
                texts.append(item.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise errors.InvalidArgument(
                    f"input '{text.name}' element {i} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        metrics.PADDING.labels(self.config.name).observe(1.0 - mask.sum() / max(mask.size, 1))
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


class ModelManager:
    """Loads every model of a repository and executes batches on it."""

    def __init__(self, repository: str, device: str, threads: int):
        self._repository = pathlib.Path(repository)
        self._providers = choose_providers(device)
        self._threads = threads
        self._models: dict[str, dict[str, LoadedVersion]] = {}
        self._configs: dict[str, ModelConfig] = {}

    @property
    def providers(self) -> list[str]:
        return self._providers

    def load_all(self) -> None:
        """Loads the newest version of every model and warms it up."""
        for config in scan(self._repository):
            versions = config.versions()
            if not versions:
                log.warning("model %s has no version folder with a model.onnx; skipped", config.name)
                continue
            self._configs[config.name] = config
            self._models[config.name] = {versions[0]: self._load(config, versions[0])}

    def _load(self, config: ModelConfig, version: str) -> LoadedVersion:
        started = time.perf_counter()
        folder = config.path / version
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._threads
        options.inter_op_num_threads = 1
        # Other services share these cores; spinning threads would steal them.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=self._providers)
        tokenizer = None
        if config.preprocess is not None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(folder / config.preprocess.tokenizer_file))
            tokenizer.enable_truncation(max_length=config.preprocess.max_length)
            tokenizer.enable_padding()  # to the longest text of the batch
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ort-{config.name}")
        loaded = LoadedVersion(config, version, session, tokenizer, executor)
        loaded.run(_warmup_inputs(config), [])
        log.info(
            "loaded %s version %s on %s in %.2fs",
            config.name, version, session.get_providers()[0], time.perf_counter() - started,
        )
        return loaded

    def models(self) -> list[tuple[ModelConfig, list[str]]]:
        return [(self._configs[name], list(versions)) for name, versions in sorted(self._models.items())]

    def resolve(self, model: str, version: str) -> LoadedVersion:
        versions = self._models.get(model)
        if versions is None:
            raise errors.NotFound(f"model '{model}' is not loaded; loaded models: {sorted(self._models)}")
        if not version:
            return next(iter(versions.values()))
        if version not in versions:
            raise errors.NotFound(f"model '{model}' has no version '{version}'; loaded versions: {sorted(versions)}")
        return versions[version]

    async def execute(self, model: str, version: str, inputs: list[TensorData], outputs: list[str],
                      priority: int = 0) -> tuple[str, list[TensorData]]:
        """Runs one batch off the event loop; returns the version used and the outputs."""
        loaded = self.resolve(model, version)
        by_name = self._check_inputs(loaded.config, inputs)
        known = {spec.name for spec in loaded.config.outputs}
        unknown = [name for name in outputs if name not in known]
        if unknown:
            raise errors.InvalidArgument(f"model '{model}' has no output(s) {unknown}; outputs: {sorted(known)}")
        loop = asyncio.get_running_loop()
        try:
            async with loaded.gate.turn(priority):
                result = await loop.run_in_executor(loaded.executor, loaded.run, by_name, outputs)
        except errors.InfermeshError:
            raise
        except Exception as exc:
            log.exception("model %s version %s failed on a batch", model, loaded.version)
            raise errors.Internal(f"model '{model}' version {loaded.version} failed: {type(exc).__name__}") from exc
        return loaded.version, result

    @staticmethod
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
            if tensor.rows > config.max_batch_size:
                raise errors.InvalidArgument(
                    f"batch of {tensor.rows} rows exceeds max_batch_size {config.max_batch_size} of model '{config.name}'"
                )
        return by_name

    def close(self) -> None:
        for versions in self._models.values():
            for loaded in versions.values():
                loaded.executor.shutdown(wait=True, cancel_futures=False)


def _warmup_inputs(config: ModelConfig) -> dict[str, TensorData]:
    if config.preprocess is not None:
        text = np.array([b"warm up the model", b"a second, somewhat longer sentence to warm up padding"], dtype=object)
        return {config.inputs[0].name: from_numpy(config.inputs[0].name, text, "BYTES")}
    feeds = {}
    for spec in config.inputs:
        shape = [2 if i == 0 else (d if d > 0 else 1) for i, d in enumerate(spec.shape)]
        feeds[spec.name] = from_numpy(spec.name, np.zeros(shape, dtype=NUMPY_DTYPES[spec.datatype]), spec.datatype)
    return feeds
