"""A fuzzer of the Open Inference Protocol at the router's edge.

hypothesis draws ModelInferRequests built to hurt: huge, zero and negative
dimensions; millions of inputs, elements or dimensions; typed and raw contents
together; BYTES lengths up to 2**32-1; invalid UTF-8; NaN and Inf; big parameter
maps; long ids. Each is run through the router's decode and validation in
process, or sent to a running router, and counted:

- a crash is an exception that is not a named refusal (errors.InfermeshError
  other than INTERNAL in process; UNKNOWN or INTERNAL from a router);
- a hang is a request the watchdog stopped (in process: a SIGALRM timer; on a
  router: the call's deadline);
- every refusal must be a named status whose message names the field;
- in process, the wire precheck must refuse nothing that check_counts accepts
  once parsed (a disagreement counts as a crash).

    python -m tools.fuzz_oip --in-process 100000 --router 10000

starts a mesh (as the tests start it) for the router part, prints the counts,
peak memory per request and CPU per refusal by kind, and writes them as JSON
with --json.
"""

import argparse
import collections
import contextlib
import json
import math
import os
import re
import resource
import signal
import struct
import sys
import time
import tracemalloc

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from inference import grpc_predict_v2_pb2 as pb

from services.common import errors
from services.router import precheck
from services.router.core import Catalog, ModelSignature, Router, Spec, validate
from services.router.limits import RequestLimits
from services.router.oip import RequestDecoder, check_counts, request_from_proto

MINILM = ModelSignature(
    "minilm",
    ("1",),
    ("1",),
    "onnxruntime_onnx",
    (Spec("TEXT", "BYTES", (-1,)),),
    (Spec("EMBEDDING", "FP32", (-1, 384)),),
    64,
)
MLP = ModelSignature(
    "mlp",
    ("1",),
    ("1",),
    "onnxruntime_onnx",
    (Spec("INPUT0", "FP32", (-1, 64)),),
    (Spec("OUTPUT0", "FP32", (-1, 64)),),
    256,
)
SIGNATURES = (MINILM, MLP)
MAX_BYTES = 16 * 1024 * 1024 - 64 * 1024  # what the router takes by default, with room for the envelope
AGREEMENT_BYTES = 1 << 20  # requests up to this size are also checked both ways (precheck_agrees)
WATCHDOG_S = 20.0  # far above what any request costs; past it a request is counted as a hang

# Words a refusal uses to name the field at fault.
FIELD_WORDS = re.compile(
    r"\binput|\boutput|parameter|raw_input_contents|contents|\bshape\b|datatype|\bmodel\b|"
    r"\bversion\b|metadata|protobuf fields|\bmessage\b|\bfield\b|\bid\b"
)


# ---------------------------------------------------------------- the wire, for bulk


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _bulk(kind: str, count: int) -> bytes:
    """Wire bytes to append to a request (fields of the top message merge in):
    `count` of one repeated part, as cheap to build as to send."""
    if kind == "inputs":
        return (
            _field(5, pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1]).SerializeToString())
            * count
        )
    if kind == "empty_typed_bytes":
        return _field(5, _field(1, b"TEXT") + _field(2, b"BYTES") + _field(3, b"\x01") + _field(5, b"\x42\x00" * count))
    if kind == "empty_raw_bytes":
        return _field(7, b"\x00\x00\x00\x00" * count)
    if kind == "parameters":
        entry = _field(1, b"p") + _field(2, b"\x08\x01")  # "p": bool_param true
        return _field(4, entry) * count
    if kind == "dims":
        return _field(5, _field(1, b"TEXT") + _field(2, b"BYTES") + _field(3, b"\x01" * count))
    if kind == "outputs":
        return _field(6, _field(1, b"o")) * count
    if kind == "packed_floats":
        return _field(
            5,
            _field(1, b"INPUT0")
            + _field(2, b"FP32")
            + _field(3, b"\x01\x40")
            + _field(5, _field(6, b"\x00\x00\xc0\x7f" * count)),
        )  # NaN, packed
    raise ValueError(kind)


BULK_KINDS = ("inputs", "empty_typed_bytes", "empty_raw_bytes", "parameters", "dims", "outputs", "packed_floats")


# ---------------------------------------------------------------- strategies

