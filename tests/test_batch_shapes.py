"""A batch holds one shape: requests whose dimensions past the batch one differ
never share a batch, FIFO order within a level still holds, and a model whose
input is [-1, -1] answers requests of different widths sent together, through
a real batcher and a real model server."""

import asyncio
import json

import numpy as np
import onnx
import prometheus_client
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.batcher.config import ReplicaConfig
from services.batcher.core import Batcher, BatchingConfig
from services.batcher.replicas import ReplicaSet
from services.common.tensors import from_numpy, to_numpy
from services.model_server.config import ModelServerConfig
from services.model_server.core import ManagerConfig, ModelManager
from services.model_server.server import build_server
from tests.conftest import settle
from tests.test_batcher_core import GatedBackend


class ShapeBackend(GatedBackend):
    """Records the shape of each batch; answers each row's sum."""

    async def execute(self, model, version, inputs, outputs, timeout_s, tier=0):
        self.batches.append(list(inputs[0].shape))
        await self.gate.wait()
        x = to_numpy(inputs[0])
        return "1", [from_numpy("Y", x.sum(axis=1, keepdims=True))]


def wide(width: int, value: float = 1.0):
    return [from_numpy("X", np.full((1, width), value, dtype=np.float32))]


@pytest.mark.unit
async def test_a_request_of_another_shape_ends_the_batch_and_leads_the_next_in_fifo_order():
    backend = ShapeBackend(max_batch=8)
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, max_queue_delay_ms=200, max_queue_size=100))
    first = asyncio.create_task(batcher.submit("m", "1", wide(2), []))
    await settle()  # the model is busy with it: the next requests queue up
    widths = [3, 3, 5, 3, 5, 5]
    waiting = [asyncio.create_task(batcher.submit("m", "1", wide(w), [])) for w in widths]
    await settle()
    backend.gate.set()
    results = await asyncio.gather(first, *waiting)
    # Same-shape neighbours still share a batch; a request of another shape is
    # never passed over (it leads the next batch), and none is concatenated
    # under another's shape.
    assert backend.batches == [[1, 2], [2, 3], [1, 5], [1, 3], [2, 5]]
    assert [float(to_numpy(out[0])[0, 0]) for _, out in results] == [2.0, *map(float, widths)]


def _row_sum_repository(root):
    """A model whose input is [-1, -1]: each row's sum (ReduceSum over the last axis)."""
    folder = root / "rowsum"
    (folder / "1").mkdir(parents=True)
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["X", "axes"], ["Y"], keepdims=1)],
        "rowsum",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "width"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 1])],
        [numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "name": "rowsum",
                "platform": "onnxruntime_onnx",
                "max_batch_size": 8,
                "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, -1]}],
                "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 1]}],
            }
        )
    )
    return root


def _batches(outcome: str) -> float:
    return (
        prometheus_client.REGISTRY.get_sample_value(
            "infermesh_model_batches_total", {"model": "rowsum", "outcome": outcome}
        )
        or 0.0
    )


@pytest.mark.service
async def test_requests_of_different_widths_sent_together_are_each_answered_by_the_model(tmp_path):
    repository = _row_sum_repository(tmp_path)
    manager = ModelManager(ManagerConfig(str(repository), "cpu", 1, probe_interval_s=0))
    await manager.start()
    server, port, _ = await build_server(ModelServerConfig(model_repository=str(repository)), manager, port=0)
    replicas = ReplicaSet(ReplicaConfig((f"127.0.0.1:{port}",), 4, 60.0, 1 << 24))
    batcher = Batcher(replicas, BatchingConfig(max_batch_size=8, max_queue_delay_ms=50))
    try:
        await replicas.start()
        failed_before, ok_before = _batches("error"), _batches("ok")
        three = np.arange(3, dtype=np.float32).reshape(1, 3)  # 0 + 1 + 2
        five = np.arange(10, 15, dtype=np.float32).reshape(1, 5)  # 10 + ... + 14
        answers = await asyncio.gather(
            batcher.submit("rowsum", "", [from_numpy("X", three)], [], timeout_s=30),
            batcher.submit("rowsum", "", [from_numpy("X", five)], [], timeout_s=30),
        )
        assert [to_numpy(outputs[0]).tolist() for _, outputs in answers] == [[[3.0]], [[60.0]]]
        # Each ran as a batch of its own shape: none was concatenated under the
        # other's shape, failed at the model server and was run again alone.
        assert _batches("error") == failed_before and _batches("ok") == ok_before + 2
    finally:
        await batcher.close()
        await replicas.close()
        await server.stop(0)
        await manager.close()
