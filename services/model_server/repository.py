"""Reads a model repository: `<repo>/<model>/config.json` and `<repo>/<model>/<version>/`.

Every malformed config is reported with the file and the field at fault.
"""

import dataclasses
import json
import pathlib

from services.common.tensors import DATATYPES


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
    max_length: int


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

    def versions(self) -> list[str]:
        """Version folders holding a model.onnx, newest (highest number) first."""
        found = [p.name for p in self.path.iterdir() if p.is_dir() and p.name.isdigit() and (p / "model.onnx").exists()]
        return sorted(found, key=int, reverse=True)


def _field(doc: dict, key: str, kind, where: str):
    if key not in doc:
        raise ConfigError(f"{where}: missing field '{key}'")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: field '{key}' must be {kind.__name__}, got {value!r}")
    return value


def _tensor_specs(doc: dict, key: str, where: str) -> tuple[TensorSpec, ...]:
    specs = []
    for i, item in enumerate(_field(doc, key, list, where)):
        at = f"{where}: {key}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{at} must be an object, got {item!r}")
        name = _field(item, "name", str, at)
        datatype = _field(item, "datatype", str, at)
        if datatype not in DATATYPES:
            raise ConfigError(f"{at}: field 'datatype' is {datatype!r}; expected one of {sorted(DATATYPES)}")
        shape = _field(item, "shape", list, at)
        if not shape or any(not isinstance(d, int) or d < -1 or d == 0 for d in shape):
            raise ConfigError(f"{at}: field 'shape' is {shape!r}; expected positive sizes or -1, batch first")
        specs.append(TensorSpec(name, datatype, tuple(shape)))
    if not specs:
        raise ConfigError(f"{where}: field '{key}' is empty")
    return tuple(specs)


def load_config(model_dir: pathlib.Path) -> ModelConfig:
    path = model_dir / "config.json"
    where = str(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: missing") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: must hold a JSON object")
    name = _field(doc, "name", str, where)
    if name != model_dir.name:
        raise ConfigError(f"{where}: field 'name' is {name!r} but the folder is {model_dir.name!r}")
    max_batch_size = _field(doc, "max_batch_size", int, where)
    if max_batch_size < 1:
        raise ConfigError(f"{where}: field 'max_batch_size' must be >= 1, got {max_batch_size}")
    preprocess = None
    if "preprocess" in doc:
        pre = _field(doc, "preprocess", dict, where)
        at = f"{where}: preprocess"
        kind = _field(pre, "kind", str, at)
        if kind != "text_tokenizer":
            raise ConfigError(f"{at}: field 'kind' is {kind!r}; the only kind is 'text_tokenizer'")
        max_length = _field(pre, "max_length", int, at)
        if max_length < 2:
            raise ConfigError(f"{at}: field 'max_length' must be >= 2, got {max_length}")
        preprocess = Preprocess(kind, _field(pre, "tokenizer_file", str, at), max_length)
    inputs = _tensor_specs(doc, "inputs", where)
    if preprocess is not None and (len(inputs) != 1 or inputs[0].datatype != "BYTES"):
        raise ConfigError(f"{where}: a text_tokenizer model takes exactly one BYTES input, got {inputs}")
    graph_outputs = doc.get("graph_outputs", {})
    if not isinstance(graph_outputs, dict) or not all(isinstance(v, str) for v in graph_outputs.values()):
        raise ConfigError(f"{where}: field 'graph_outputs' must map output names to graph output names")
    return ModelConfig(
        name=name,
        platform=_field(doc, "platform", str, where),
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=_tensor_specs(doc, "outputs", where),
        preprocess=preprocess,
        graph_outputs=graph_outputs,
        path=model_dir,
    )


def scan(repository: pathlib.Path) -> list[ModelConfig]:
    """Every model folder of the repository, in name order."""
    if not repository.is_dir():
        raise ConfigError(f"{repository}: model repository folder not found (run 'make setup')")
    return [load_config(d) for d in sorted(repository.iterdir()) if d.is_dir() and not d.name.startswith(".")]
