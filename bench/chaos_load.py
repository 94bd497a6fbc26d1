"""Mixed load with per-request accounting, for chaos runs: unary ModelInfer
callers and ModelStreamInfer streams, VIP and standard tenants, minilm and mlp,
mostly distinct inputs plus a share of repeats the cache can answer; every
request carries a unique id and every answer it gets is written down, so a run
counts what each caller got: answered (by status), unanswered, answered twice,
and wrong (a sample compared with ONNX Runtime run in this process).

    load = ChaosLoad(router_address, LoadConfig(callers=8), {"vip": vip_md, "standard": std_md})
    running = asyncio.create_task(load.run(duration_s=60))
    await load.started.wait(); fault_at = time.monotonic(); <inject a fault>
    result = await running          # LoadResult: totals, buckets, accounting
    recovery(result.accounting, fault_at)

Stream requests are matched to their answers by id. A stream that ends while
requests on it are outstanding leaves them unanswered if it ended OK, or
"failed by stream error" with its status if it did not.
"""

import asyncio
import dataclasses
import itertools
import json
import pathlib
import random
import time
from collections.abc import Iterable, Sequence

import grpc
import numpy as np
from inference import grpc_predict_v2_pb2 as pb

from bench.workload import ASKS, PROBLEMS, SUBJECTS
from tests.oip import tensor_request, text_request

