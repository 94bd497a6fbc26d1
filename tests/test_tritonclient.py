"""End to end with an independent client: tritonclient.grpc against the router."""

import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "An inference mesh batches requests from many callers. " * 40,  # past 256 tokens
    "short",
]


def test_tritonclient_unary_and_stream_match_sentence_transformers(mesh, reference_embeddings, tmp_path):
    texts_path = tmp_path / "texts.json"
    texts_path.write_text(json.dumps(TEXTS))
    out = tmp_path / "out.npz"
    subprocess.run(
        [
            sys.executable,
            "tests/triton_client_run.py",
            mesh.router,
            str(texts_path),
            str(out),
            *(mesh.client_files() or ()),
        ],
        check=True,
        timeout=300,
    )
    got = np.load(out)
    facts = json.loads(str(got["facts"]))
    assert facts["live"] and facts["ready"] and facts["model_ready"]
    assert facts["metadata"]["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": ["-1"]}]
    assert facts["metadata"]["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": ["-1", "384"]}]
    assert "model_stream_infer" in facts["server"]["extensions"]
    assert "INVALID_ARGUMENT" in facts["stream_error"] and "'FP32'" in facts["stream_error"]
    assert "StatusCode.NOT_FOUND" in facts["unknown_error"] and "no-such-model" in facts["unknown_error"]

    expected = reference_embeddings(TEXTS)
    for name in ("unary", "streamed"):
        embeddings = got[name]
        assert embeddings.shape == (len(TEXTS), 384)
        cosine = np.sum(embeddings * expected, axis=1) / (
            np.linalg.norm(embeddings, axis=1) * np.linalg.norm(expected, axis=1)
        )
        assert cosine.min() >= 0.9999, f"{name}: cosine per text {cosine}"
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