names = st.sampled_from(["TEXT", "INPUT0", "x", "", "EMBEDDING", "OUTPUT0"]) | st.text(max_size=40)
datatypes = st.sampled_from(
    ["BYTES", "FP32", "FP16", "FP64", "INT8", "INT32", "INT64", "UINT8", "UINT64", "BOOL"]
) | st.text(max_size=12)
dims = (
    st.integers(-2, 70)
    | st.sampled_from([0, 64, 384, 2**31, 2**32 - 1, 2**62, 2**63 - 1, -(2**63)])
    | st.integers(-(2**63), 2**63 - 1)
)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
long_text = st.integers(0, 1 << 20).map(lambda n: "x" * n)
texts = st.text(max_size=60) | st.sampled_from(["minilm", "mlp"]) | long_text


def _parameter(draw, message, key: str) -> None:
    kind = draw(st.sampled_from(["bool", "int64", "uint64", "string", "double", "none"]))
    parameter = message[key]
    if kind == "bool":
        parameter.bool_param = draw(st.booleans())
    elif kind == "int64":
        parameter.int64_param = draw(st.integers(-(2**63), 2**63 - 1))
    elif kind == "uint64":
        parameter.uint64_param = draw(st.integers(0, 2**64 - 1))
    elif kind == "string":
        parameter.string_param = draw(st.text(max_size=30))
    elif kind == "double":
        parameter.double_param = draw(st.floats(allow_nan=True, allow_infinity=True))


def _parameters(draw, message) -> None:
    keys = draw(
        st.lists(
            st.sampled_from(
                [
                    "priority",
                    "timeout",
                    "cache_bypass",
                    "sequence_id",
                    "sequence_start",
                    "shared_memory_region",
                    "classification",
                ]
            )
            | st.text(max_size=20),
            max_size=40,
        )
    )
    for key in keys:
        _parameter(draw, message, key)


def _bytes_contents(draw, count: int) -> bytes:
    """Length-prefixed BYTES: well framed (texts, maybe invalid UTF-8), or with
    lengths anywhere up to 2**32-1."""
    if draw(st.booleans()):
        items = draw(
            st.lists(
                st.binary(max_size=40) | st.text(max_size=40).map(str.encode),
                min_size=min(count, 64),
                max_size=min(count, 64),
            )
        )
        return b"".join(struct.pack("<I", len(i)) + i for i in items)
    lengths = draw(st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 16), max_size=8))
    return b"".join(struct.pack("<I", n) + b"a" * min(n, 64) for n in lengths) + draw(st.binary(max_size=3))


def _numeric_contents(draw, count: int, datatype: str) -> bytes:
    if datatype == "FP32" and count <= 1 << 16 and draw(st.booleans()):
        values = draw(st.lists(floats, min_size=1, max_size=8))
        return np.resize(np.asarray(values, "<f4"), count).tobytes()  # the right size, NaN and Inf among them
    return draw(st.binary(max_size=600))


@st.composite
def tensors(draw, request):
    tensor = request.inputs.add(name=draw(names), datatype=draw(datatypes))
    tensor.shape.extend(draw(st.lists(dims, max_size=6)))
    if draw(st.integers(0, 4)) == 0:
        _parameters(draw, tensor.parameters)
    typed = draw(st.sampled_from(["none", "none", "fp32", "bytes", "int", "int64", "bool", "mixed"]))
    contents = tensor.contents
    if typed in ("fp32", "mixed"):
        contents.fp32_contents.extend(draw(st.lists(floats, max_size=130)))
    if typed in ("bytes", "mixed"):
        contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=20), max_size=10)))
    if typed == "int":
        contents.int_contents.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70)))
    if typed == "int64":
        contents.int64_contents.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=70)))
    if typed == "bool":
        contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=70)))
    return tensor


