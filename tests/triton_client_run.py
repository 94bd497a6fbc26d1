"""Runs tritonclient.grpc against a router and writes what it saw as JSON.

A separate process because tritonclient's generated module and ours define
the same protobuf names, and one process's descriptor pool holds only one.
Usage: python tests/triton_client_run.py ADDRESS TEXTS_JSON OUT_NPZ [CA_PEM CERT_PEM KEY_PEM]
(with the last three, over mutual TLS).
"""

import json
import pathlib
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def main() -> int:
    address, texts_path, out_path = sys.argv[1:4]
    texts = json.loads(pathlib.Path(texts_path).read_text())
    # Without the three TLS arguments the client calls in plaintext: no pairs.
    tls = dict(zip(("root_certificates", "certificate_chain", "private_key"), sys.argv[4:7], strict=False))
    client = grpcclient.InferenceServerClient(url=address, ssl=bool(tls), **tls)
    facts = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready("minilm"),
        "metadata": client.get_model_metadata("minilm", as_json=True),
        "server": client.get_server_metadata(as_json=True),
    }

    # Unary: the whole batch in one request, as typed BYTES.
    batch = grpcclient.InferInput("TEXT", [len(texts)], "BYTES")
    batch.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    result = client.infer("minilm", [batch], outputs=[grpcclient.InferRequestedOutput("EMBEDDING")])
    unary = result.as_numpy("EMBEDDING")

    # Streaming: one request per text, answers correlated by id.
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for i, text in enumerate(texts):
        one = grpcclient.InferInput("TEXT", [1], "BYTES")
        one.set_data_from_numpy(np.array([text.encode()], dtype=object))
        client.async_stream_infer("minilm", [one], request_id=str(i))
    streamed = np.zeros_like(unary)
    for _ in texts:
        result, error = answers.get(timeout=60)
        if error is not None:
            raise error
        streamed[int(result.get_response().id)] = result.as_numpy("EMBEDDING")[0]
    # A bad request on the stream is answered with an error; the stream lives on.
    bad = grpcclient.InferInput("TEXT", [1], "FP32")
    bad.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    client.async_stream_infer("minilm", [bad], request_id="bad")
    _, stream_error = answers.get(timeout=60)
    client.stop_stream()

    try:
        client.infer("no-such-model", [batch])
        unknown_error = ""
    except InferenceServerException as exc:
        unknown_error = f"{exc.status()} {exc.message()}"
    facts["stream_error"] = str(stream_error)
    facts["unknown_error"] = unknown_error
    np.savez(out_path, unary=unary, streamed=streamed, facts=json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
