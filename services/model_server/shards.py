"""Tensor-parallel shard sets at run time: check a set's manifest and run it like one session.

tools/build_models/shards.py builds them (the split is described there). A set
is one ONNX graph per segment and shard, in the order the manifest lists; the
partial sums of every shard are all-reduced before the next segment, and the
last segment (shard 0's alone) pools the hidden states into the embeddings.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import pathlib

import numpy as np
import onnxruntime as ort

from services.common.config import field, read_json_object

MANIFEST = "manifest.json"
FORMAT = "infermesh-tp/1"


class ShardError(ValueError):
    """A shard set that cannot be built or loaded; the message says why."""


def read_manifest(folder: pathlib.Path, degree: int, verify_checksums: bool = True) -> dict:
    """The shard set's manifest, checked field by field (a damaged one is a
    ShardError naming the file and the field, never a KeyError at load time),
    with every file it lists present and, unless told otherwise, unchanged."""
    path = folder / MANIFEST
    manifest = read_json_object(path, ShardError, f"missing; build the shard set for tp_degree {degree}")
    if manifest.get("format") != FORMAT or manifest.get("degree") != degree:
        raise ShardError(
            f"{path}: format {manifest.get('format')!r} degree {manifest.get('degree')!r}; "
            f"expected {FORMAT} at degree {degree}"
        )
    where = str(path)
    segments = field(manifest, "segments", list, where, ShardError)
    if len(segments) < 2 or not all(isinstance(s, str) for s in segments) or len(set(segments)) != len(segments):
        raise ShardError(
            f"{where}: field 'segments' is {str(segments)[:200]}; expected two or more segment names, each once"
        )
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
            i for i in self._segments[1][1][0].get_inputs() if i.name == "attention_mask"
        ]

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
            available = {
                "input_ids": ids,
                "token_type_ids": types,
                "attention_mask": mask,
                "hidden_sum": total,
                "residual": residual,
            }
            step = {key: value for key, value in available.items() if key in takes}
            if name == "pool":
                return sessions[0].run(list(output_names), step)
            # Each call binds what it runs on (the pool runs them while this segment waits).
            results = self._all_shards(name, [lambda s=s, step=step: s.run(None, step) for s in sessions])
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
        host = {
            "input_ids": feeds["input_ids"],
            "attention_mask": feeds["attention_mask"],
            "token_type_ids": feeds.get("token_type_ids", np.zeros_like(feeds["input_ids"])),
        }
        on = {
            d: {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), kind, d) for k, v in host.items()}
            for d in set(devices)
        }
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
            results = self._all_shards(
                name,
                [
                    lambda s=s, i=i, takes=takes: bound(s, i, takes, [o.name for o in s.get_outputs()]).get_outputs()
                    for i, s in enumerate(sessions)
                ],
            )
            total = (
                results[0][-1] if len(results) == 1 else self._all_reduce(kind, devices[0], [r[-1] for r in results])
            )
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
    graph = (
        message(1, node)
        + message(2, b"all_reduce")
        + b"".join(message(11, tensor(n)) for n in names)
        + message(12, tensor("sum"))
    )
    # ModelProto: ir_version 8 and opset 18 of the default domain, as the shard sets' graphs.
    return integer(1, 8) + message(7, graph) + message(8, message(1, b"") + integer(2, 18))


def _sum_session(inputs: int, device: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    providers: list[str | tuple[str, dict[str, int]]] = ["CPUExecutionProvider"]
    if device is not None:
        providers = [("CUDAExecutionProvider", {"device_id": device}), "CPUExecutionProvider"]
    return ort.InferenceSession(_sum_graph(inputs), options, providers=providers)
