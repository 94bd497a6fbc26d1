"""minilm and mlp served by PyTriton: Triton Inference Server's gRPC front end
and dynamic batcher in front of ONNX Runtime Python callables. A peer for
bench/peers.py; run it with the PyTriton virtual environment's python (make
peers), not the project's: PyTriton needs numpy<2.

    .venv-peers/pytriton/bin/python bench/peers/pytriton_server.py --models build/models \
        --grpc-port 8101 --http-port 8100 --metrics-port 8102

Serves the mesh's graph files with the mesh's preprocessing (onnx_models.py).
The callables run in this process, not in Triton's: tritonserver is a child
process, and for each model its Python backend starts a stub process that
hands every batch to this one and takes the answer back (ZeroMQ for control,
shared memory for the tensors). Triton's batching needs a batch dimension in
front of each request's sample shape, and a sample's dims may not be empty:
minilm takes TEXT BYTES [N, 1] here (the mesh takes [N]) and answers
EMBEDDING FP32 [N, 384]. Each model is served in two layouts, under two names:
`<model>_shared`, one instance (one callable) whose ONNX Runtime session has an
intra-op thread per core, and `<model>_split`, one instance per core (a list of
callables: PyTriton's multi-instance binding), each session with one thread.
Every port binds 127.0.0.1.

Prints one JSON line {"ready": true, ...} on stdout once Triton says every
model is ready (everything else, Triton's log included, goes to stderr), then
serves until SIGTERM or SIGINT and stops Triton, which removes its workspace
and shared memory.
"""

import argparse
import json
import os
import pathlib
import signal
import sys
import sysconfig
import tempfile
import time

import numpy as np
import tritonclient.grpc
from onnx_models import Minilm, Mlp
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def minilm_callable(model_dir: pathlib.Path, threads: int | None):
    model = Minilm(model_dir, threads)

    @batch  # Triton's batch of requests arrives as one stacked array per input
    def infer(TEXT: np.ndarray) -> dict[str, np.ndarray]:  # the tensor's name
        return {"EMBEDDING": model.embed([t.decode() for t in TEXT.reshape(-1)])}

    return infer


def mlp_callable(model_dir: pathlib.Path, threads: int | None):
    model = Mlp(model_dir, threads)

    @batch
    def infer(INPUT0: np.ndarray) -> dict[str, np.ndarray]:  # the tensor's name
        return {"OUTPUT0": model.run(INPUT0)}

    return infer


def wait_ready(address: str, models: tuple[str, ...], timeout_s: float) -> None:
    """Returns once Triton's gRPC front end says every model is ready; raises TimeoutError."""
    client = tritonclient.grpc.InferenceServerClient(address)
    deadline = time.monotonic() + timeout_s
    try:
        while not all(client.is_model_ready(name) for name in models):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Triton at {address} did not have {models} ready within {timeout_s:.0f}s")
            time.sleep(0.2)
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=pathlib.Path, required=True, help="the built model repository")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    parser.add_argument("--intra-op-threads", type=int, default=None, help="ONNX Runtime's; default one per core")
    args = parser.parse_args()

    # The ready line is the only thing on stdout: whoever started us may read
    # nothing more from that pipe, and Triton (a child) would block on a full one.
    announce = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    # Triton runs Python models through a stub linked against libpython3.11.so.1.0:
    # the loader must find this interpreter's, not another 3.11 build's (a system
    # one, whose standard library differs, makes the stub fail at start).
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = ":".join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))

    # PyTriton stops Triton cleanly on KeyboardInterrupt only; SIGTERM is how we are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    batcher = DynamicBatcher(max_queue_delay_microseconds=int(args.max_queue_delay_ms * 1000))
    model_config = ModelConfig(max_batch_size=args.max_batch_size, batcher=batcher)
    triton_config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        http_address="127.0.0.1",
        http_port=args.http_port,
        metrics_address="127.0.0.1",
        metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
    )
    grpc_address = f"127.0.0.1:{args.grpc_port}"
    cores = len(os.sched_getaffinity(0)) or 1
    layouts = {"shared": (1, args.intra_op_threads), "split": (cores, 1)}  # name -> (instances, threads each)
    signatures = {
        "minilm": (
            minilm_callable,
            [Tensor(name="TEXT", dtype=bytes, shape=(1,))],
            [Tensor(name="EMBEDDING", dtype=np.float32, shape=(384,))],
        ),
        "mlp": (
            mlp_callable,
            [Tensor(name="INPUT0", dtype=np.float32, shape=(64,))],
            [Tensor(name="OUTPUT0", dtype=np.float32, shape=(64,))],
        ),
    }
    names = tuple(f"{model}_{layout}" for model in signatures for layout in layouts)
    try:
        # PyTriton's ZeroMQ sockets live in the workspace, and a Unix socket's path may not pass
        # 107 bytes: a short folder in /tmp, whatever TMPDIR says, keeps every model's socket within.
        with (
            tempfile.TemporaryDirectory(prefix="pt", dir="/tmp") as workspace,
            Triton(config=triton_config, workspace=pathlib.Path(workspace) / "workspace") as triton,
        ):
            for model, (make, inputs, outputs) in signatures.items():
                for layout, (instances, threads) in layouts.items():
                    callables = [make(args.models / model, threads) for _ in range(instances)]
                    triton.bind(
                        model_name=f"{model}_{layout}",
                        infer_func=callables if instances > 1 else callables[0],
                        inputs=inputs,
                        outputs=outputs,
                        config=model_config,
                    )
            wait_ready(grpc_address, names, timeout_s=180)
            print(json.dumps({"ready": True, "grpc": grpc_address, "pid": os.getpid()}), file=announce, flush=True)
            announce.close()
            triton.serve()  # blocks until SIGINT or SIGTERM (or Triton dies), then stops Triton
    except KeyboardInterrupt:
        pass  # a signal before serve(): the context managers have stopped Triton
    return 0


if __name__ == "__main__":
    sys.exit(main())
