"""Builders for minilm's derived models: version 2 (INT8) and the minilm-lite fallback,
plus the offline English text set they are fitted and judged on."""

from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy

# Module-level imports stay stdlib-only, like repository.py's.

EMBED_DIM = 384
LITE_DIM = 64  # PCA dimension of minilm-lite's token table: 30522 x 64 ~ 2.0M parameters
LITE_SEED = 0
HELDOUT_SHARE = 5  # one sentence in five (by hash) is held out from fitting

# Dynamic INT8 with per-channel weight scales; bench/versions.py measures the alternatives.
QUANT_OPTIONS = {"per_channel": True, "reduce_range": False, "extra_options": {"MatMulConstBOnly": True}}

_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_SKIP_LINE = (">>>", "...", "$", "*", "+", "|", "=", "-")


def _sentences(text: str):
    """Prose sentences of a docstring: code, tables and lists are dropped, lines rejoined."""
    for para in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in para.splitlines()]
        if any(line.startswith(_SKIP_LINE) for line in lines):
            continue
        for s in _SPLIT.split(" ".join(line for line in lines if line)):
            s = s.strip()
            if not 6 <= len(s.split()) <= 60 or not s[0].isupper() or s[-1] not in ".!?":
                continue
            if sum(c.isalpha() or c == " " for c in s) < 0.85 * len(s):
                continue
            yield s


def _docstrings(path: Path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def _is_heldout(sentence: str) -> bool:
    return int(hashlib.sha256(sentence.encode()).hexdigest()[:8], 16) % HELDOUT_SHARE == 0


def corpus() -> tuple[list[str], list[str]]:
    """(train, held-out): English sentences of the Python reference manual (pydoc_data)
    and the standard library's top-level docstrings, deduplicated, in a fixed order and
    split by a hash of each sentence, so the split never depends on the order found."""
    import pydoc_data.topics

    found: set[str] = set()
    for key in sorted(pydoc_data.topics.topics):
        found.update(_sentences(pydoc_data.topics.topics[key]))
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for doc in _docstrings(path):
            found.update(_sentences(doc))
    ordered = sorted(found, key=lambda s: hashlib.sha256(s.encode()).hexdigest())
    return [s for s in ordered if not _is_heldout(s)], [s for s in ordered if _is_heldout(s)]


# ---------------------------------------------------------------- running a text model


def session(path: Path, threads: int = 2):
    """A CPU session configured like the model server's (no spinning: the cores are shared)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def tokenizer(path: Path):
    """The model's tokenizer.json, padding to the longest text of a batch."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    return tok


def embed(sess, tok, texts: list[str], batch: int = 32) -> numpy.ndarray:
    """Embeddings of texts, feeding the graph only the inputs it declares (as the server does)."""
    import numpy as np

    wanted = {i.name for i in sess.get_inputs()}
    out = [np.zeros((0, EMBED_DIM), dtype=np.float32)]
    for start in range(0, len(texts), batch):
        encs = tok.encode_batch(texts[start : start + batch])
        feeds = {
            "input_ids": np.array([e.ids for e in encs], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encs], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encs], dtype=np.int64),
        }
        out.append(sess.run(None, {k: v for k, v in feeds.items() if k in wanted})[0])
    return np.concatenate(out)


def cosines(a, b) -> numpy.ndarray:
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def parameter_count(path: Path) -> int:
    """Elements of the graph's weights (quantised weights count once, scales and zero points too)."""
    import numpy as np
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return int(sum(np.prod(t.dims, dtype=np.int64) for t in model.graph.initializer))


def quality(got, ref, neighbours: int = 10) -> dict[str, float]:
    """How well embeddings `got` stand in for `ref` (rows are the same texts): per-text cosine
    (mean, 1st percentile), Spearman correlation of all pairwise similarities, and the mean
    overlap of each text's top-k neighbours, which cosine alone would flatter."""
    import numpy as np
    from scipy.stats import spearmanr

    cos = cosines(got, ref)
    g = got / np.linalg.norm(got, axis=1, keepdims=True)
    r = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    sim_g, sim_r = g @ g.T, r @ r.T
    upper = np.triu_indices(len(g), k=1)
    rho = spearmanr(sim_g[upper], sim_r[upper]).statistic
    np.fill_diagonal(sim_g, -np.inf)
    np.fill_diagonal(sim_r, -np.inf)
    top_g = np.argsort(-sim_g, axis=1)[:, :neighbours]
    top_r = np.argsort(-sim_r, axis=1)[:, :neighbours]
    overlap = np.mean([len(set(a) & set(b)) / neighbours for a, b in zip(top_g, top_r, strict=True)])
    return {
        "cosine_mean": float(cos.mean()),
        "cosine_p1": float(np.percentile(cos, 1)),
        "pairwise_spearman": float(rho),
        f"top{neighbours}_overlap": float(overlap),
    }


