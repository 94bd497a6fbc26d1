"""Reads a model repository: `<repo>/<model>/config.json` and `<repo>/<model>/<version>/`.

Every malformed config is reported with the file and the field at fault. The
config may carry, besides the signature: a version policy (Triton's latest /
all / specific), instances, execution-provider preference, tensor-parallel
degree, warm-up batch sizes, a golden probe and a fallback model.
"""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import stat

import numpy as np

from services.common import errors
from services.common.config import field, typed
from services.common.tensors import DATATYPES, NUMPY_DTYPES

KNOWN_FIELDS = {
    "name",
    "platform",
    "max_batch_size",
    "inputs",
    "outputs",
    "preprocess",
    "graph_outputs",
    "version_policy",
    "instances",
    "execution",
    "tp_degree",
    "warmup",
    "golden_probe",
    "fallback",
}
PROVIDERS = ("cuda", "cpu")
MAX_THREADS = 1024  # far above any machine's cores, and within ONNX Runtime's C int
MAX_TOKENS = 32768  # above any served model's context; a text model's pad/truncate length
# Tokens one text may have before truncation: texts up to it are truncated at
# max_length, as sentence-transformers does; longer ones are refused.
DEFAULT_MAX_TEXT_TOKENS = 8192
MAX_BATCH_SIZE = 4096
MAX_TP_DEGREE = 64
MAX_GPUS = 64
MAX_WARMUP_SIZES = 8
MAX_DIM = 1 << 24  # a fixed tensor dimension
MAX_WARMUP_ELEMENTS = 1 << 24  # per input of a warm-up batch: what the server allocates to warm up
# Files a config names are read with these bounds, checked before they are opened.
MAX_CONFIG_BYTES = 1 << 20
MAX_GOLDEN_BYTES = 16 << 20
MAX_TOKENIZER_BYTES = 64 << 20
GRAPH_OPTIMIZATION = ("disable", "basic", "extended", "all")


