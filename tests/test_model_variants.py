"""minilm version 2 (INT8), the minilm-lite fallback and the golden probes of the built model repository.

Reads the repository named by INFERMESH_MODELS (default build/models) and builds nothing."""

import json
import os
import pathlib

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tools.build_models import variants
from tools.build_models.repository import EMBED_DIM, REQUIRED_FILES

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXTS = [
    "Can I change the delivery address of order 4411?",
    "",
    "Das Paket ist beschädigt angekommen.",
    "battery drains fast after the update " * 40,
]


@pytest.fixture(scope="module")
def repo() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("INFERMESH_MODELS", ROOT / "build" / "models"))
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        pytest.fail(f"{path} lacks {missing}: rebuild it with 'make setup'")
    return path


def _config(repo, model):
    return json.loads((repo / model / "config.json").read_text())


def _golden(repo, model):
    return json.loads((repo / model / _config(repo, model)["golden_probe"]["file"]).read_text())


@pytest.mark.parametrize("model_dir", ["minilm/1", "minilm/2", "minilm-lite/1"])
def test_text_models_give_unit_length_embeddings(repo, model_dir):
    d = repo / model_dir
    got = variants.embed(
        variants.session(d / "model.onnx"), variants.tokenizer(d / "tokenizer.json"), TEXTS, batch=len(TEXTS)
    )
    assert got.shape == (len(TEXTS), EMBED_DIM) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)


def test_configs_name_versions_probes_and_fallback(repo):
    minilm, lite, mlp = (_config(repo, m) for m in ("minilm", "minilm-lite", "mlp"))
    assert minilm["version_policy"] == {"specific": {"versions": [1]}}
    assert minilm["fallback"] == "minilm-lite"
    assert lite["name"] == "minilm-lite" and lite["version_policy"] == {"latest": {"num_versions": 1}}
    assert lite["inputs"] == minilm["inputs"] and lite["outputs"] == minilm["outputs"]
    assert lite["preprocess"] == minilm["preprocess"]
    assert 0 < lite["golden_probe"]["min_cosine"] < minilm["golden_probe"]["min_cosine"] < 1
    assert mlp["version_policy"] == {"latest": {"num_versions": 1}} and mlp["golden_probe"]["max_abs"] > 0


@pytest.mark.parametrize("model", ["minilm", "minilm-lite", "mlp"])
def test_golden_files_match_their_configs(repo, model):
    config, golden = _config(repo, model), _golden(repo, model)
    for kind in ("inputs", "outputs"):
        declared = {t["name"]: t for t in config[kind]}
        for tensor in golden[kind]:
            spec = declared[tensor["name"]]
            assert tensor["datatype"] == spec["datatype"]
            assert len(tensor["shape"]) == len(spec["shape"])
            assert all(s == -1 or s == g for s, g in zip(spec["shape"], tensor["shape"], strict=True))
            assert len(tensor["data"]) == int(np.prod(tensor["shape"]))
    rows = {t["shape"][0] for t in golden["inputs"] + golden["outputs"]}
    assert len(rows) == 1


def test_text_goldens_are_varied_and_unit_length(repo):
    golden = _golden(repo, "minilm")
    texts = golden["inputs"][0]["data"]
    assert 8 <= len(texts) <= 16 and "" in texts and len(set(texts)) == len(texts)
    tok = variants.tokenizer(repo / "minilm" / "1" / "tokenizer.json")
    tok.no_padding()
    assert max(len(tok.encode(t, add_special_tokens=True).ids) for t in texts) == 256  # one is truncated
    expected = np.asarray(golden["outputs"][0]["data"], dtype=np.float32).reshape(len(texts), EMBED_DIM)
    np.testing.assert_allclose(np.linalg.norm(expected, axis=1), 1.0, atol=1e-5)
    assert _golden(repo, "minilm-lite")["outputs"] == golden["outputs"]


@pytest.mark.parametrize("model, version", [("minilm", 1), ("minilm", 2), ("minilm-lite", 1)])
def test_versions_pass_their_golden_probe(repo, model, version):
    d = repo / model / str(version)
    cos = variants.probe_cosines(d / "model.onnx", d / "tokenizer.json", _golden(repo, model))
    assert cos.min() >= _config(repo, model)["golden_probe"]["min_cosine"], cos


def _perturbed(src: pathlib.Path, dst: pathlib.Path, scale: float) -> None:
    # Gaussian noise of `scale` standard deviations on every large float weight.
    model = onnx.load(str(src))
    rng = np.random.default_rng(0)
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.dtype == np.float32 and a.size >= 1000:
            noisy = a + rng.standard_normal(a.shape).astype(np.float32) * scale * a.std()
            t.CopyFrom(numpy_helper.from_array(noisy, t.name))
    onnx.save_model(model, str(dst))


@pytest.mark.parametrize("model", ["minilm", "minilm-lite"])
def test_a_model_with_perturbed_weights_fails_the_golden_probe(repo, model, tmp_path):
    d = repo / model / "1"
    _perturbed(d / "model.onnx", tmp_path / "model.onnx", scale=1.0)
    cos = variants.probe_cosines(tmp_path / "model.onnx", d / "tokenizer.json", _golden(repo, model))
    # The probe fails (a row below the threshold), and not by a hair: on average too.
    assert cos.mean() < _config(repo, model)["golden_probe"]["min_cosine"], cos


def test_a_slightly_perturbed_minilm_fails_the_golden_probe(repo, tmp_path):
    # 10% weight noise moves minilm less than a shuffle does, and still must not pass.
    d = repo / "minilm" / "1"
    _perturbed(d / "model.onnx", tmp_path / "model.onnx", scale=0.1)
    cos = variants.probe_cosines(tmp_path / "model.onnx", d / "tokenizer.json", _golden(repo, "minilm"))
    assert cos.min() < _config(repo, "minilm")["golden_probe"]["min_cosine"], cos


def test_lite_has_at_most_15_percent_of_minilms_parameters(repo):
    lite = variants.parameter_count(repo / "minilm-lite" / "1" / "model.onnx")
    full = variants.parameter_count(repo / "minilm" / "1" / "model.onnx")
    assert lite <= 0.15 * full, (lite, full)
    assert {i.name for i in variants.session(repo / "minilm-lite" / "1" / "model.onnx").get_inputs()} <= {
        "input_ids",
        "attention_mask",
        "token_type_ids",
    }
