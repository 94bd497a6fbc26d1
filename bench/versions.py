"""minilm's versions side by side in one process: v1 (fp32), v2 (INT8, as built) and the
minilm-lite fallback, with the INT8 alternatives that were weighed against v2's recipe.

    .venv/bin/python -m bench.versions --runs 3

In-process ONNX Runtime configured like the model server (2 intra-op threads, no
spinning), on the held-out sentences of the build's text set. Reports file size,
parameters, sentences/s at batch 1 and 32 (medians of --runs), a session's resident
memory, and quality against v1 (per-text cosine, pairwise Spearman, top-10 overlap).
Writes bench/results/versions.{json,md,png}.
"""

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.report import chosen_seed, machine, phase_order, progress, pyplot, seed_argument, write
from tools.build_models import variants as bv

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# The alternatives to v2's recipe, quantised from v1 here (seconds each).
ALTERNATIVES = {
    "int8 naive (per-tensor)": {"per_channel": False},
    "int8 per-channel, reduce_range": {"reduce_range": True},
    "int8 per-channel, FFN-down fp32": {"exclude": "ffn_down"},
    "int8 per-channel, last layer fp32": {"exclude": "last_layer"},
}


_RSS_PROBE = """
import sys
from tools.build_models import variants as bv
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
tok = bv.tokenizer(sys.argv[2])
before = rss()
sess = bv.session(sys.argv[1])
bv.embed(sess, tok, ["A first request allocates the arenas."] * 32)
print((rss() - before) / 1e6)
"""


def _session_rss_mb(model: pathlib.Path, tok_path: pathlib.Path) -> float:
    """Resident memory a fresh process gains by creating the session and running one batch of 32."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(model), str(tok_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return float(out.stdout.split()[-1])


def _throughput(sess, tok, texts: list[str], batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, len(texts), batch):
        bv.embed(sess, tok, texts[start : start + batch], batch=batch)
    return len(texts) / (time.perf_counter() - started)


def _alternative(v1: pathlib.Path, dst: pathlib.Path, spec: dict) -> None:
    matmuls = bv.weight_matmuls(v1)
    exclude = {"ffn_down": matmuls[5::6], "last_layer": matmuls[-6:]}.get(spec.get("exclude"), [])
    options = {k: v for k, v in spec.items() if k != "exclude"}
    bv.quantize_minilm(v1, dst, nodes_to_exclude=exclude, **options)


def _broken_probe(src: pathlib.Path, tok_path: pathlib.Path, golden: dict, scale: float, dst: pathlib.Path) -> float:
    """Worst golden-probe row cosine of src with Gaussian noise of `scale` weight standard deviations."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    rng = np.random.default_rng(0)
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.dtype == np.float32 and a.size >= 1000:
            t.CopyFrom(
                numpy_helper.from_array(a + rng.standard_normal(a.shape).astype(np.float32) * scale * a.std(), t.name)
            )
    onnx.save_model(model, str(dst))
    return float(bv.probe_cosines(dst, tok_path, golden).min())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported")
    seed_argument(parser)
    parser.add_argument("--models", type=pathlib.Path, default=ROOT / "build" / "models")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    import json

    minilm = args.models / "minilm"
    tok_path = minilm / "1" / "tokenizer.json"
    _, heldout = bv.corpus()
    progress(f"held-out set: {len(heldout)} sentences from the standard library's docs")
    tok = bv.tokenizer(tok_path)
    golden = json.loads((minilm / "golden.json").read_text())
    min_cos = json.loads((minilm / "config.json").read_text())["golden_probe"]["min_cosine"]

    scratch = pathlib.Path(tempfile.mkdtemp(prefix="bench-versions-"))
    paths = {
        "v1 fp32": minilm / "1" / "model.onnx",
        "v2 int8": minilm / "2" / "model.onnx",
        "minilm-lite": args.models / "minilm-lite" / "1" / "model.onnx",
    }
    for i, (name, spec) in enumerate(ALTERNATIVES.items()):
        progress(f"quantising alternative: {name}")
        _alternative(paths["v1 fp32"], scratch / f"alt{i}.onnx", spec)
        paths[name] = scratch / f"alt{i}.onnx"

    variants = {}
    sessions = {}
    for name, path in paths.items():
        sessions[name] = bv.session(path)
        variants[name] = {
            "file_mb": path.stat().st_size / 1e6,
            "parameters": bv.parameter_count(path),
            "session_rss_mb": _session_rss_mb(path, tok_path),
        }
        progress(f"{name}: {variants[name]['file_mb']:.1f} MB, session +{variants[name]['session_rss_mb']:.0f} MB RSS")

    progress("quality on the held-out set (embedding every sentence with every variant)")
    order = sorted(range(len(heldout)), key=lambda i: (len(heldout[i]), i))
    texts = [heldout[i] for i in order]
    ref = bv.embed(sessions["v1 fp32"], tok, texts, batch=32)
    for name, sess in sessions.items():
        got = ref if name == "v1 fp32" else bv.embed(sess, tok, texts, batch=32)
        variants[name]["quality"] = bv.quality(got, ref)
        variants[name]["golden_min_cosine"] = float(bv.probe_cosines(paths[name], tok_path, golden).min())
        progress(f"  {name}: {variants[name]['quality']}")

    # Throughput: the same sentences in their held-out (hash) order, every variant in each run.
    b1_texts, b32_texts = heldout[:128], heldout[128 : 128 + 640]
    speeds = {name: {"1": [], "32": []} for name in sessions}
    seed = chosen_seed(args.seed)
    for run in range(args.runs):
        progress(f"run {run + 1}/{args.runs}: throughput at batch 1 and 32")
        for name in phase_order(sessions, run, seed):  # no variant always first
            sess = sessions[name]
            speeds[name]["1"].append(_throughput(sess, tok, b1_texts, 1))
            speeds[name]["32"].append(_throughput(sess, tok, b32_texts, 32))
    for name in sessions:
        variants[name]["sentences_per_s"] = {b: statistics.median(v) for b, v in speeds[name].items()}
        variants[name]["sentences_per_s_runs"] = speeds[name]
        variants[name]["speedup_vs_v1"] = {
            b: variants[name]["sentences_per_s"][b] / statistics.median(speeds["v1 fp32"][b]) for b in ("1", "32")
        }

    progress("golden probe against deliberately broken copies of v1")
    broken = {
        f"v1 + {s:g} std weight noise": _broken_probe(paths["v1 fp32"], tok_path, golden, s, scratch / "broken.onnx")
        for s in (0.1, 1.0)
    }

    report = {
        "machine": machine(),
        "runs": args.runs,
        "seed": seed,
        "heldout_sentences": len(heldout),
        "golden_min_cosine": min_cos,
        "broken_golden_worst_row_cosine": broken,
        "variants": variants,
    }
    write(args.out, "versions", report, _markdown(report), _plot)
    return 0