@st.composite
def requests(draw, max_bulk: int = 4_000_000) -> bytes:
    """A serialised ModelInferRequest, possibly with bulk appended on the wire."""
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["minilm", "mlp"]) | texts),
        model_version=draw(st.sampled_from(["", "1", "2"]) | st.text(max_size=10)),
        id=draw(st.text(max_size=20) | long_text),
    )
    if draw(st.integers(0, 3)) == 0:
        _parameters(draw, request.parameters)
    count = draw(st.integers(0, 4))
    for _ in range(count):
        draw(tensors(request))
    raw_mode = draw(st.sampled_from(["none", "match", "match", "one_less", "extra"]))
    if raw_mode != "none":
        entries = len(request.inputs) + {"match": 0, "one_less": -1, "extra": 1}[raw_mode]
        for tensor in list(request.inputs)[: max(entries, 0)]:
            shape_count = math.prod(tensor.shape) if tensor.shape and all(0 <= d < 1 << 20 for d in tensor.shape) else 1
            if tensor.datatype == "BYTES":
                request.raw_input_contents.append(_bytes_contents(draw, shape_count))
            else:
                request.raw_input_contents.append(_numeric_contents(draw, shape_count, tensor.datatype))
        for _ in range(max(entries - len(request.inputs), 0)):
            request.raw_input_contents.append(draw(st.binary(max_size=20)))
    for name in draw(st.lists(names, max_size=4)):
        output = request.outputs.add(name=name)
        if draw(st.integers(0, 5)) == 0:
            _parameters(draw, output.parameters)
    raw = request.SerializeToString()
    if draw(st.integers(0, 9)) == 0:  # one in ten carries bulk: millions of something, at most
        kind = draw(st.sampled_from(BULK_KINDS))
        unit = len(_bulk(kind, 2)) - len(_bulk(kind, 1)) or 1
        most = max(1, min(max_bulk, (MAX_BYTES - len(raw)) // unit - 64))
        raw += _bulk(kind, draw(st.integers(1, most) | st.integers(1, min(most, 70_000))))
    return raw


@st.composite
def near_valid(draw) -> bytes:
    """A request minilm or mlp would serve, then maybe one thing made wrong:
    these reach the checks that come after the counts."""
    if draw(st.booleans()):
        texts_ = draw(st.lists(st.binary(max_size=50) | st.text(max_size=50).map(str.encode), min_size=1, max_size=8))
        request = pb.ModelInferRequest(model_name="minilm", id=draw(st.text(max_size=20) | long_text))
        tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts_)])
        if draw(st.booleans()):
            tensor.contents.bytes_contents.extend(texts_)
        else:
            request.raw_input_contents.append(b"".join(struct.pack("<I", len(t)) + t for t in texts_))
    else:
        rows = draw(st.integers(1, 4))
        values = np.resize(np.asarray(draw(st.lists(floats, min_size=1, max_size=8)), "<f4"), rows * 64)
        request = pb.ModelInferRequest(model_name="mlp", id=draw(st.text(max_size=20)))
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 64])
        if draw(st.booleans()):
            tensor.contents.fp32_contents.extend(values.tolist())
        else:
            request.raw_input_contents.append(values.tobytes())
    change = draw(st.sampled_from(["none", "none", "dim", "parameters", "output", "version", "raw_too"]))
    if change == "dim":
        tensor.shape[draw(st.integers(0, len(tensor.shape) - 1))] = draw(dims)
    elif change == "parameters":
        _parameters(draw, request.parameters)
    elif change == "output":
        request.outputs.add(name=draw(names))
    elif change == "version":
        request.model_version = draw(st.sampled_from(["1", "2", ""]))
    elif change == "raw_too":
        request.raw_input_contents.append(draw(st.binary(max_size=300)))
    return request.SerializeToString()


def any_request():
    """Wild requests and near-valid ones, about half each."""
    return st.one_of(requests(), near_valid())


# ---------------------------------------------------------------- judging one request


class Hang(Exception):
    """The watchdog stopped a request."""


def _alarm(signum, frame):
    raise Hang


_CATALOG = Catalog()
_CATALOG.replace(list(SIGNATURES))
_ROUTER = Router(_CATALOG, batcher=None, cache=None)


def in_process(raw: bytes, limits: RequestLimits) -> None:
    """What the router does with `raw` before the batcher: decode, convert,
    find the model, validate. Returns where it would forward the request;
    raises the refusal."""
    request = RequestDecoder(limits).decode(raw)
    infer = request_from_proto(request, {}, None)
    sig, _ = _ROUTER.signature(infer.model, infer.version)
    validate(sig, infer, limits)


