"""The benchmarks' unique-text workload: the texts ghz renders from the template
are the texts the in-process baselines embed (one generator for both sides)."""

import asyncio
import re

import grpc
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from bench.workload import ghz_texts, ghz_unique_template
from services.common.tensors import split_bytes_elements
from tests.conftest import ROOT

PROTO = ROOT / "protos" / "inference" / "grpc_predict_v2.proto"
WORKER = re.compile(r"-(g\d+c\d+)\)$")


class Recorder(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self):
        self.texts: list[str] = []

    async def ModelInfer(self, request, context):
        if request.raw_input_contents:
            self.texts += [t.decode() for t in split_bytes_elements(request.raw_input_contents[0], "TEXT")]
        else:
            self.texts += [t.decode() for t in request.inputs[0].contents.bytes_contents]
        return pb.ModelInferResponse(model_name=request.model_name)


@pytest.mark.service
async def test_ghz_renders_exactly_the_texts_the_baseline_embeds(ghz_binary):
    recorder = Recorder()
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        ghz = await asyncio.create_subprocess_exec(
            str(ghz_binary),
            "--insecure",
            "--proto",
            str(PROTO),
            "--import-paths",
            str(PROTO.parent.parent),
            "--call",
            "inference.GRPCInferenceService.ModelInfer",
            "-d",
            ghz_unique_template("t1"),
            "--total",
            "40",
            "--concurrency",
            "8",
            "--connections",
            "2",
            f"127.0.0.1:{port}",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(ghz.communicate(), 120)
        assert ghz.returncode == 0, stderr.decode()
    finally:
        await server.stop(None)
    expected = ghz_texts("t1", 40, callers=8, connections=2)
    # Which worker takes which request number is ghz's scheduling; the rest is fixed.
    assert sorted(WORKER.sub(")", t) for t in recorder.texts) == sorted(WORKER.sub(")", t) for t in expected)
    workers = {WORKER.search(t).group(1) for t in recorder.texts}
    assert workers <= {WORKER.search(t).group(1) for t in expected} and len(workers) > 1


@pytest.mark.unit
@pytest.mark.parametrize("count", [1, 100])
def test_the_generator_gives_distinct_texts(count):
    texts = ghz_texts("x", count)
    assert len(set(texts)) == count
