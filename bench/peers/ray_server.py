"""minilm and mlp served by Ray Serve: its gRPC proxy in front of one replica
per model, which batches calls with @serve.batch and runs ONNX Runtime. A peer
for bench/peers.py; run it with the Ray virtual environment's python (make
peers), with the Open Inference Protocol stubs importable (PYTHONPATH=gen):

    ip netns exec NS env PYTHONPATH=gen .venv-peers/ray/bin/python bench/peers/ray_server.py \
        --models build/models --grpc-port 9000 --http-port 8000 --temp-dir /tmp/ray-x

Ray and Serve's gRPC proxy bind every interface: run this in a network
namespace of its own that has only loopback (bench/peers.py does). Each model
is a Serve application named as the model; the proxy routes a call by its
`application` metadata. Prints one JSON line {"ready": true, ...} once each
application has answered a ModelInfer through the proxy (everything else goes
to stderr), then serves until SIGTERM or SIGINT and shuts Serve and Ray down.

Each model is served in two layouts, as two applications: `<model>_shared`,
one replica whose ONNX Runtime session has an intra-op thread per core, and
`<model>_split`, one replica per core, each session with one thread. A replica
batches up to --max-batch-size calls or --max-queue-delay-ms (one batch at a
time per replica, Serve's default) and runs them on ONNX Runtime in a thread of
its own. Ray's logical CPUs are not a limit here (each replica asks for a
share small enough that all of them fit): the cores are shared as the other
servers share them. Every call of the benchmark carries one item, so a batch of
calls is a batch of rows.
"""

import argparse
import asyncio
import concurrent.futures
import json
import os
import pathlib
import signal
import struct
import sys
import threading

import grpc
import numpy as np
import ray
from onnx_models import Minilm, Mlp
from ray import serve

SERVICER = "inference.grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"


def decode_texts(request) -> list[str]:
    """TEXT's strings, sent either as bytes_contents or as raw_input_contents
    (4-byte little-endian length, then the bytes, per element)."""
    tensor = request.inputs[0]
    if tensor.contents.bytes_contents:
        return [b.decode() for b in tensor.contents.bytes_contents]
    raw, texts, at = request.raw_input_contents[0], [], 0
    while at < len(raw):
        (length,) = struct.unpack_from("<I", raw, at)
        texts.append(raw[at + 4 : at + 4 + length].decode())
        at += 4 + length
    return texts


def decode_fp32(request) -> np.ndarray:
    tensor = request.inputs[0]
    if tensor.contents.fp32_contents:
        values = np.array(tensor.contents.fp32_contents, dtype=np.float32)
    else:
        values = np.frombuffer(request.raw_input_contents[0], dtype="<f4")
    return values.reshape(tuple(tensor.shape))


def fp32_response(request, name: str, array: np.ndarray):
    from inference import grpc_predict_v2_pb2 as pb  # importable in the replica, from PYTHONPATH

    response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
    response.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
    response.raw_output_contents.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return response


def check(request, model: str, tensor: str, datatype: str, grpc_context) -> bool:
    """Whether the call is for this model with its one input; if not, the call
    gets INVALID_ARGUMENT (the proxy sends the status set on the context)."""
    if (
        request.model_name == model
        and len(request.inputs) == 1
        and request.inputs[0].name == tensor
        and request.inputs[0].datatype == datatype
    ):
        return True
    grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
    grpc_context.set_details(f"this application serves model {model!r} with one input {tensor} {datatype}")
    return False


# max_ongoing_requests bounds what the proxy sends a replica at once; Serve's
# default (5) would cap every batch at 5, so it is well above the batch size.
@serve.deployment(num_replicas=1, max_ongoing_requests=256)
class MinilmDeployment:
    def __init__(self, model_dir: str, threads: int | None, max_batch_size: int, max_queue_delay_ms: float):
        self._model = Minilm(pathlib.Path(model_dir), threads)
        # One thread for the model, off the replica's event loop, so that calls
        # keep joining the next batch while one runs (as in the mesh).
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self.embed.set_max_batch_size(max_batch_size)
        self.embed.set_batch_wait_timeout_s(max_queue_delay_ms / 1000)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)  # both set from the command line in __init__
    async def embed(self, calls: list[list[str]]) -> list[np.ndarray]:
        texts = [t for call in calls for t in call]
        embeddings = await asyncio.get_running_loop().run_in_executor(self._pool, self._model.embed, texts)
        ends = np.cumsum([len(call) for call in calls])
        return np.split(embeddings, ends[:-1])

    async def ModelInfer(self, request, grpc_context):  # the RPC's name, which the proxy calls
        if not check(request, "minilm", "TEXT", "BYTES", grpc_context):
            return fp32_response(request, "EMBEDDING", np.zeros((0, 384), np.float32))
        return fp32_response(request, "EMBEDDING", await self.embed(decode_texts(request)))


