"""minilm and mlp on ONNX Runtime for the peer servers, prepared as the mesh's
model server prepares them: the same graph files, and for minilm the same
tokenizer, truncation and padding (to the longest text of each batch), all
read from the model's config.json.

The peers run in their own virtual environments (bench/peers/*.txt), so this
module imports only what those install, nothing of the project's.
"""

import json
import os
import pathlib

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer


def session(path: pathlib.Path, threads: int | None) -> ort.InferenceSession:
    """A CPU session with `threads` intra-op threads (default one per core this
    process may run on) that do not spin, as the mesh's model server makes them:
    the server's other threads and the load generator share these cores."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or len(os.sched_getaffinity(0)) or 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class Minilm:
    """TEXT (UTF-8 strings) -> EMBEDDING FP32 [N, 384]."""

    def __init__(self, model_dir: pathlib.Path, threads: int | None = None):
        config = json.loads((model_dir / "config.json").read_text())
        version = model_dir / "1"
        self._session = session(version / "model.onnx", threads)
        self._tokenizer = Tokenizer.from_file(str(version / config["preprocess"]["tokenizer_file"]))
        self._tokenizer.enable_truncation(max_length=config["preprocess"]["max_length"])
        self._tokenizer.enable_padding()
        self._output = config["graph_outputs"]["EMBEDDING"]

    def embed(self, texts: list[str]) -> np.ndarray:
        encodings = self._tokenizer.encode_batch(texts)
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        return self._session.run([self._output], feeds)[0]


class Mlp:
    """INPUT0 FP32 [N, 64] -> OUTPUT0 FP32 [N, 64]."""

    def __init__(self, model_dir: pathlib.Path, threads: int | None = None):
        self._session = session(model_dir / "1" / "model.onnx", threads)

    def run(self, inputs: np.ndarray) -> np.ndarray:
        return self._session.run(["OUTPUT0"], {"INPUT0": inputs.astype(np.float32, copy=False)})[0]