def _markdown(r: dict) -> str:
    v = r["variants"]
    v1 = v["v1 fp32"]
    lines = [
        "# minilm versions: fp32, INT8 and the minilm-lite fallback",
        "",
        f"{r['machine']}, cores shared with other work while measured; in-process ONNX Runtime, 2 intra-op threads, no spinning; medians of {r['runs']} runs, "
        f"all variants measured side by side in one process. Quality against v1 on {r['heldout_sentences']} "
        "held-out sentences (Python standard-library docs, never used for fitting).",
        "",
        "Session RSS: what a fresh process gains by creating the session and running one batch of 32.",
        "",
        "| variant | file MB | parameters | session RSS MB | sent/s b1 | sent/s b32 | × v1 b1 | × v1 b32 "
        "| cosine mean | cosine p1 | pairwise Spearman | top-10 overlap | golden worst |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in v.items():
        q = x["quality"]
        lines.append(
            f"| {name} | {x['file_mb']:.1f} | {x['parameters'] / 1e6:.2f}M | {x['session_rss_mb']:.0f} "
            f"| {x['sentences_per_s']['1']:.0f} | {x['sentences_per_s']['32']:.0f} "
            f"| {x['speedup_vs_v1']['1']:.2f} | {x['speedup_vs_v1']['32']:.2f} "
            f"| {q['cosine_mean']:.4f} | {q['cosine_p1']:.4f} | {q['pairwise_spearman']:.4f} | {q['top10_overlap']:.3f} "
            f"| {x['golden_min_cosine']:.4f} |"
        )
    v2 = v["v2 int8"]
    lines += [
        "",
        '## INT8: what we measured against the claim "−75% memory for < 1% accuracy loss"',
        "",
        f"- File: {v2['file_mb']:.1f} MB vs {v1['file_mb']:.1f} MB ({100 * (v2['file_mb'] / v1['file_mb'] - 1):+.0f}%). "
        f"Resident memory of a session: +{v2['session_rss_mb']:.0f} MB vs +{v1['session_rss_mb']:.0f} MB "
        f"({100 * (v2['session_rss_mb'] / v1['session_rss_mb'] - 1):+.0f}%).",
        f"- Accuracy: mean cosine to fp32 {v2['quality']['cosine_mean']:.4f} (a {100 * (1 - v2['quality']['cosine_mean']):.2f}% "
        f"loss), 1st percentile {v2['quality']['cosine_p1']:.4f}; pairwise-similarity Spearman "
        f"{v2['quality']['pairwise_spearman']:.4f}, top-10 neighbours shared {100 * v2['quality']['top10_overlap']:.1f}%. "
        f"Naive per-tensor INT8 loses {100 * (1 - v['int8 naive (per-tensor)']['quality']['cosine_mean']):.1f}%.",
        f"- Speed: {v2['speedup_vs_v1']['1']:.2f}× at batch 1, {v2['speedup_vs_v1']['32']:.2f}× at batch 32.",
        "",
        "v2's recipe: `quant_pre_process` (ONNX shape inference; symbolic inference cannot follow the dynamo "
        "graph), then `quantize_dynamic` with per-channel int8 weights for every weight MatMul and the embedding "
        "Gathers, activations quantised per batch (uint8). Per-channel scales remove most of naive INT8's error "
        "without losing speed; keeping FFN-down or the last layer in fp32 buys a little quality (see the table) "
        "for a larger file and, for FFN-down, a loss of speed; reduce_range only loses precision.",
        "",
        _speed_spread(v),
        "",
        "## Golden probe",
        "",
        f"min_cosine {r['golden_min_cosine']}: a row passes at or above it. Worst row: "
        + ", ".join(f"{n} {x['golden_min_cosine']:.4f}" for n, x in v.items() if n in ("v1 fp32", "v2 int8"))
        + ". Broken copies of v1 (worst row; the probe fails when any row is below): "
        + ", ".join(f"{n} {c:.4f}" for n, c in r["broken_golden_worst_row_cosine"].items())
        + ".",
        "minilm-lite has its own threshold (tools/build_models/repository.py LITE_GOLDEN_MIN, worst row shown in the table): "
        "the golden texts include languages and code it barely models.",
        "",
        "## minilm-lite",
        "",
        "Model2Vec-style distillation at setup: every vocabulary token embedded alone by minilm, PCA to 64 "
        "dimensions, Zipf-rank weights, least-squares projection back to 384, then table and projection "
        "fine-tuned together (10 epochs, cosine loss) on the training sentences; graph = Gather + "
        "attention-mask-weighted mean + MatMul + L2 normalise. "
        f"{v['minilm-lite']['parameters'] / 1e6:.2f}M parameters ({100 * v['minilm-lite']['parameters'] / v1['parameters']:.1f}% "
        f"of minilm's), {v['minilm-lite']['speedup_vs_v1']['32']:.0f}× v1's throughput at batch 32. It keeps the "
        "coarse neighbourhood structure only: good enough to answer while minilm's circuit is open, "
        "not a replacement.",
        "",
    ]
    return "\n".join(lines)


def _speed_spread(v: dict) -> str:
    """Each variant's sentences/s across runs (min–max), or a line saying the report kept none:
    without the spread, a difference in speed cannot be told from this machine's noise."""
    if not all("sentences_per_s_runs" in x for x in v.values()):
        return (
            "This report keeps only the median speeds, not each run's, so it cannot tell how much of a "
            "difference in speed between two variants is noise."
        )
    spans = "; ".join(
        f"{name} {min(x['sentences_per_s_runs']['1']):.0f}–{max(x['sentences_per_s_runs']['1']):.0f} / "
        f"{min(x['sentences_per_s_runs']['32']):.0f}–{max(x['sentences_per_s_runs']['32']):.0f}"
        for name, x in v.items()
    )
    return f"Sentences/s across runs (min–max, batch 1 / batch 32): {spans}."


def _plot(r: dict, path: pathlib.Path) -> None:
    plt = pyplot()

    names = list(r["variants"])
    v = r["variants"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    x = np.arange(len(names))
    ax1.bar(x - 0.2, [v[n]["sentences_per_s"]["1"] for n in names], 0.4, label="batch 1")
    ax1.bar(x + 0.2, [v[n]["sentences_per_s"]["32"] for n in names], 0.4, label="batch 32")
    ax1.set_yscale("log")
    ax1.set_ylabel("sentences/s (log)")
    ax1.set_title("throughput, in-process ORT, 2 threads")
    ax1.legend()
    for key, label, off in (
        ("cosine_mean", "cosine mean", -0.27),
        ("cosine_p1", "cosine p1", 0),
        ("pairwise_spearman", "pairwise Spearman", 0.27),
    ):
        ax2.bar(x + off, [v[n]["quality"][key] for n in names], 0.27, label=label)
    ax2.set_ylim(0, 1.02)
    ax2.set_title("quality vs v1 (held-out sentences)")
    ax2.legend(loc="lower left")
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