def precheck_agrees(raw: bytes, limits: RequestLimits) -> bool:
    """Whether the wire precheck refuses only what check_counts would refuse
    once parsed (its contract), for a message small enough to parse as well."""
    try:
        precheck.check_request(raw, limits)
        return True
    except errors.InfermeshError as exc:
        if "protobuf fields" in exc.message or "parameters" in exc.message:
            return True  # counted as parsing costs: fields given twice, map entries that repeat a key
    except ValueError:
        pass
    try:
        request = pb.ModelInferRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - not a message: refusing it was right
        return True
    try:
        check_counts(request, limits)
    except errors.InfermeshError:
        return True
    return False


def kind_of(message: str) -> str:
    """A refusal's rule: its message with the values taken out."""
    message = re.sub(r"'[^']*'(\.\.\. \(\d+ characters\))?", "'…'", message)
    message = re.sub(r"\[[^\]]*\]", "[…]", message)
    message = re.sub(r"(?<![A-Za-z_])-?\d+(\.\d+)?", "N", message)  # numbers, not fp32 or UTF-8
    return " ".join(message.split()[:9])


class Tally:
    """Counts of outcomes, CPU per refusal kind, peak memory per request."""

    def __init__(self):
        self.requests = self.accepted = self.crashes = self.hangs = self.unnamed = 0
        self.refusals = collections.Counter()
        self.cpu_s = collections.Counter()
        self.examples = {}  # crash, hang and unnamed examples: (kind, what) -> message
        self.peak_bytes = []  # traced peak of sampled requests, and their sizes
        self.request_bytes = []

    def refused(self, code: str, message: str, cpu_s: float) -> None:
        kind = f"{code}: {kind_of(message)}"
        self.refusals[kind] += 1
        self.cpu_s[kind] += cpu_s
        if code in ("INTERNAL", "UNKNOWN"):
            self.crash(kind, message)
        elif not FIELD_WORDS.search(message):
            self.unnamed += 1
            self.examples.setdefault(f"unnamed {kind}", message[:300])

    def crash(self, what: str, message: str) -> None:
        self.crashes += 1
        self.examples.setdefault(f"crash {what}", message[:300])

    def summary(self) -> dict:
        kinds = {
            kind: {"count": n, "cpu_us_each": round(1e6 * self.cpu_s[kind] / n, 1)}
            for kind, n in self.refusals.most_common()
        }
        peaks = sorted(self.peak_bytes)
        ratio = sorted(p / max(s, 1) for p, s in zip(self.peak_bytes, self.request_bytes, strict=True))
        return {
            "requests": self.requests,
            "accepted": self.accepted,
            "refused": sum(self.refusals.values()),
            "crashes": self.crashes,
            "hangs": self.hangs,
            "unnamed_refusals": self.unnamed,
            "refusal_kinds": kinds,
            "examples": self.examples,
            "peak_traced_bytes": {
                "sampled": len(peaks),
                "max": peaks[-1] if peaks else None,
                "p99": peaks[int(0.99 * (len(peaks) - 1))] if peaks else None,
                "max_over_request_bytes": round(ratio[-1], 2) if ratio else None,
            },
        }


