"""bench.chaos_load: against a healthy mesh every request gets exactly one right
answer; against a server that drops, doubles and misanswers, and in the
accounting alone, what is lost, doubled, wrong or stray is counted."""

import grpc
import numpy as np
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from bench.chaos_load import STATUS_LOST, Accounting, ChaosLoad, LoadConfig, Reference, Sample, recovery
from tests.conftest import MODELS


@pytest.mark.e2e
async def test_a_healthy_mesh_answers_every_request_once_and_right(mesh):
    config = LoadConfig(
        callers=4,
        stream_share=0.5,
        stream_window=4,
        vip_share=0.5,
        mlp_share=0.3,
        repeat_share=0.2,
        check_every=10,
        timeout_s=30,
        seed=7,
    )
    load = ChaosLoad(
        mesh.router, config, {"vip": mesh.credentials("dev-vip"), "standard": mesh.credentials("dev-standard")}
    )
    result = await load.run(duration_s=10)
    totals = result.totals
    assert totals["sent"] > 50
    assert totals["ok"] == totals["sent"], totals
    assert (totals["unanswered"], totals["twice"], totals["wrong"], totals["stray"]) == (0, 0, 0, 0), totals
    assert totals["stream_failed"] == {} and totals["by_status"] == {"OK": totals["sent"]}
    assert totals["checked"] > 0
    records = result.accounting.records.values()
    # The mix was sent: both kinds, both tiers, both models, repeats among them.
    assert {(r.kind, r.tier) for r in records} == {(k, t) for k in ("unary", "stream") for t in ("vip", "standard")}
    assert {r.model for r in records} == {"minilm", "mlp"}
    assert any(r.repeat for r in records) and all(r.checked for r in records if r.repeat)
    assert sum(b["ok"] for b in result.buckets) == totals["ok"]
    assert sum(b["sent"] for b in result.buckets) == totals["sent"]
    assert all(b["p99_ms"] >= b["p50_ms"] > 0 for b in result.buckets if b["ok"])


@pytest.mark.unit
def test_the_accounting_counts_a_duplicate_a_missing_answer_a_stream_error_and_a_stray():
    accounting = Accounting()
    for i in range(6):
        accounting.sent(f"r{i}", "minilm", "vip", "stream", at=100.0 + i)
    accounting.answered("r0", "OK", at=101.0)
    accounting.answered("r1", "OK", at=102.0)
    accounting.answered("r1", "OK", at=102.5)  # forged: the same id answered again
    accounting.answered("r2", "RESOURCE_EXHAUSTED", at=103.0)
    accounting.stream_ended(["r3"], "OK", at=104.0)  # ended OK with r3 outstanding: r3 is lost
    accounting.stream_ended(["r4", "r5"], "UNAVAILABLE", at=105.0)
    accounting.answered("r5", "OK", at=105.5)  # an answer after all: not a stream failure
    accounting.answered("nobody", "OK", at=106.0)
    totals = accounting.totals()
    assert totals["sent"] == 6
    assert totals["by_status"] == {"OK": 3, "RESOURCE_EXHAUSTED": 1}
    assert totals["unanswered"] == 1 and accounting.unanswered_ids() == ["r3"]
    assert totals["stream_failed"] == {"UNAVAILABLE": 1}
    assert totals["twice"] == 1 and totals["stray"] == 1
    assert (
        totals["sent"]
        == sum(totals["by_status"].values()) + sum(totals["stream_failed"].values()) + totals["unanswered"]
    )
    assert accounting.totals(sent_from=103.0)["sent"] == 3  # r3, r4, r5
    with pytest.raises(ValueError, match="'r0' was sent twice"):
        accounting.sent("r0", "minilm", "vip", "stream")


@pytest.mark.unit
def test_the_reference_catches_a_wrong_answer_and_a_missing_version():
    reference = Reference(MODELS, threads=1)
    rows = [np.random.default_rng(i).standard_normal(64).astype(np.float32) for i in range(3)]
    right = reference.outputs("mlp", "1", rows)
    accounting = Accounting()
    for i in range(4):
        accounting.sent(f"m{i}", "mlp", "standard", "unary")
        accounting.answered(f"m{i}", "OK")
    accounting.keep_sample("m0", Sample("mlp", "1", rows[0], right[0]))
    accounting.keep_sample("m1", Sample("mlp", "1", rows[1], right[1] + 1e-3))  # off by more than the tolerance
    accounting.keep_sample("m2", Sample("mlp", "1", rows[2], right[0]))  # another input's answer
    accounting.keep_sample("m3", Sample("mlp", "9", rows[0], right[0]))
    assert accounting.check(reference) == 3
    totals = accounting.totals()
    assert (totals["checked"], totals["wrong"]) == (4, 3)
    assert not accounting.records["m0"].wrong
    assert "differs by up to" in accounting.records["m1"].wrong
    assert "version '9'" in accounting.records["m3"].wrong