ROOT = pathlib.Path(__file__).resolve().parent.parent
UNARY = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
MLP_WIDTH = 64
OUTPUT = {"minilm": "EMBEDDING", "mlp": "OUTPUT0"}  # the output each model answers with
MINILM_MIN_COSINE = 0.999  # bench/peers.py's agreement bound
MLP_MAX_ABS = 1e-4  # the mesh's golden probe for mlp
# A stream's status that grpc.aio replaced with INTERNAL "Internal error from Core"
# because a write failed as the stream ended (grpc/grpc#36066): the server's own
# status, OK or not, is unknown, so its outstanding requests are counted apart.
STATUS_LOST = "STATUS_LOST"
Metadata = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """What the load sends; shares are of callers (streams, VIP) or of requests (mlp, repeats)."""

    callers: int = 8  # asyncio callers, each one tenant, each a unary loop or one stream at a time
    stream_share: float = 0.5
    stream_window: int = 4  # requests outstanding at once on a stream
    vip_share: float = 0.25
    mlp_share: float = 0.3
    repeat_share: float = 0.2  # requests whose input comes from a small pool the cache can answer
    repeat_pool: int = 16  # inputs per model in that pool
    check_every: int = 20  # every n-th distinct request is compared with the reference; every repeat is
    timeout_s: float = 10.0  # each request's deadline (unary: the call's; stream: the OIP timeout parameter)
    answer_grace_s: float = 5.0  # past its deadline, how long a stream request's answer is still waited for
    error_pause_s: float = 0.05  # a unary caller's pause after an error, so an outage is not a busy loop
    think_s: float = 0.0  # a caller's pause before each request: a light load beside another (0: closed loop)
    reconnect_pause_s: float = 0.1  # before a caller opens a new stream after one ended
    channels: int = 2
    seed: int = 0

    def __post_init__(self):
        for name in ("stream_share", "vip_share", "mlp_share", "repeat_share"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        for name in ("callers", "stream_window", "repeat_pool", "check_every", "channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")


@dataclasses.dataclass(slots=True)
class Record:
    """One request: when it left, and every answer it got (time, status name)."""

    id: str
    model: str
    tier: str
    kind: str  # "unary" or "stream"
    repeat: bool
    sent_at: float
    answers: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    stream_error: str = ""  # the status its stream ended with while it was outstanding
    stream_error_at: float = 0.0
    wrong: str = ""  # why its answer is wrong, if it is
    checked: bool = False
    degraded: str = ""  # how the router answered in place of a failing model (its infermesh_degraded)
    unsent: bool = False  # its stream write failed: it never left, so nothing owes it an answer

    @property
    def is_unanswered(self) -> bool:
        return not self.answers and not self.stream_error and not self.unsent


@dataclasses.dataclass(slots=True)
class Sample:
    """An answer kept to compare with the reference."""

    model: str  # the model whose output it should be (a fallback's, when one answered)
    version: str
    input: object  # str (text) or np.ndarray (tensor row)
    output: np.ndarray


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class Accounting:
    """Every request and every answer; counts what was lost, doubled or wrong.
    Times are time.monotonic() seconds."""

    def __init__(self):
        self.records: dict[str, Record] = {}
        self.samples: dict[str, Sample] = {}
        self.stray: list[tuple[float, str, str]] = []  # answers to no request sent: (time, id, status)
        self.started = time.monotonic()

    def sent(
        self, request_id: str, model: str, tier: str, kind: str, repeat: bool = False, at: float | None = None
    ) -> Record:
        if request_id in self.records:
            raise ValueError(f"request id {request_id!r} was sent twice: ids must be unique")
        record = self.records[request_id] = Record(
            request_id, model, tier, kind, repeat, time.monotonic() if at is None else at
        )
        return record

    def answered(self, request_id: str, status: str, at: float | None = None) -> Record | None:
        """One answer (status "OK" or a gRPC status name); None for an id never sent."""
        at = time.monotonic() if at is None else at
        record = self.records.get(request_id)
        if record is None:
            self.stray.append((at, request_id, status))
            return None
        record.answers.append((at, status))
        return record

    def stream_ended(self, outstanding: Iterable[str], status: str, at: float | None = None) -> None:
        """A stream ended with `status` while these requests had no answer: with OK
        they stay unanswered; otherwise they failed by that stream error."""
        if status == "OK":
            return
        at = time.monotonic() if at is None else at
        for request_id in outstanding:
            record = self.records[request_id]
            if not record.answers:
                record.stream_error, record.stream_error_at = status, at

    def unsent(self, request_id: str) -> None:
        """Its write failed: it never reached the server."""
        self.records[request_id].unsent = True

    def mark_wrong(self, request_id: str, why: str) -> None:
        self.records[request_id].wrong = why

    def keep_sample(self, request_id: str, sample: Sample) -> None:
        self.samples[request_id] = sample

    def check(self, reference: "Reference") -> int:
        """Compares every kept sample with the reference; returns how many were wrong."""
        wrong = 0
        by_model: dict[tuple[str, str], list[str]] = {}
        for request_id, sample in self.samples.items():
            by_model.setdefault((sample.model, sample.version), []).append(request_id)
        for (model, version), ids in by_model.items():
            if not reference.has(model, version):
                for request_id in ids:
                    record = self.records[request_id]
                    record.checked = True
                    record.wrong = (
                        record.wrong or f"answered as {model!r} version {version!r}, which the repository lacks"
                    )
                wrong += len(ids)
                continue
            expected = reference.outputs(model, version, [self.samples[i].input for i in ids])
            for request_id, want in zip(ids, expected, strict=True):
                got = self.samples[request_id].output
                record = self.records[request_id]
                record.checked = True
                why = reference.disagreement(model, got, want)
                if why:
                    record.wrong = record.wrong or f"{model}/{version}: {why}"
                    wrong += 1
        self.samples.clear()
        return wrong

    # -- what a run shows --------------------------------------------------------------
    def selected(self, sent_from: float | None = None, sent_until: float | None = None) -> list[Record]:
        return [
            r
            for r in self.records.values()
            if (sent_from is None or r.sent_at >= sent_from) and (sent_until is None or r.sent_at < sent_until)
        ]

    def totals(
        self, sent_from: float | None = None, sent_until: float | None = None, late_after_s: float | None = None
    ) -> dict:
        """Counts over the requests sent in [sent_from, sent_until): each request's
        first answer by status (OK included), those failed by a stream error by
        its status, unanswered (neither), twice (two answers or more), wrong,
        checked; sent == sum(by_status) + sum(stream_failed) + status_lost + unsent
        + unanswered (status_lost: outstanding on a stream whose status grpc lost,
        STATUS_LOST; unsent: a write that failed as its stream ended).
        `late`: answered more than late_after_s after it was sent."""
        records = self.selected(sent_from, sent_until)
        by_status: dict[str, int] = {}
        stream_failed: dict[str, int] = {}
        unanswered = twice = wrong = checked = late = degraded = status_lost = unsent = 0
        for r in records:
            if r.answers:
                status = r.answers[0][1]
                by_status[status] = by_status.get(status, 0) + 1
                if late_after_s is not None and r.answers[0][0] - r.sent_at > late_after_s:
                    late += 1
            elif r.stream_error == STATUS_LOST:
                status_lost += 1
            elif r.stream_error:
                stream_failed[r.stream_error] = stream_failed.get(r.stream_error, 0) + 1
            elif r.unsent:
                unsent += 1
            else:
                unanswered += 1
            twice += len(r.answers) > 1
            wrong += bool(r.wrong)
            checked += r.checked
            degraded += bool(r.degraded)
        stray = [
            s
            for s in self.stray
            if (sent_from is None or s[0] >= sent_from) and (sent_until is None or s[0] < sent_until)
        ]
        return {
            "sent": len(records),
            "ok": by_status.get("OK", 0),
            "by_status": dict(sorted(by_status.items())),
            "stream_failed": dict(sorted(stream_failed.items())),
            "status_lost": status_lost,
            "unsent": unsent,
            "unanswered": unanswered,
            "twice": twice,
            "wrong": wrong,
            "checked": checked,
            "late": late,
            "degraded": degraded,
            "stray": len(stray),
        }

    def unanswered_ids(self, limit: int = 20) -> list[str]:
        return list(itertools.islice((r.id for r in self.records.values() if r.is_unanswered), limit))

    def events(self) -> list[tuple[float, str, float]]:
        """Every request's outcome in time order: (time, status, latency_s); a stream
        error counts at the time the stream ended."""
        out = [
            (r.answers[0][0], r.answers[0][1], r.answers[0][0] - r.sent_at) for r in self.records.values() if r.answers
        ]
        out += [
            (r.stream_error_at, r.stream_error, r.stream_error_at - r.sent_at)
            for r in self.records.values()
            if not r.answers and r.stream_error
        ]
        out.sort()
        return out

    def buckets(self, width_s: float = 1.0, until: float | None = None) -> list[dict]:
        """Per `width_s` from `started`, by answer time: ok, each other status, p50/p99
        of OK latency (ms); by send time: sent and (later) unanswered."""
        events = self.events()
        last = max(
            [until or 0.0, *(e[0] for e in events), *(r.sent_at for r in self.records.values())], default=self.started
        )
        count = int((last - self.started) // width_s) + 1
        rows = [
            {"t_s": i * width_s, "sent": 0, "ok": 0, "status": {}, "unanswered": 0, "latencies": []}
            for i in range(count)
        ]
        for r in self.records.values():
            row = rows[min(count - 1, max(0, int((r.sent_at - self.started) // width_s)))]
            row["sent"] += 1
            row["unanswered"] += r.is_unanswered
        for at, status, latency in events:
            row = rows[min(count - 1, max(0, int((at - self.started) // width_s)))]
            if status == "OK":
                row["ok"] += 1
                row["latencies"].append(latency)
            else:
                row["status"][status] = row["status"].get(status, 0) + 1
        for row in rows:
            latencies = sorted(row.pop("latencies"))
            p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
            row["p50_ms"] = None if p50 is None else 1000 * p50
            row["p99_ms"] = None if p99 is None else 1000 * p99
        return rows


def recovery(
    accounting: Accounting,
    fault_at: float,
    window_s: float = 1.0,
    factor: float = 1.5,
    baseline_s: float = 10.0,
    baseline_until: float | None = None,
    step_s: float = 0.1,
    min_ok: int = 5,
) -> dict:
    """After a fault at `fault_at` (time.monotonic()): first_ok_s, from the fault to
    the first OK answer to a request sent at or after it; p99_back_s, from the fault
    to the end of the first window of `window_s` (sliding by step_s, by answer time)
    holding at least min_ok answers, all OK, whose OK p99 is within `factor` times
    p99_before_ms (the OK p99 of answers in the baseline_s before baseline_until,
    the fault unless given: a quiet stretch when faults follow each other closely).
    None where it never happened in the run; p99_back_s is window_s at the least."""
    events = accounting.events()
    until = fault_at if baseline_until is None else baseline_until
    before = sorted(latency for at, status, latency in events if status == "OK" and until - baseline_s <= at < until)
    p99_before = _percentile(before, 0.99)
    first_ok = next(
        (
            at - fault_at
            for at, status, latency in events
            if status == "OK" and at >= fault_at and at - latency >= fault_at
        ),
        None,
    )
    p99_back = None
    after = [(at, status, latency) for at, status, latency in events if at >= fault_at]
    if p99_before is not None and after:
        start, lo, hi = fault_at, 0, 0
        while start + window_s <= after[-1][0] + step_s:
            while lo < len(after) and after[lo][0] < start:
                lo += 1
            while hi < len(after) and after[hi][0] < start + window_s:
                hi += 1
            window = after[lo:hi]
            ok = sorted(latency for _, status, latency in window if status == "OK")
            if len(ok) >= min_ok and len(ok) == len(window) and _percentile(ok, 0.99) <= factor * p99_before:
                p99_back = start + window_s - fault_at
                break
            start += step_s
    return {
        "first_ok_s": first_ok,
        "p99_back_s": p99_back,
        "p99_before_ms": None if p99_before is None else 1000 * p99_before,
    }


class Reference:
    """The models of a repository run in this process on ONNX Runtime: the
    outputs the mesh must give, and how far an answer may be from them."""

    def __init__(self, models: str | pathlib.Path = ROOT / "build" / "models", threads: int | None = None):
        self.models = pathlib.Path(models)
        self.threads = threads
        self._runners: dict[tuple[str, str], object] = {}

    def _config(self, model: str) -> dict:
        return json.loads((self.models / model / "config.json").read_text())

    def has(self, model: str, version: str) -> bool:
        return bool(version) and (self.models / model / version / "model.onnx").is_file()

    def is_text(self, model: str) -> bool:
        return self._config(model).get("preprocess", {}).get("kind") == "text_tokenizer"

    def outputs(self, model: str, version: str, inputs: list) -> list[np.ndarray]:
        """One output row per input (texts for a text model, rows for a tensor model)."""
        key = (model, version)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = self._runner(model, version)
        rows: list[np.ndarray] = []
        for start in range(0, len(inputs), 32):
            rows.extend(runner(inputs[start : start + 32]))
        return rows

    def _runner(self, model: str, version: str):
        import onnxruntime as ort

        from bench.workload import InProcessMinilm

        folder = self.models / model / version
        if self.is_text(model):
            minilm = InProcessMinilm(folder, self.threads)
            return minilm.embed
        config = self._config(model)
        options = ort.SessionOptions()
        if self.threads:
            options.intra_op_num_threads = self.threads
        session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
        (tensor,), (output,) = config["inputs"], config["outputs"]
        return lambda batch: session.run([output["name"]], {tensor["name"]: np.stack(batch).astype(np.float32)})[0]

    def disagreement(self, model: str, got: np.ndarray, want: np.ndarray) -> str:
        """Why `got` is not the model's answer, or "" if it is."""
        got = np.asarray(got, dtype=np.float64).reshape(-1)
        want = np.asarray(want, dtype=np.float64).reshape(-1)
        if got.shape != want.shape:
            return f"{got.size} values, the reference {want.size}"
        if not np.all(np.isfinite(got)):
            return "non-finite values"
        if self.is_text(model):
            cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want) or 1.0))
            return "" if cosine >= MINILM_MIN_COSINE else f"cosine {cosine:.6f} < {MINILM_MIN_COSINE}"
        max_abs = float(np.max(np.abs(got - want)))
        return "" if max_abs <= MLP_MAX_ABS else f"differs by up to {max_abs:.2e} (> {MLP_MAX_ABS:g})"


@dataclasses.dataclass
class LoadResult:
    started: float  # time.monotonic()
    ended: float
    totals: dict
    buckets: list[dict]
    accounting: Accounting


@dataclasses.dataclass(slots=True)
class Outgoing:
    """A request about to leave, with what its answer is checked against."""

    request: pb.ModelInferRequest
    record: Record
    input: object
    check: bool


class Inputs:
    """Each caller's requests: distinct texts and tensor rows, tagged by the run,
    plus a fixed pool of repeats (the same in every run, so a cache may hold them)."""

    def __init__(self, config: LoadConfig, tag: str):
        self.config = config
        self.tag = tag
        rng = random.Random(config.seed)
        self.repeat_texts = [
            f"Hello, {rng.choice(SUBJECTS)} {rng.choice(PROBLEMS)}, {rng.choice(ASKS)}? (repeat {k})"
            for k in range(config.repeat_pool)
        ]
        self.repeat_rows = [
            np.random.default_rng(1000 + k).standard_normal(MLP_WIDTH).astype(np.float32)
            for k in range(config.repeat_pool)
        ]

    def caller(self, caller: int):
        """An endless sequence of (model, input, repeat, check) for one caller."""
        config = self.config
        rng = random.Random(f"{config.seed}-{caller}")
        rows = np.random.default_rng([config.seed, caller])
        for n in itertools.count():
            model = "mlp" if rng.random() < config.mlp_share else "minilm"
            if rng.random() < config.repeat_share:
                k = rng.randrange(config.repeat_pool)
                yield model, self.repeat_texts[k] if model == "minilm" else self.repeat_rows[k], True, True
            elif model == "minilm":
                text = (
                    f"Hello, {rng.choice(SUBJECTS)} {rng.choice(PROBLEMS)}, {rng.choice(ASKS)}? "
                    f"(chaos {self.tag} {caller}-{n})"
                )
                yield model, text, False, n % config.check_every == 0
            else:
                yield model, rows.standard_normal(MLP_WIDTH).astype(np.float32), False, n % config.check_every == 0


def _spread(count: int, share: float) -> list[bool]:
    """`count` flags, round(count * share) of them true, spread evenly."""
    return [int((i + 1) * share + 0.5) > int(i * share + 0.5) for i in range(count)]


class ChaosLoad:
    """N asyncio callers against a router for a duration, every request accounted
    for (see Accounting). `metadata_by_tier` holds the gRPC metadata of a VIP and
    of a standard tenant ({"vip": ..., "standard": ...})."""

    def __init__(
        self,
        address: str,
        config: LoadConfig,
        metadata_by_tier: dict[str, Metadata],
        channel_credentials: grpc.ChannelCredentials | None = None,
        reference: Reference | None = None,
    ):
        missing = {"vip", "standard"} - set(metadata_by_tier)
        if missing:
            raise ValueError(f"metadata_by_tier has no {sorted(missing)}: give each tier's tenant credentials")
        self.address = address
        self.config = config
        self.metadata_by_tier = metadata_by_tier
        self.channel_credentials = channel_credentials
        self.reference = reference
        self.accounting = Accounting()
        self.started = asyncio.Event()  # set once the callers run (accounting.started is then their start time)
        self._stopping = asyncio.Event()
        self.tag = f"{config.seed}-{random.getrandbits(32):08x}"
        self._inputs = Inputs(config, self.tag)

    def stop(self) -> None:
        """Ends the load early: callers send nothing more and wait for what is outstanding."""
        self._stopping.set()

    async def run(self, duration_s: float, check: bool = True) -> LoadResult:
        """Sends for duration_s, then waits for the outstanding answers (each at
        most its deadline plus answer_grace_s) and, if `check`, compares the
        sample with the reference (build/models unless given)."""
        config = self.config
        options = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
        if self.channel_credentials is None:
            channels = [grpc.aio.insecure_channel(self.address, options=options) for _ in range(config.channels)]
        else:
            channels = [
                grpc.aio.secure_channel(self.address, self.channel_credentials, options=options)
                for _ in range(config.channels)
            ]
        streams = _spread(config.callers, config.stream_share)
        # VIP callers spread over both kinds: a share of the streams, and of the unary callers.
        vip_streams = iter(_spread(sum(streams), config.vip_share))
        vip_unary = iter(_spread(config.callers - sum(streams), config.vip_share))
        vips = [next(vip_streams) if stream else next(vip_unary) for stream in streams]
        self.accounting.started = time.monotonic()
        self.started.set()
        callers = [
            asyncio.create_task(
                (self._stream_caller if streams[i] else self._unary_caller)(
                    i, channels[i % len(channels)], "vip" if vips[i] else "standard"
                )
            )
            for i in range(config.callers)
        ]
        timer = asyncio.get_running_loop().call_later(duration_s, self._stopping.set)
        try:
            await asyncio.gather(*callers)
        finally:
            timer.cancel()
            self._stopping.set()
            for task in callers:
                task.cancel()
            await asyncio.gather(*callers, return_exceptions=True)
            for channel in channels:
                await channel.close()
        ended = time.monotonic()
        if check:
            reference = self.reference or Reference()
            await asyncio.to_thread(self.accounting.check, reference)
        return LoadResult(
            self.accounting.started,
            ended,
            self.accounting.totals(late_after_s=config.timeout_s + config.answer_grace_s),
            self.accounting.buckets(until=ended),
            self.accounting,
        )

    # -- requests and answers -----------------------------------------------------------
    def _outgoing(self, inputs, caller: int, n: int, tier: str, kind: str) -> Outgoing:
        model, value, repeat, check = next(inputs)
        request_id = f"{self.tag}-{caller}-{n}"
        if model == "minilm":
            request = text_request([value], model=model, request_id=request_id)
        else:
            request = tensor_request(value[None, :], model=model)
            request.id = request_id
        if kind == "stream":  # a stream request's own deadline (OIP timeout, in microseconds)
            request.parameters["timeout"].int64_param = int(self.config.timeout_s * 1e6)
        record = self.accounting.sent(request_id, model, tier, kind, repeat)
        return Outgoing(request, record, value, check)

    def _accept(self, outgoing: Outgoing, response: pb.ModelInferResponse) -> None:
        """An OK answer: written down, checked for its id and shape, kept for the reference if sampled."""
        record = self.accounting.answered(outgoing.record.id, "OK")
        if len(record.answers) > 1:
            return  # the first answer is the one checked
        if "infermesh_degraded" in response.parameters:
            record.degraded = response.parameters["infermesh_degraded"].string_param
        if response.id != record.id or response.model_name != record.model:
            record.wrong = f"answer for {response.model_name!r} id {response.id!r}"
            return
        output = _output(response, OUTPUT[record.model])
        width = 384 if record.model == "minilm" else MLP_WIDTH
        if output is None or output.shape != (1, width):
            record.wrong = (
                f"output {OUTPUT[record.model]} missing or of shape {None if output is None else output.shape}"
            )
            return
        if outgoing.check:
            model, version = record.model, response.model_version
            if record.degraded.startswith("fallback "):  # "fallback <model>/<version>"
                model, _, version = record.degraded.removeprefix("fallback ").partition("/")
            self.accounting.keep_sample(record.id, Sample(model, version, outgoing.input, output[0].copy()))

    async def _unary_caller(self, caller: int, channel: grpc.aio.Channel, tier: str) -> None:
        infer = channel.unary_unary(
            UNARY,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        metadata = self.metadata_by_tier[tier]
        inputs = self._inputs.caller(caller)
        for n in itertools.count():
            if self._stopping.is_set():
                return
            if self.config.think_s:
                await asyncio.sleep(self.config.think_s)
            outgoing = self._outgoing(inputs, caller, n, tier, "unary")
            try:
                response = await infer(outgoing.request, timeout=self.config.timeout_s, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                self.accounting.answered(outgoing.record.id, exc.code().name)
                await asyncio.sleep(self.config.error_pause_s)
                continue
            self._accept(outgoing, response)

    async def _stream_caller(self, caller: int, channel: grpc.aio.Channel, tier: str) -> None:
        """One stream at a time; a new one after a stream ends, until the load stops."""
        method = channel.stream_stream(
            STREAM,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        inputs = self._inputs.caller(caller)
        numbers = itertools.count()
        while not self._stopping.is_set():
            await StreamRun(self, method(metadata=self.metadata_by_tier[tier]), inputs, numbers, caller, tier).run()
            if not self._stopping.is_set():
                await asyncio.sleep(self.config.reconnect_pause_s)


class StreamRun:
    """One ModelStreamInfer call: a sender keeping stream_window requests
    outstanding, a reader matching answers by id; when the load stops, the sender
    waits for the outstanding answers, then half-closes."""

    def __init__(self, load: ChaosLoad, call, inputs, numbers, caller: int, tier: str):
        self.load, self.call, self.inputs, self.numbers = load, call, inputs, numbers
        self.caller, self.tier = caller, tier
        self.outstanding: dict[str, Outgoing] = {}
        self.holding: set[str] = set()  # outstanding and still holding a window slot
        self.window = asyncio.Semaphore(load.config.stream_window)
        self.drained = asyncio.Event()
        self.ended = False
        self.gave_up = False
        self.write_failed = False

    async def run(self) -> None:
        accounting = self.load.accounting
        sender = asyncio.create_task(self._send())
        status, details = "OK", ""
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                self._receive(message)
            status, details = (await self.call.code()).name, await self.call.details()
        except grpc.aio.AioRpcError as exc:
            status, details = exc.code().name, exc.details()
        except asyncio.CancelledError:
            if not self.gave_up or asyncio.current_task().cancelling():
                raise
            status = "CANCELLED"  # the sender cancelled the call, giving up on its answers
        finally:
            self.ended = True
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        if self.gave_up:  # this caller cancelled the stream, giving up on its answers: they stay unanswered
            status = "OK"
        elif status == "INTERNAL" and self.write_failed and details == "Internal error from Core":
            status = STATUS_LOST
        accounting.stream_ended(list(self.outstanding), status)

    def _release(self, request_id: str) -> None:
        if request_id in self.holding:
            self.holding.discard(request_id)
            self.window.release()

    def _overdue(self, request_id: str) -> None:
        """Past its deadline and grace with no answer: it stays outstanding (and
        counts as unanswered unless an answer comes), but frees its slot."""
        self._release(request_id)

    def _receive(self, message: pb.ModelStreamInferResponse) -> None:
        response = message.infer_response
        outgoing = self.outstanding.pop(response.id, None)
        if outgoing is None:  # a second answer, or one to nothing this stream sent (stray)
            self.load.accounting.answered(response.id, _stream_status(message))
            return
        self._release(response.id)
        if message.error_message:
            self.load.accounting.answered(response.id, _stream_status(message))
        else:
            self.load._accept(outgoing, response)
        if not self.outstanding:
            self.drained.set()

    async def _send(self) -> None:
        load, config = self.load, self.load.config
        loop = asyncio.get_running_loop()
        try:
            while not load._stopping.is_set():
                stopping = asyncio.ensure_future(load._stopping.wait())
                slot = asyncio.ensure_future(self.window.acquire())
                await asyncio.wait([stopping, slot], return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not slot.done() or slot.cancelled():
                    slot.cancel()
                    break
                if config.think_s:
                    await asyncio.sleep(config.think_s)
                if load._stopping.is_set() or self.call.done():
                    self.window.release()
                    break
                outgoing = load._outgoing(self.inputs, self.caller, next(self.numbers), self.tier, "stream")
                self.outstanding[outgoing.record.id] = outgoing
                self.holding.add(outgoing.record.id)
                self.drained.clear()
                loop.call_later(config.timeout_s + config.answer_grace_s, self._overdue, outgoing.record.id)
                try:
                    await self.call.write(outgoing.request)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    self.write_failed = True
                    self.outstanding.pop(outgoing.record.id, None)
                    load.accounting.unsent(outgoing.record.id)
                    raise
            if self.outstanding:
                try:
                    await asyncio.wait_for(self.drained.wait(), config.timeout_s + config.answer_grace_s)
                except TimeoutError:
                    self.gave_up = True
                    self.call.cancel()
                    return
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            return  # the stream broke: the reader sees its status


def _stream_status(message: pb.ModelStreamInferResponse) -> str:
    """A stream answer's status name: OK, or its error's (grpc_status parameter, else the message's prefix)."""
    if not message.error_message:
        return "OK"
    parameter = message.infer_response.parameters.get("grpc_status")
    if parameter is not None and parameter.string_param:
        return parameter.string_param
    return message.error_message.split(":", 1)[0] or "UNKNOWN"


def _output(response: pb.ModelInferResponse, name: str) -> np.ndarray | None:
    for i, tensor in enumerate(response.outputs):
        if tensor.name == name and tensor.datatype == "FP32" and i < len(response.raw_output_contents):
            data = response.raw_output_contents[i]
            shape = tuple(tensor.shape)
            if len(data) != 4 * int(np.prod(shape)):
                return None
            return np.frombuffer(data, dtype="<f4").reshape(shape)
    return None