def run_in_process(
    count: int, limits: RequestLimits, seed: int, tally: Tally | None = None, trace_every: int = 100
) -> Tally:
    """Runs `count` generated requests through in_process, each under the watchdog."""
    tally = tally or Tally()
    outer_s, began = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()  # a test runner's own timeout
    previous = signal.signal(signal.SIGALRM, _alarm)

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        derandomize=False,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(any_request())
    def one(raw):
        tally.requests += 1
        traced = tally.requests % trace_every == 0
        if traced:
            tracemalloc.start()
        started = time.process_time()
        signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
        try:
            in_process(raw, limits)
            tally.accepted += 1
        except Hang:
            tally.hangs += 1
            tally.examples.setdefault("hang", f"{len(raw)} bytes: {raw[:80]!r}")
        except errors.InfermeshError as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            tally.refused(exc.code_name, exc.message, time.process_time() - started)
        except Exception as exc:  # noqa: BLE001 - what this counts
            signal.setitimer(signal.ITIMER_REAL, 0)
            tally.crash(type(exc).__name__, f"{type(exc).__name__}: {exc}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if len(raw) <= AGREEMENT_BYTES and not precheck_agrees(raw, limits):
                tally.crash("precheck refused what check_counts accepts", f"{len(raw)} bytes: {raw[:80]!r}")
            if traced:
                tally.peak_bytes.append(tracemalloc.get_traced_memory()[1])
                tally.request_bytes.append(len(raw))
                tracemalloc.stop()

    try:
        one._hypothesis_internal_use_seed = seed  # noqa: SLF001 - a reproducible run
        one()
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer_s:
            signal.setitimer(signal.ITIMER_REAL, max(outer_s - (time.monotonic() - began), 0.001))
    return tally


def _process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _vm_hwm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run_against(
    address: str, count: int, seed: int, router_pid: int | None = None, tally: Tally | None = None
) -> Tally:
    """Sends `count` generated requests to the router at `address`, one at a
    time, each with a deadline (the watchdog); CPU per refusal from /proc of
    `router_pid` when given."""
    import grpc

    tally = tally or Tally()
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    )
    infer = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=None, response_deserializer=None
    )
    hwm_before = _vm_hwm_bytes(router_pid) if router_pid else None

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(any_request())
    def one(raw):
        tally.requests += 1
        cpu_before = _process_cpu_s(router_pid) if router_pid else 0.0
        started = time.monotonic()
        try:
            infer(raw, timeout=WATCHDOG_S)
            tally.accepted += 1
        except grpc.RpcError as exc:
            code = exc.code()
            # The watchdog's deadline, not the request's own (the OIP 'timeout' parameter may ask for 1 us).
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started >= WATCHDOG_S:
                tally.hangs += 1
                tally.examples.setdefault("hang", f"{len(raw)} bytes: {raw[:80]!r}")
            else:
                cpu = _process_cpu_s(router_pid) - cpu_before if router_pid else 0.0
                tally.refused(code.name, exc.details() or "", cpu)

    try:
        one._hypothesis_internal_use_seed = seed  # noqa: SLF001
        one()
    finally:
        channel.close()
    if router_pid:
        tally.examples["router VmHWM bytes (before, after)"] = f"{hwm_before}, {_vm_hwm_bytes(router_pid)}"
    return tally


def print_summary(title: str, summary: dict, out=sys.stdout) -> None:
    print(
        f"== {title}: {summary['requests']} requests, {summary['accepted']} accepted, {summary['refused']} "
        f"refused, {summary['crashes']} crashes, {summary['hangs']} hangs, {summary['unnamed_refusals']} "
        f"refusals not naming a field",
        file=out,
    )
    peak = summary["peak_traced_bytes"]
    if peak["sampled"]:
        print(
            f"   peak traced memory per request ({peak['sampled']} sampled): p99 {peak['p99']} B, max {peak['max']} B "
            f"({peak['max_over_request_bytes']}x its request's bytes)",
            file=out,
        )
    for kind, row in list(summary["refusal_kinds"].items())[:25]:
        print(f"   {row['count']:>7}  {row['cpu_us_each']:>9.1f} us  {kind}", file=out)
    for what, example in summary["examples"].items():
        print(f"   ! {what}: {example}", file=out)


@contextlib.contextmanager
def running_router():
    """A mesh as the tests start it (no cache); yields (address, router pid)."""
    import pathlib
    import tempfile

    from services.launcher.mesh import ROOT, Mesh, MeshConfig

    with (
        tempfile.TemporaryDirectory() as logs,
        Mesh(MeshConfig(models=ROOT / "build" / "models", log_dir=pathlib.Path(logs), cache=False)) as mesh,
    ):
        yield mesh.router, mesh.processes["router"].popen.pid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-process", type=int, default=100_000, help="requests through decode and validation")
    parser.add_argument("--router", type=int, default=10_000, help="requests sent to a running router (0: none)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    results = {"seed": args.seed}
    if args.in_process:
        started = time.perf_counter()
        results["in_process"] = run_in_process(args.in_process, RequestLimits(), args.seed).summary()
        results["in_process"]["wall_s"] = round(time.perf_counter() - started, 1)
        print_summary("in process", results["in_process"])
    if args.router:
        with running_router() as (address, pid):
            started = time.perf_counter()
            results["router"] = run_against(address, args.router, args.seed, pid).summary()
            results["router"]["wall_s"] = round(time.perf_counter() - started, 1)
        print_summary("through a running router", results["router"])
    results["max_rss_bytes_of_this_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    failed = sum(
        results[p]["crashes"] + results[p]["hangs"] + results[p]["unnamed_refusals"]
        for p in ("in_process", "router")
        if p in results
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