class ConfigError(ValueError):
    """A model config that cannot be served; the message names file and field."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Preprocess:
    kind: str
    tokenizer_file: str
    max_length: int  # tokens the model sees: longer texts are truncated
    max_text_tokens: int = DEFAULT_MAX_TEXT_TOKENS  # tokens a text may have at all: longer is INVALID_ARGUMENT


@dataclasses.dataclass(frozen=True)
class VersionPolicy:
    """Which version folders to serve: the newest `latest`, `all`, or `specific` ones."""

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[str, ...] = ()

    def select(self, available: list[str]) -> list[str]:
        """The versions to serve out of the folders present, newest first."""
        ordered = sorted(available, key=int, reverse=True)
        if self.kind == "all":
            return ordered
        if self.kind == "latest":
            return ordered[: self.num_versions]
        return [v for v in ordered if v in self.versions]

    def describe(self) -> str:
        if self.kind == "latest":
            return f"latest {self.num_versions}"
        if self.kind == "all":
            return "all"
        return f"specific {list(self.versions)}"


# A reserved instance nobody uses idles its share of the cores: lent after a lull this long.
# A VIP tier sending at least one batch every 10 s keeps it reserved.
LEND_RESERVED_AFTER_S = 10.0


@dataclasses.dataclass(frozen=True)
class Instances:
    """Sessions per version; on GPUs, instance i runs on gpus[i % len(gpus)]."""

    count: int = 1
    gpus: tuple[int, ...] = (0,)
    reserved_for_vip: int = 0  # the last N instances run VIP batches only
    # ... and standard ones too once no VIP batch has come for this long (None: never)
    lend_reserved_after_s: float | None = LEND_RESERVED_AFTER_S


@dataclasses.dataclass(frozen=True)
class Execution:
    providers: tuple[str, ...] = PROVIDERS  # in order of preference
    intra_op_threads: int = 0  # 0: the machine's cores shared among instances
    inter_op_threads: int = 1
    graph_optimization: str = "all"


@dataclasses.dataclass(frozen=True)
class GoldenProbe:
    """Known inputs and expected outputs; a version passes when every output row
    is within the tolerances given (cosine to the expected row, largest
    absolute difference)."""

    file: str
    min_cosine: float | None
    max_abs: float | None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    preprocess: Preprocess | None
    graph_outputs: dict[str, str]
    path: pathlib.Path
    version_policy: VersionPolicy = VersionPolicy()
    instances: Instances = Instances()
    execution: Execution = Execution()
    tp_degree: int = 1
    warmup_batch_sizes: tuple[int, ...] = (1, 8)
    golden_probe: GoldenProbe | None = None
    fallback: str = ""

    def available_versions(self) -> list[str]:
        """Every numeric version folder, newest first (whether or not it is complete)."""
        found = [p.name for p in self.path.iterdir() if p.is_dir() and p.name.isdigit()]
        return sorted(found, key=int, reverse=True)

    def versions(self) -> list[str]:
        """The versions its policy selects, newest first."""
        return self.version_policy.select(self.available_versions())

    def tokenizer_path(self, version: str) -> pathlib.Path:
        """The version's tokenizer file, resolved; ConfigError unless it lies inside the version's folder."""
        assert self.preprocess is not None
        return confine(
            self.path / version,
            self.preprocess.tokenizer_file,
            "preprocess.tokenizer_file",
            str(self.path / "config.json"),
        )


def version_fingerprint(folder: pathlib.Path) -> str:
    """Names, sizes and modification times of a version's files: changes when
    a version is replaced in place."""
    digest = hashlib.blake2b(digest_size=16)
    if folder.is_dir():
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path.relative_to(folder)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()


def _field(doc: dict, key: str, kind, where: str):
    return field(doc, key, kind, where, ConfigError)


def _typed(value, key: str, kind, where: str):
    return typed(value, key, kind, where, ConfigError)


def _optional(doc: dict, key: str, kind, where: str, default):
    return _typed(doc[key], key, kind, where) if key in doc else default


def _known(body: dict, known: tuple[str, ...], where: str) -> None:
    """An unknown field in a config object is an error, so a typo cannot pass silently."""
    unknown = set(body) - set(known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {list(known)}")


def _number(value, key: str, where: str) -> float:
    """A JSON number as a float; an integer too large for one is refused by name
    (float() would raise OverflowError, which names nothing)."""
    value = _typed(value, key, (int, float), where)
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(
            f"{where}: field '{key}' is an integer of {value.bit_length()} bits, too large for any sensible value"
        ) from None


def _tensor_specs(doc: dict, key: str, where: str) -> tuple[TensorSpec, ...]:
    specs = []
    for i, item in enumerate(_field(doc, key, list, where)):
        at = f"{where}: {key}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{at} must be an object, got {item!r}")
        _known(item, ("name", "datatype", "shape"), at)
        name = _field(item, "name", str, at)
        datatype = _field(item, "datatype", str, at)
        if datatype not in DATATYPES:
            raise ConfigError(f"{at}: field 'datatype' is {datatype!r}; expected one of {sorted(DATATYPES)}")
        shape = _field(item, "shape", list, at)
        if (
            not shape
            or len(shape) > 8
            or any(not isinstance(d, int) or isinstance(d, bool) or d < -1 or d == 0 or d > MAX_DIM for d in shape)
        ):
            raise ConfigError(
                f"{at}: field 'shape' is {shape!r}; expected 1 to 8 sizes of 1..{MAX_DIM} or -1, batch first"
            )
        specs.append(TensorSpec(name, datatype, tuple(shape)))
    if not specs:
        raise ConfigError(f"{where}: field '{key}' is empty")
    return tuple(specs)


def _version_policy(doc: dict, where: str) -> VersionPolicy:
    if "version_policy" not in doc:
        return VersionPolicy()
    policy = _field(doc, "version_policy", dict, where)
    at = f"{where}: version_policy"
    if len(policy) != 1 or next(iter(policy)) not in ("latest", "all", "specific"):
        raise ConfigError(
            f"{at} is {policy!r}; expected one of {{'latest': {{'num_versions': N}}}}, "
            "{'all': {}}, {'specific': {'versions': [...]}}"
        )
    ((kind, body),) = policy.items()
    body = _typed(body, kind, dict, at)
    _known(body, {"latest": ("num_versions",), "all": (), "specific": ("versions",)}[kind], f"{at}.{kind}")
    if kind == "latest":
        count = _field(body, "num_versions", int, f"{at}.latest")
        if count < 1:
            raise ConfigError(f"{at}.latest: field 'num_versions' must be >= 1, got {count}")
        return VersionPolicy("latest", num_versions=count)
    if kind == "all":
        return VersionPolicy("all")
    versions = _field(body, "versions", list, f"{at}.specific")
    if not versions or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in versions):
        raise ConfigError(
            f"{at}.specific: field 'versions' is {versions!r}; expected a non-empty list of version numbers >= 1"
        )
    return VersionPolicy("specific", versions=tuple(str(v) for v in versions))


def _instances(doc: dict, where: str) -> Instances:
    body = _optional(doc, "instances", dict, where, {})
    at = f"{where}: instances"
    _known(body, ("count", "gpus", "reserved_for_vip", "lend_reserved_after_s"), at)
    count = _optional(body, "count", int, at, 1)
    if not 1 <= count <= 64:
        raise ConfigError(f"{at}: field 'count' must be 1..64, got {count}")
    gpus = _optional(body, "gpus", list, at, [0])
    if not 1 <= len(gpus) <= MAX_GPUS or any(
        not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < MAX_GPUS for g in gpus
    ):
        raise ConfigError(
            f"{at}: field 'gpus' is {_shown_list(gpus)}; expected a list of 1..{MAX_GPUS} device ids "
            f"in 0..{MAX_GPUS - 1}"
        )
    reserved = _optional(body, "reserved_for_vip", int, at, 0)
    if not 0 <= reserved < count:
        raise ConfigError(
            f"{at}: field 'reserved_for_vip' must be 0..count-1 ({count - 1}), got {reserved}: "
            "standard batches need an instance of their own"
        )
    lend_after_s = LEND_RESERVED_AFTER_S
    if "lend_reserved_after_s" in body:
        lend_after_s = body["lend_reserved_after_s"]
        if lend_after_s is not None:
            lend_after_s = _number(lend_after_s, "lend_reserved_after_s", at)
            if not math.isfinite(lend_after_s) or lend_after_s < 0:
                raise ConfigError(
                    f"{at}: field 'lend_reserved_after_s' must be a finite number of seconds >= 0, "
                    f"or null (never lend), got {lend_after_s:g}"
                )
    return Instances(count, tuple(gpus), reserved, lend_after_s)


def _execution(doc: dict, where: str) -> Execution:
    body = _optional(doc, "execution", dict, where, {})
    at = f"{where}: execution"
    _known(body, ("providers", "intra_op_threads", "inter_op_threads", "graph_optimization"), at)
    providers = _optional(body, "providers", list, at, list(PROVIDERS))
    if not providers or any(p not in PROVIDERS for p in providers) or len(set(providers)) != len(providers):
        raise ConfigError(f"{at}: field 'providers' is {providers!r}; expected a preference order of {list(PROVIDERS)}")
    intra = _optional(body, "intra_op_threads", int, at, 0)
    inter = _optional(body, "inter_op_threads", int, at, 1)
    if not 0 <= intra <= MAX_THREADS or not 1 <= inter <= MAX_THREADS:
        raise ConfigError(
            f"{at}: intra_op_threads must be 0..{MAX_THREADS} and inter_op_threads 1..{MAX_THREADS}, "
            f"got {intra} and {inter}"
        )
    level = _optional(body, "graph_optimization", str, at, "all")
    if level not in GRAPH_OPTIMIZATION:
        raise ConfigError(f"{at}: field 'graph_optimization' is {level!r}; expected one of {list(GRAPH_OPTIMIZATION)}")
    return Execution(tuple(providers), intra, inter, level)


def _golden_probe(doc: dict, where: str) -> GoldenProbe | None:
    if "golden_probe" not in doc:
        return None
    body = _field(doc, "golden_probe", dict, where)
    at = f"{where}: golden_probe"
    _known(body, ("file", "min_cosine", "max_abs"), at)
    file = _field(body, "file", str, at)
    check_file_name(file, "golden_probe.file", at)
    min_cosine = _number(body["min_cosine"], "min_cosine", at) if "min_cosine" in body else None
    max_abs = _number(body["max_abs"], "max_abs", at) if "max_abs" in body else None
    if min_cosine is None and max_abs is None:
        raise ConfigError(f"{at}: give a tolerance, 'min_cosine' and/or 'max_abs'")
    if min_cosine is not None and not -1.0 <= min_cosine <= 1.0:
        raise ConfigError(f"{at}: field 'min_cosine' must be in [-1, 1], got {min_cosine:g}")
    if max_abs is not None and not max_abs > 0:
        raise ConfigError(f"{at}: field 'max_abs' must be > 0, got {max_abs:g}")
    return GoldenProbe(file, min_cosine, max_abs)


def parse_config(doc, model_dir: pathlib.Path, where: str) -> ModelConfig:
    """Checks a config document (config.json, possibly with a load's overrides) field by field."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: must hold a JSON object")
    unknown = set(doc) - KNOWN_FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known fields: {sorted(KNOWN_FIELDS)}")
    name = _field(doc, "name", str, where)
    if name != model_dir.name:
        raise ConfigError(f"{where}: field 'name' is {name!r} but the folder is {model_dir.name!r}")
    platform = _field(doc, "platform", str, where)
    if platform != "onnxruntime_onnx":
        raise ConfigError(f"{where}: field 'platform' is {platform!r}; the only platform is 'onnxruntime_onnx'")
    max_batch_size = _field(doc, "max_batch_size", int, where)
    if not 1 <= max_batch_size <= MAX_BATCH_SIZE:
        raise ConfigError(f"{where}: field 'max_batch_size' must be 1..{MAX_BATCH_SIZE}, got {max_batch_size}")
    preprocess = None
    if "preprocess" in doc:
        pre = _field(doc, "preprocess", dict, where)
        at = f"{where}: preprocess"
        _known(pre, ("kind", "tokenizer_file", "max_length", "max_text_tokens"), at)
        kind = _field(pre, "kind", str, at)
        if kind != "text_tokenizer":
            raise ConfigError(f"{at}: field 'kind' is {kind!r}; the only kind is 'text_tokenizer'")
        max_length = _field(pre, "max_length", int, at)
        if not 2 <= max_length <= MAX_TOKENS:
            raise ConfigError(f"{at}: field 'max_length' must be 2..{MAX_TOKENS}, got {max_length}")
        tokenizer_file = _field(pre, "tokenizer_file", str, at)
        check_file_name(tokenizer_file, "preprocess.tokenizer_file", at)
        max_text_tokens = (
            _field(pre, "max_text_tokens", int, at) if "max_text_tokens" in pre else DEFAULT_MAX_TEXT_TOKENS
        )
        if not max_length <= max_text_tokens <= MAX_TOKENS:
            raise ConfigError(
                f"{at}: field 'max_text_tokens' must be {max_length} (max_length)..{MAX_TOKENS}, got {max_text_tokens}"
            )
        preprocess = Preprocess(kind, tokenizer_file, max_length, max_text_tokens)
    inputs = _tensor_specs(doc, "inputs", where)
    if preprocess is not None and (len(inputs) != 1 or inputs[0].datatype != "BYTES"):
        raise ConfigError(f"{where}: a text_tokenizer model takes exactly one BYTES input, got {inputs}")
    graph_outputs = _optional(doc, "graph_outputs", dict, where, {})
    if not all(isinstance(v, str) for v in graph_outputs.values()):
        raise ConfigError(f"{where}: field 'graph_outputs' must map output names to graph output names")
    tp_degree = _optional(doc, "tp_degree", int, where, 1)
    if not 1 <= tp_degree <= MAX_TP_DEGREE:
        raise ConfigError(f"{where}: field 'tp_degree' must be 1..{MAX_TP_DEGREE}, got {tp_degree}")
    warmup = _optional(doc, "warmup", dict, where, {})
    _known(warmup, ("batch_sizes",), f"{where}: warmup")
    sizes = _optional(warmup, "batch_sizes", list, f"{where}: warmup", [1, min(8, max_batch_size)])
    if not 1 <= len(sizes) <= MAX_WARMUP_SIZES or any(
        not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= max_batch_size for s in sizes
    ):
        raise ConfigError(
            f"{where}: warmup: field 'batch_sizes' is {_shown_list(sizes)}; expected 1 to "
            f"{MAX_WARMUP_SIZES} sizes in 1..max_batch_size ({max_batch_size})"
        )
    fallback = _optional(doc, "fallback", str, where, "")
    if fallback == name:
        raise ConfigError(f"{where}: field 'fallback' names the model itself")
    if fallback and not is_model_name(fallback):
        raise ConfigError(
            f"{where}: field 'fallback' is {errors.shown(fallback)}; name another model of the "
            "repository (a folder name)"
        )
    for spec in inputs:
        elements = max(sizes) * math.prod(d if d > 0 else 1 for d in spec.shape[1:])
        if elements > MAX_WARMUP_ELEMENTS:
            raise ConfigError(
                f"{where}: warm-up at batch {max(sizes)} of input {spec.name!r} shape {list(spec.shape)} "
                f"would allocate {elements} elements, more than {MAX_WARMUP_ELEMENTS}"
            )
    return ModelConfig(
        name=name,
        platform=platform,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=_tensor_specs(doc, "outputs", where),
        preprocess=preprocess,
        graph_outputs=graph_outputs,
        path=model_dir,
        version_policy=_version_policy(doc, where),
        instances=_instances(doc, where),
        execution=_execution(doc, where),
        tp_degree=tp_degree,
        warmup_batch_sizes=tuple(sizes),
        golden_probe=_golden_probe(doc, where),
        fallback=fallback,
    )


def read_config_document(model_dir: pathlib.Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: missing")
    return _json_object(read_bounded(path.resolve(), MAX_CONFIG_BYTES, "the model's config"), path)


def load_config(model_dir: pathlib.Path, overrides: dict | None = None) -> ModelConfig:
    """The model's config.json, with the top-level fields of overrides (a load
    request's "config" parameter) replacing the file's."""
    doc = read_config_document(model_dir)
    where = str(model_dir / "config.json")
    if overrides:
        doc = {**doc, **overrides}
        where += f" with the load's overrides {sorted(overrides)}"
    config = parse_config(doc, model_dir, where)
    if config.preprocess is not None:
        for version in config.versions():  # checked by name and kind now, read only by the load
            path = config.tokenizer_path(version)
            if path.exists():
                check_file(
                    path, MAX_TOKENIZER_BYTES, "preprocess.tokenizer_file", config.preprocess.tokenizer_file, where
                )
    return config


def model_dirs(repository: pathlib.Path) -> list[pathlib.Path]:
    if not repository.is_dir():
        raise ConfigError(f"{repository}: model repository folder not found (run 'make setup')")
    return [d for d in sorted(repository.iterdir()) if d.is_dir() and not d.name.startswith(".")]


def scan(repository: pathlib.Path) -> list[ModelConfig]:
    """Every model folder of the repository, in name order."""
    return [load_config(d) for d in model_dirs(repository)]


@dataclasses.dataclass(frozen=True)
class Golden:
    """A golden probe's known inputs and expected outputs as numpy arrays."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


def load_golden(config: ModelConfig) -> Golden:
    """Reads and checks the golden probe file against the model's signature."""
    probe = config.golden_probe
    assert probe is not None
    path = config.path / probe.file
    where = str(config.path / "config.json")
    resolved = confine(config.path, probe.file, "golden_probe.file", where)
    if not resolved.exists():
        raise ConfigError(f"{path}: golden probe file missing (named by golden_probe.file)")
    check_file(resolved, MAX_GOLDEN_BYTES, "golden_probe.file", probe.file, where)
    doc = _json_object(read_bounded(resolved, MAX_GOLDEN_BYTES, "golden_probe.file"), path)
    inputs = _golden_tensors(doc, "inputs", config.inputs, str(path))
    outputs = _golden_tensors(doc, "outputs", config.outputs, str(path))
    rows = {len(a) for a in (*inputs.values(), *outputs.values())}
    if len(rows) != 1:
        raise ConfigError(f"{path}: inputs and outputs disagree on the number of rows: {sorted(rows)}")
    if rows.pop() > config.max_batch_size:
        raise ConfigError(f"{path}: more rows than max_batch_size {config.max_batch_size}")
    return Golden(inputs, outputs)


def _golden_tensors(doc: dict, key: str, specs: tuple[TensorSpec, ...], where: str) -> dict[str, np.ndarray]:
    items = _field(doc, key, list, where)
    by_spec = {s.name: s for s in specs}
    found = {}
    for i, item in enumerate(items):
        at = f"{where}: {key}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{at} must be an object")
        name = _field(item, "name", str, at)
        spec = by_spec.get(name)
        if spec is None:
            raise ConfigError(f"{at}: the model has no {key[:-1]} named {name!r}; it has {sorted(by_spec)}")
        datatype = _field(item, "datatype", str, at)
        if datatype != spec.datatype:
            raise ConfigError(f"{at}: field 'datatype' is {datatype!r}; the model's {name} is {spec.datatype}")
        shape = _field(item, "shape", list, at)
        data = _field(item, "data", list, at)
        if any(not isinstance(d, int) or d < 0 for d in shape) or len(shape) != len(spec.shape):
            raise ConfigError(f"{at}: field 'shape' is {shape!r}; the model's {name} has shape {list(spec.shape)}")
        try:
            if datatype == "BYTES":
                array = np.array([s.encode("utf-8") for s in data], dtype=object)
            else:
                array = np.array(data, dtype=NUMPY_DTYPES[datatype])
            array = array.reshape(shape)
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"{at}: field 'data' does not hold {shape} {datatype} values: {exc}") from None
        found[name] = array
    missing = set(by_spec) - set(found)
    if key == "inputs" and missing:
        raise ConfigError(f"{where}: {key} lacks {sorted(missing)}")
    if not found:
        raise ConfigError(f"{where}: field '{key}' is empty")
    return found