@pytest.mark.unit
def test_recovery_times_after_a_fault():
    accounting = Accounting()
    accounting.started = 0.0
    n = 0

    def request(sent: float, latency: float, status: str = "OK") -> None:
        nonlocal n
        n += 1
        accounting.sent(f"q{n}", "mlp", "vip", "unary", at=sent)
        accounting.answered(f"q{n}", status, at=sent + latency)

    for i in range(100):  # before the fault at t=10: 10 ms each
        request(i * 0.1, 0.010)
    for i in range(10):  # the fault: fast errors for 1 s
        request(10 + i * 0.1, 0.001, "UNAVAILABLE")
    request(10.95, 0.5)  # the first good answer, at 11.45, slow
    for i in range(30):  # then 12 ms each: within 1.5x
        request(11.5 + i * 0.1, 0.012)
    got = recovery(accounting, fault_at=10.0)
    assert got["p99_before_ms"] == pytest.approx(10.0)
    assert got["first_ok_s"] == pytest.approx(1.45)
    # The first all-OK 1 s window past the slow answer, with 5 answers at least.
    assert 2.4 <= got["p99_back_s"] <= 2.6
    assert recovery(accounting, fault_at=20.0)["p99_back_s"] is None  # no answers after it
    # A baseline taken elsewhere: the slow stretch after the fault is then normal.
    slow_baseline = recovery(accounting, fault_at=10.0, baseline_s=1.0, baseline_until=11.5)
    assert slow_baseline["p99_before_ms"] == pytest.approx(500.0)
    assert slow_baseline["p99_back_s"] == pytest.approx(2.0, abs=0.01)  # the first window past the errors
    buckets = accounting.buckets()
    assert buckets[10]["status"] == {"UNAVAILABLE": 10} and buckets[10]["ok"] == 0
    assert buckets[0]["p50_ms"] == pytest.approx(10.0)


class Misbehaving(pb_grpc.GRPCInferenceServiceServicer):
    """An OIP server that breaks the rules the load counts: on streams it drops
    some requests, answers others twice, ends every stream OK after a few
    requests and every third one with UNAVAILABLE; unary answers are all
    zeros, every fourth under another id."""

    def __init__(self):
        self.answers: dict[str, int] = {}  # request id -> answers given
        self.streams = 0
        self.calls = 0

    @staticmethod
    def answer(request, request_id=None):
        response = pb.ModelInferResponse(
            model_name=request.model_name, model_version="1", id=request.id if request_id is None else request_id
        )
        response.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 64])
        response.raw_output_contents.append(np.zeros(64, "<f4").tobytes())
        return response

    async def ModelInfer(self, request, context):
        self.calls += 1
        self.answers[request.id] = self.answers.get(request.id, 0) + 1
        return self.answer(request, "someone-else" if self.calls % 4 == 0 else None)

    async def ModelStreamInfer(self, request_iterator, context):
        self.streams += 1
        aborts = self.streams % 3 == 0
        read = 0
        async for request in request_iterator:
            read += 1
            self.answers.setdefault(request.id, 0)
            if read % 7 == 3:
                continue  # dropped
            for _ in range(2 if read % 5 == 1 else 1):
                self.answers[request.id] += 1
                yield pb.ModelStreamInferResponse(infer_response=self.answer(request))
            if read == 12:
                if aborts:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
                return


@pytest.mark.service
async def test_the_load_counts_what_a_misbehaving_server_does():
    servicer = Misbehaving()
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        config = LoadConfig(
            callers=4,
            stream_share=0.5,
            stream_window=3,
            mlp_share=1.0,
            repeat_share=0.2,
            check_every=1,
            timeout_s=1.0,
            answer_grace_s=0.2,
            reconnect_pause_s=0.01,
            seed=3,
        )
        load = ChaosLoad(
            f"127.0.0.1:{port}",
            config,
            {"vip": (("authorization", "Bearer v"),), "standard": (("authorization", "Bearer s"),)},
            reference=Reference(MODELS, threads=1),
        )
        result = await load.run(duration_s=2)
    finally:
        await server.stop(None)
    records = result.accounting.records
    totals = result.totals
    assert servicer.streams >= 3 and totals["sent"] == len(records)
    never = {i for i, r in records.items() if servicer.answers.get(i, 0) == 0}
    lost = {i for i, r in records.items() if r.is_unanswered}
    failed = {i for i, r in records.items() if r.stream_error and r.stream_error != STATUS_LOST}
    status_lost = {i for i, r in records.items() if r.stream_error == STATUS_LOST}
    unsent = {i for i, r in records.items() if r.unsent}
    # Every request the server left unanswered, and no other; none it never read was counted as sent to it.
    assert never == lost | failed | status_lost | unsent and lost and failed
    assert not unsent & set(servicer.answers)
    twice = {i for i, count in servicer.answers.items() if count > 1}
    assert twice and totals["twice"] == len(twice)
    assert totals["unanswered"] == len(lost) and totals["stream_failed"] == {"UNAVAILABLE": len(failed)}
    assert (totals["status_lost"], totals["unsent"]) == (len(status_lost), len(unsent))
    # Every answered request was checked; zeros are wrong, and so is another id's answer.
    answered = [r for r in records.values() if r.answers]
    assert totals["wrong"] == len(answered) and totals["checked"] > 0
    assert any("id 'someone-else'" in r.wrong for r in answered)