# ---------------------------------------------------------------- version 2: INT8


def quantize_minilm(src: Path, dst: Path, **options) -> None:
    """Dynamic INT8 quantisation of minilm's graph src into dst (QUANT_OPTIONS unless overridden):
    int8 weights of every weight MatMul and of the embedding Gathers, activations quantised per
    batch at run time."""
    import tempfile

    from onnxruntime.quantization import quant_pre_process, quantize_dynamic

    opts = {**QUANT_OPTIONS, **options}
    with tempfile.TemporaryDirectory(prefix="quant-", dir=dst.parent) as tmp:
        pre = Path(tmp) / "pre.onnx"
        # Symbolic shape inference cannot follow the dynamo export's shape arithmetic;
        # ONNX shape inference and the graph optimisation pass are what quantisation needs.
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        quantize_dynamic(str(pre), str(dst), **opts)


def weight_matmuls(path: Path) -> list[str]:
    """Names of minilm's MatMuls with a weight operand, in graph order (6 per layer:
    query, key, value, attention output, FFN up, FFN down)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


# ---------------------------------------------------------------- minilm-lite


def _token_vectors(teacher: Path, vocab_size: int, cls_id: int, sep_id: int) -> numpy.ndarray:
    """minilm's embedding of every vocabulary token alone ([CLS] token [SEP])."""
    import numpy as np

    sess = session(teacher)
    out = []
    for start in range(0, vocab_size, 2048):
        ids = np.arange(start, min(start + 2048, vocab_size), dtype=np.int64)
        feeds = {
            "input_ids": np.stack([np.full_like(ids, cls_id), ids, np.full_like(ids, sep_id)], axis=1),
            "attention_mask": np.ones((len(ids), 3), dtype=np.int64),
            "token_type_ids": np.zeros((len(ids), 3), dtype=np.int64),
        }
        out.append(sess.run(None, feeds)[0])
    return np.concatenate(out).astype(np.float64)


def _zipf_weights(vocab_size: int, first_word_id: int):
    """Per-token weights that damp frequent words (SIF-style), taking the vocabulary's
    order as the frequency rank: BERT's word pieces from `first_word_id` on ("the" first)
    are sorted by frequency; specials and single characters before them weigh as the top word."""
    import numpy as np

    rank = np.maximum(np.arange(vocab_size) - first_word_id, 0) + 1
    return np.log1p(rank)[:, None]