@serve.deployment(num_replicas=1, max_ongoing_requests=256)
class MlpDeployment:
    def __init__(self, model_dir: str, threads: int | None, max_batch_size: int, max_queue_delay_ms: float):
        self._model = Mlp(pathlib.Path(model_dir), threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self.run.set_max_batch_size(max_batch_size)
        self.run.set_batch_wait_timeout_s(max_queue_delay_ms / 1000)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
    async def run(self, calls: list[np.ndarray]) -> list[np.ndarray]:
        outputs = await asyncio.get_running_loop().run_in_executor(self._pool, self._model.run, np.concatenate(calls))
        ends = np.cumsum([len(call) for call in calls])
        return np.split(outputs, ends[:-1])

    async def ModelInfer(self, request, grpc_context):  # the RPC's name, which the proxy calls
        if not check(request, "mlp", "INPUT0", "FP32", grpc_context):
            return fp32_response(request, "OUTPUT0", np.zeros((0, 64), np.float32))
        return fp32_response(request, "OUTPUT0", await self.run(decode_fp32(request)))


def probe(address: str, timeout_s: float) -> None:
    """One ModelInfer per application through the proxy; raises unless all answer."""
    from inference import grpc_predict_v2_pb2 as pb
    from inference import grpc_predict_v2_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="minilm")
        request.inputs.add(name="TEXT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"ready?")
        mlp = pb.ModelInferRequest(model_name="mlp")
        mlp.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend([0.0] * 64)
        for layout in ("shared", "split"):
            answer = stub.ModelInfer(request, timeout=timeout_s, metadata=[("application", f"minilm_{layout}")])
            assert list(answer.outputs[0].shape) == [1, 384], answer
            answer = stub.ModelInfer(mlp, timeout=timeout_s, metadata=[("application", f"mlp_{layout}")])
            assert list(answer.outputs[0].shape) == [1, 64], answer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=pathlib.Path, required=True, help="the built model repository")
    parser.add_argument("--grpc-port", type=int, default=9000)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--temp-dir", type=pathlib.Path, required=True, help="Ray's session files and logs")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    parser.add_argument("--intra-op-threads", type=int, default=None, help="ONNX Runtime's; default one per core")
    parser.add_argument(
        "--object-store-mb", type=int, default=200, help="Ray's object store (nothing large goes there)"
    )
    args = parser.parse_args()

    # The ready line is the only thing on stdout: whoever started us may read
    # nothing more from that pipe, and Ray's processes (children) would block on a full one.
    announce = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    # Ray's workers (the proxy's and the replicas') import the stubs and
    # onnx_models.py by name: they inherit this environment from the raylet.
    here = str(pathlib.Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=len(os.sched_getaffinity(0)),
        include_dashboard=False,
        _temp_dir=str(args.temp_dir.resolve()),
        object_store_memory=args.object_store_mb * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
    )
    # After ray.init, which installs its own SIGTERM handler (one that exits at once).
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": args.http_port},
            grpc_options={"port": args.grpc_port, "grpc_servicer_functions": [SERVICER]},
        )
        cores = len(os.sched_getaffinity(0)) or 1
        for model, deployment in (("minilm", MinilmDeployment), ("mlp", MlpDeployment)):
            for layout, replicas, threads in (("shared", 1, args.intra_op_threads), ("split", cores, 1)):
                app = f"{model}_{layout}"
                bound = deployment.options(num_replicas=replicas, ray_actor_options={"num_cpus": 0.1}).bind(
                    str((args.models / model).resolve()), threads, args.max_batch_size, args.max_queue_delay_ms
                )
                serve.run(bound, name=app, route_prefix=f"/{app}")
        address = f"127.0.0.1:{args.grpc_port}"
        probe(address, timeout_s=30)
        print(json.dumps({"ready": True, "grpc": address, "pid": os.getpid()}), file=announce, flush=True)
        announce.close()
        while not stopping.wait(1.0):
            pass
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