def is_model_name(name: str) -> bool:
    """A model folder's name: one path component, not hidden."""
    return bool(name) and "/" not in name and "\\" not in name and "\x00" not in name and not name.startswith(".")


def _shown_list(values: list) -> str:
    return errors.shown_list(values) if len(values) > 8 else repr(values)


def check_file_name(name: str, key: str, where: str) -> None:
    """A file a config field names, by its name alone: a relative path that
    stays inside its folder (no '..'), before anything is looked up."""
    complaint = (
        "is empty"
        if not name
        else "holds a NUL character"
        if "\x00" in name
        else "is an absolute path"
        if name.startswith("/")
        else "contains '..'"
        if ".." in pathlib.PurePosixPath(name).parts
        else ""
    )
    if complaint:
        raise ConfigError(
            f"{where}: field '{key}' is {errors.shown(name)}, which {complaint}; name a file inside the model's folder"
        )


def confine(folder: pathlib.Path, name: str, key: str, where: str) -> pathlib.Path:
    """`folder / name` with every link resolved; ConfigError unless it lies
    inside `folder` (itself resolved: a version folder may be a link)."""
    check_file_name(name, key, where)
    base = folder.resolve()
    resolved = (base / name).resolve()
    if not resolved.is_relative_to(base):
        raise ConfigError(
            f"{where}: field '{key}' is {errors.shown(name)}, which resolves to {resolved}, outside "
            f"{base}; name a file inside the model's folder"
        )
    return resolved


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a link"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


def check_file(path: pathlib.Path, max_bytes: int, key: str, name: str, where: str) -> None:
    """A regular file of at most `max_bytes`, looked at (lstat) without opening it."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            f"{where}: field '{key}' is {errors.shown(name)}, which is {_kind(info.st_mode)}, not a regular file"
        )
    if info.st_size > max_bytes:
        raise ConfigError(
            f"{where}: field '{key}' is {errors.shown(name)}, which holds {info.st_size} bytes, "
            f"more than the {max_bytes} it may hold"
        )


def read_bounded(path: pathlib.Path, max_bytes: int, what: str) -> bytes:
    """A regular file's bytes, at most `max_bytes`. Opened without following a
    final link and without blocking, and checked once open, so a FIFO or a
    device put in the place of a checked file is refused, never waited on."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{path} ({what}): {exc.strerror}") from None
    if not stat.S_ISREG(mode):  # before opening: opening a device can have effects of its own
        raise ConfigError(f"{path}: {what} is {_kind(mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{path} ({what}): cannot open it: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path}: {what} is {_kind(info.st_mode)}, not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(f"{path}: {what} holds more than the {max_bytes} bytes it may hold")
    return data


def _json_object(data: bytes, path: pathlib.Path) -> dict:
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return doc
