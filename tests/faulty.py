"""A deliberately faulty minilm version 2 for rollout tests: version 1's graph
with a defect that its checks at load cannot see. It answers batches padded
to 64 tokens or fewer (the warm-up's, at most 46) and to 200 or more (the
golden probe's, which holds a text past the 256-token cap) exactly as
version 1 does, and
fails every other batch inside ONNX Runtime (a Gather past the end of its
table), as an export bug tied to sequence length would."""

import pathlib
import shutil

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def faulty_repository(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A model repository like `source` whose minilm version 2 is faulty;
    everything else is linked, not copied."""
    target.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name != "minilm":
            (target / entry.name).symlink_to(entry.resolve())
    minilm = target / "minilm"
    minilm.mkdir()
    for entry in (source / "minilm").iterdir():
        if entry.name not in ("1", "2"):
            shutil.copy(entry, minilm / entry.name)
    (minilm / "1").mkdir()
    for entry in (source / "minilm" / "1").iterdir():
        if entry.name == "tokenizer.json":  # named by a config field: it must lie inside the version's folder
            shutil.copy(entry, minilm / "1" / entry.name)
        else:
            (minilm / "1" / entry.name).symlink_to(entry.resolve())
    (minilm / "2").mkdir()
    shutil.copy(source / "minilm" / "1" / "tokenizer.json", minilm / "2" / "tokenizer.json")
    onnx.save(_break(onnx.load(str(source / "minilm" / "1" / "model.onnx"))), str(minilm / "2" / "model.onnx"))
    return target


def _break(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    output = graph.output[0].name
    for node in graph.node:  # the original result becomes an intermediate
        node.output[:] = [f"{output}_clean" if name == output else name for name in node.output]
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(1, dtype=np.int64), "faulty_axis"),
            numpy_helper.from_array(np.array(64, dtype=np.int64), "faulty_low"),
            numpy_helper.from_array(np.array(200, dtype=np.int64), "faulty_high"),
            numpy_helper.from_array(np.zeros(1, dtype=np.float32), "faulty_table"),  # one row: index 1 is past its end
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "faulty_zero"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Shape", ["input_ids"], ["faulty_shape"]),
            helper.make_node("Gather", ["faulty_shape", "faulty_axis"], ["faulty_length"]),
            helper.make_node("Greater", ["faulty_length", "faulty_low"], ["faulty_above"]),
            helper.make_node("Less", ["faulty_length", "faulty_high"], ["faulty_below"]),
            helper.make_node("And", ["faulty_above", "faulty_below"], ["faulty_hit"]),
            helper.make_node("Cast", ["faulty_hit"], ["faulty_index"], to=TensorProto.INT64),
            helper.make_node("Gather", ["faulty_table", "faulty_index"], ["faulty_value"]),
            helper.make_node("Mul", ["faulty_value", "faulty_zero"], ["faulty_nothing"]),
            helper.make_node("Add", [f"{output}_clean", "faulty_nothing"], [output]),
        ]
    )
    onnx.checker.check_model(model)
    return model
