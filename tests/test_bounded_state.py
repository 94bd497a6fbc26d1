"""Nothing a service keeps, keyed by a name a caller sends, grows without
bound: many distinct model names, versions and priorities sent to the model
server and the batcher leave their state (and metric series) as bounded as
before. (The cache's models: tests/test_cache_generations.py.)"""

import grpc
import numpy as np
import prometheus_client
import pytest
from infermesh.model_server.v1 import model_server_pb2

from services.batcher.core import Batcher, BatchingConfig
from services.common import errors
from services.common.protoconv import tensors_to_proto
from services.common.tensors import from_numpy
from services.model_server.execution import MAX_TIERS_SEEN
from tests.test_batcher_core import GatedBackend
from tests.test_model_repository import ROWS, model_server, repo  # noqa: F401 - the mlp repository fixture

NAMES = 300


def _series(metric: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in prometheus_client.REGISTRY.collect()
        if family.name == metric
        for sample in family.samples
        if label in sample.labels
    }


@pytest.mark.service
async def test_unknown_model_names_sent_to_the_model_server_add_one_series_at_most(repo):
    async with model_server(repo) as server:
        before = _series("infermesh_model_batches", "model")
        for i in range(NAMES):
            request = model_server_pb2.ExecuteRequest(
                model=f"no-such-model-{i}", inputs=tensors_to_proto([from_numpy("INPUT0", ROWS, "FP32")])
            )
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await server.models.Execute(request, timeout=30)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert _series("infermesh_model_batches", "model") - before <= {"unknown"}
        assert server.manager.loaded_names() == ["mlp"] and not server.manager.is_known("no-such-model-0")


@pytest.mark.service
async def test_distinct_priorities_sent_to_the_model_server_are_remembered_boundedly(repo):
    async with model_server(repo) as server:
        for tier in range(0, 2**31 - 1, (2**31 - 1) // NAMES):  # an enum field: int32 values
            request = model_server_pb2.ExecuteRequest(
                model="mlp", tier=tier, inputs=tensors_to_proto([from_numpy("INPUT0", ROWS, "FP32")])
            )
            await server.models.Execute(request, timeout=30)
        loaded = server.manager.resolve("mlp", "")
        assert len(loaded._seen_at) <= MAX_TIERS_SEEN  # the state under test
        assert (await server.execute())[0] == "1"


@pytest.mark.unit
async def test_unknown_model_names_and_versions_sent_to_the_batcher_get_no_queue():
    batcher = Batcher(GatedBackend(max_batch=4), BatchingConfig(max_batch_size=4, max_queue_delay_ms=1))
    inputs = [from_numpy("X", np.zeros((1, 2), np.float32))]
    for i in range(NAMES):
        with pytest.raises(errors.Unavailable):
            await batcher.submit(f"model-{i}", "", inputs, [], timeout_s=5)
    assert batcher._queues == {} and batcher._slots == {}  # the state under test
