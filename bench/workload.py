"""Deterministic, unique customer-service texts of about 16 tokens, shared by
every benchmark so the mesh and the in-process baseline see the same work, and
the one way the benchmarks run ghz with them."""

import base64
import json
import os
import pathlib
import random
import shutil
import subprocess

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

SUBJECTS = [
    "my order",
    "the invoice",
    "my account",
    "the delivery",
    "my refund",
    "the app",
    "my password",
    "the subscription",
    "the parcel",
    "my card",
    "the discount code",
    "the warranty",
]
PROBLEMS = [
    "has not arrived yet",
    "shows the wrong amount",
    "was charged twice",
    "stopped working this morning",
    "cannot be changed online",
    "is missing an item",
    "was cancelled without notice",
    "keeps asking me to log in",
    "is stuck in processing",
    "was sent to the wrong address",
]
ASKS = [
    "what should I do",
    "can you help me",
    "please advise",
    "how long will it take",
    "who can I talk to",
    "is there a fix",
    "can I get a refund",
    "when will it be solved",
]


def texts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct texts; a different seed gives a disjoint set."""
    rng = random.Random(seed)
    return [
        f"Hello, {rng.choice(SUBJECTS)} {rng.choice(PROBLEMS)}, {rng.choice(ASKS)}? (case {seed}-{i})"
        for i in range(count)
    ]


def ghz_data(items: list[str], model: str = "minilm") -> str:
    """A ghz --data-file body: one ModelInfer message per text, sent round-robin."""
    return json.dumps(
        [
            {
                "model_name": model,
                "inputs": [
                    {
                        "name": "TEXT",
                        "datatype": "BYTES",
                        "shape": [1],
                        "contents": {"bytes_contents": [base64.b64encode(t.encode()).decode()]},
                    }
                ],
            }
            for t in items
        ]
    )


ROOT = pathlib.Path(__file__).resolve().parent.parent
GHZ = ROOT / "bin" / "ghz"


def minilm_instances_repository(work: pathlib.Path, count: int) -> pathlib.Path:
    """A copy of the built repository whose minilm has `count` instances
    (model files are hard links: the copy costs no disk)."""
    models = work / f"models-{count}"
    shutil.copytree(ROOT / "build" / "models", models, copy_function=_link_or_copy)
    config_path = models / "minilm" / "config.json"
    config = json.loads(config_path.read_text())
    config["instances"] = {"count": count}
    config_path.unlink()  # a hard link: writing through it would change the original
    config_path.write_text(json.dumps(config, indent=2))
    return models


def _link_or_copy(source: str, target: str) -> None:
    try:
        pathlib.Path(target).hardlink_to(source)
    except OSError:
        shutil.copy2(source, target)


def run_ghz(
    address: str,
    data: str,
    total: int,
    concurrency: int,
    rps: float = 0,
    timeout_s: float | None = None,
    key: str | None = None,
    seconds: float | None = None,
) -> dict:
    """ghz's JSON report of `total` unary ModelInfer calls with body `data` (a -d
    template), or with `seconds` of them (a closed loop lasts what was asked,
    whatever the rate; calls still in flight at the end are not counted):
    `concurrency` workers over up to 4 connections, at `rps` per second if
    given, presenting a tenant's bearer `key` if given (a VIP tenant's for VIP
    traffic: the tier comes from the caller's identity)."""
    argv = [
        str(GHZ),
        "--insecure",
        "--call",
        "inference.GRPCInferenceService.ModelInfer",
        "-d",
        data,
        "--concurrency",
        str(concurrency),
        "--connections",
        str(min(concurrency, 4)),
        "--format",
        "json",
    ]
    argv += (
        ["--duration", f"{seconds:g}s", "--duration-stop", "ignore"] if seconds is not None else ["--total", str(total)]
    )
    if timeout_s is not None:
        argv += ["--timeout", f"{timeout_s:g}s"]
    if rps:
        argv += ["--rps", str(max(1, int(rps)))]  # ghz takes whole requests a second; 0 would mean no limit
    if key is not None:
        argv += ["-m", json.dumps({"authorization": f"Bearer {key}"})]
    return json.loads(subprocess.run([*argv, address], capture_output=True, text=True, check=True, timeout=900).stdout)


# The text of every call of the unique-text workloads, with the request number and
# ghz's worker id: ghz renders it per call (ghz_unique_template), and the in-process
# baselines embed the same texts (ghz_texts), so both sides do the same work.
UNIQUE_TEXT = "Hello, my order %d has not arrived yet, what should I do? (case {tag}-%s)"


def ghz_unique_template(tag: str, model: str = "minilm") -> str:
    """A ghz -d body whose text (UNIQUE_TEXT) differs on every call (sprig's b64enc
    over ghz's request number and worker id). One small message that ghz renders
    per call: a data file of many messages costs ghz CPU per call in proportion to
    its size, which on a small machine is taken from the mesh being measured."""
    text = f"{{{{ printf `{UNIQUE_TEXT.format(tag=tag)}` .RequestNumber .WorkerID | b64enc }}}}"
    return json.dumps(
        {
            "model_name": model,
            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "contents": {"bytes_contents": [text]}}],
        }
    )


def ghz_texts(tag: str, count: int, callers: int = 64, connections: int = 4, start: int = 0) -> list[str]:
    """The texts ghz_unique_template renders for request numbers start..start+count-1
    under `callers` workers over `connections` connections (ghz names worker w
    "g<w>c<w mod connections>"; request n goes to worker n mod callers)."""
    fmt = UNIQUE_TEXT.format(tag=tag)
    return [fmt % (n, f"g{n % callers}c{n % callers % connections}") for n in range(start, start + count)]


class InProcessMinilm:
    """minilm run directly on ONNX Runtime, as the mesh's model server would
    (same graph and tokenizer, padding to the longest text of each batch, one
    intra-op thread per core): the baseline the mesh is measured against."""

    def __init__(self, model_dir: pathlib.Path, threads: int | None = None):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        self._session = ort.InferenceSession(str(model_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.enable_truncation(max_length=256)
        self._tokenizer.enable_padding()

    def embed(self, batch: list[str]) -> np.ndarray:
        encodings = self._tokenizer.encode_batch(batch)
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        return self._session.run(["sentence_embedding"], feeds)[0]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Writes ghz call data for minilm to stdout: a -d template whose text differs on every call "
        "(the default, cheap for ghz), or with --count a --data-file of that many distinct requests."
    )
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="load", help="part of every templated text, to tell runs apart")
    args = parser.parse_args()
    print(ghz_data(texts(args.count, args.seed)) if args.count else ghz_unique_template(args.tag))