def fit_lite(
    teacher: Path, tokenizer_path: Path, train: list[str], dim: int = LITE_DIM, epochs: int = 10, lr: float = 3e-3
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """minilm-lite's weights (token table [vocab, dim], projection [dim, 384]), distilled from
    minilm (the graph at `teacher`) in three steps, Model2Vec-style:
    1. embed every vocabulary token alone with minilm and reduce the 384-d vectors by PCA;
    2. weight them by Zipf rank, fit the projection back to 384-d by least squares so that
       the mean of a text's token vectors maps onto minilm's embedding of the text;
    3. fine-tune table and projection together on the cosine to minilm's embeddings.
    Deterministic: seeded, fixed order, one thread count."""
    import json

    import numpy as np
    import torch
    from sklearn.decomposition import PCA

    vocab = json.loads(tokenizer_path.read_text())["model"]["vocab"]
    tokens = _token_vectors(teacher, len(vocab), vocab["[CLS]"], vocab["[SEP]"])
    table = PCA(dim, random_state=LITE_SEED, svd_solver="full").fit_transform(tokens)
    table *= _zipf_weights(len(vocab), vocab["the"])

    # Teacher targets; length-sorted batches spare most of the padding.
    tok = tokenizer(tokenizer_path)
    order = sorted(range(len(train)), key=lambda i: (len(train[i]), i))
    targets = np.empty((len(train), EMBED_DIM), dtype=np.float32)
    targets[order] = embed(session(teacher), tok, [train[i] for i in order], batch=64)
    tok.no_padding()
    ids = [np.array(e.ids, dtype=np.int64) for e in tok.encode_batch(train)]

    pooled = np.stack([table[row].mean(0) for row in ids])
    projection, *_ = np.linalg.lstsq(pooled, targets.astype(np.float64), rcond=None)

    torch.manual_seed(LITE_SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bag = torch.nn.EmbeddingBag(len(vocab), dim, mode="mean")
        bag.weight.data = torch.tensor(table, dtype=torch.float32)
        proj = torch.nn.Linear(dim, EMBED_DIM, bias=False)
        proj.weight.data = torch.tensor(projection.T, dtype=torch.float32)
        opt = torch.optim.Adam([*bag.parameters(), *proj.parameters()], lr=lr)
        rows = [torch.from_numpy(r) for r in ids]
        want = torch.from_numpy(targets)
        gen = torch.Generator().manual_seed(LITE_SEED)
        for _ in range(epochs):
            perm = torch.randperm(len(rows), generator=gen).tolist()
            for start in range(0, len(perm), 64):
                batch = perm[start : start + 64]
                flat = torch.cat([rows[i] for i in batch])
                offsets = torch.tensor([0] + [len(rows[i]) for i in batch[:-1]]).cumsum(0)
                out = proj(bag(flat, offsets))
                loss = 1 - torch.nn.functional.cosine_similarity(out, want[batch]).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return bag.weight.detach().numpy().copy(), proj.weight.detach().numpy().T.copy()


def write_lite_graph(table, projection, path: Path, opset: int = 18) -> None:
    """minilm-lite's ONNX graph: Gather the token vectors, attention-mask-weighted mean,
    MatMul back to 384-d, L2-normalise. Inputs input_ids and attention_mask (int64
    [batch, seq]); output sentence_embedding (float32 [batch, 384]), like minilm's."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.asarray(table, dtype=np.float32), "token_table"),
        numpy_helper.from_array(np.asarray(projection, dtype=np.float32), "projection"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "seq_axis"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "last_axis"),
        numpy_helper.from_array(np.array(1e-12, dtype=np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("Gather", ["token_table", "input_ids"], ["tokens"]),  # [B, S, dim]
        helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask", "last_axis"], ["mask3"]),  # [B, S, 1]
        helper.make_node("Mul", ["tokens", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "seq_axis"], ["summed"], keepdims=0),  # [B, dim]
        helper.make_node("ReduceSum", ["mask3", "seq_axis"], ["count"], keepdims=0),  # [B, 1]
        helper.make_node("Max", ["count", "eps"], ["count_safe"]),
        helper.make_node("Div", ["summed", "count_safe"], ["mean"]),
        helper.make_node("MatMul", ["mean", "projection"], ["projected"]),  # [B, 384]
        helper.make_node("ReduceL2", ["projected", "last_axis"], ["norm"], keepdims=1),
        helper.make_node("Max", ["norm", "eps"], ["norm_safe"]),
        helper.make_node("Div", ["projected", "norm_safe"], ["sentence_embedding"]),
    ]
    graph = helper.make_graph(
        nodes,
        "minilm_lite",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
            for n in ("input_ids", "attention_mask")
        ],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", EMBED_DIM])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="infermesh")
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, str(path))


# ---------------------------------------------------------------- golden probes


def text_golden(texts: list[str], expected) -> dict:
    """A golden.json body: TEXT inputs and their expected EMBEDDING rows (flat, row-major)."""
    import numpy as np

    expected = np.asarray(expected, dtype=np.float32)
    return {
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts)], "data": list(texts)}],
        "outputs": [
            {
                "name": "EMBEDDING",
                "datatype": "FP32",
                "shape": list(expected.shape),
                "data": [float(x) for x in expected.reshape(-1)],
            }
        ],
    }


def probe_cosines(model_path: Path, tokenizer_path: Path, golden: dict) -> numpy.ndarray:
    """Per-row cosine between a text model's answers to a golden.json's inputs and its expected outputs."""
    import numpy as np

    (inp,) = golden["inputs"]
    (out,) = golden["outputs"]
    expected = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    got = embed(session(model_path), tokenizer(tokenizer_path), list(inp["data"]), batch=4)
    return cosines(got, expected)
