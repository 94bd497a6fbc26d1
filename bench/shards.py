"""Tensor-parallel degree 1 vs 2 vs 4 for minilm, in process, side by side in
one run: latency of one 16-token text, throughput at batch 32, weights held per
shard, and the largest difference from the whole model.

    .venv/bin/python -m bench.shards --runs 3                 # CPU (this machine)
    .venv/bin/python -m bench.shards --runs 3 --device cuda   # shard i on GPU i % GPUs

On the CPU every shard gets cores / degree intra-op threads, so the shards
split the same two cores: this measures the price of sharding (14 segments,
13 all-reduces), not a speed-up. Writes bench/results/shards[-cuda].{json,md,png}
(or --out DIR).
"""

import argparse
import os
import pathlib
import statistics
import time

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from bench.report import chosen_seed, machine, phase_order, progress, pyplot, seed_argument, write
from bench.workload import texts
from services.model_server.shards import ShardedSession, read_manifest

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERSION = ROOT / "build" / "models" / "minilm" / "1"
DEGREES = (1, 2, 4)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _session_factory(device: str, threads: int):
    def make(path, device_id=None):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            providers = [("CUDAExecutionProvider", {"device_id": device_id or 0}), "CPUExecutionProvider"]
        return ort.InferenceSession(str(path), options, providers=providers)

    return make


def _model(degree: int, device: str):
    cores = os.cpu_count() or 1
    if degree == 1:
        return _session_factory(device, cores)(VERSION / "model.onnx", 0)
    devices = [None] * degree if device == "cpu" else [i % _gpus() for i in range(degree)]
    return ShardedSession(VERSION / f"tp{degree}", degree, _session_factory(device, max(1, cores // degree)), devices)


def _feeds(tokenizer: Tokenizer, batch: list[str]) -> dict[str, np.ndarray]:
    encodings = tokenizer.encode_batch(batch)
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }


def _time(model, feeds, seconds: float) -> tuple[float, float]:
    """(median seconds per call, calls per second) over about `seconds`."""
    model.run(["sentence_embedding"], feeds)
    durations, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds or len(durations) < 5:
        t = time.perf_counter()
        model.run(["sentence_embedding"], feeds)
        durations.append(time.perf_counter() - t)
    return statistics.median(durations), len(durations) / sum(durations)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    seed_argument(parser)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(VERSION / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=256)
    tokenizer.enable_padding()
    pool = texts(2000, seed=5)
    one = _feeds(tokenizer, pool[:1])
    batch = _feeds(tokenizer, pool[1:33])
    models = {d: _model(d, args.device) for d in DEGREES}
    reference = models[1].run(["sentence_embedding"], batch)[0]
    report = {
        "machine": machine(),
        "device": args.device,
        "command": f"python -m bench.shards --runs {args.runs} --device {args.device}",
        "degrees": {},
        "runs": [],
    }
    for degree in DEGREES:
        if degree == 1:
            held = [(VERSION / "model.onnx").stat().st_size]
        else:
            held = [s["bytes"] for s in read_manifest(VERSION / f"tp{degree}", degree)["shards"]]
        got = models[degree].run(["sentence_embedding"], batch)[0]
        report["degrees"][degree] = {
            "bytes_per_shard": held,
            "largest_shard_share": max(held) / sum(held),
            "max_abs_diff_vs_degree_1": float(np.abs(got - reference).max()),
        }
    seed = chosen_seed(args.seed)
    report["seed"] = seed
    for run in range(args.runs):
        result = {}
        for degree in phase_order(DEGREES, run, seed):  # no degree always first
            latency, _ = _time(models[degree], one, args.seconds)
            per_batch, _ = _time(models[degree], batch, args.seconds)
            result[degree] = {"latency_ms_batch1": 1000 * latency, "sentences_per_s_batch32": 32 / per_batch}
        report["runs"].append(result)
        progress(
            f"run {run + 1}/{args.runs}: "
            + "; ".join(
                f"degree {d}: {r['latency_ms_batch1']:.1f} ms at batch 1, {r['sentences_per_s_batch32']:.0f}/s at batch 32"
                for d, r in sorted(result.items())
            )
        )
    for degree in DEGREES:
        for key in ("latency_ms_batch1", "sentences_per_s_batch32"):
            report["degrees"][degree][key] = statistics.median(r[degree][key] for r in report["runs"])
    name = "shards" if args.device == "cpu" else "shards-cuda"
    rows = "\n".join(
        f"| {d} | {r['latency_ms_batch1']:.1f} | {r['sentences_per_s_batch32']:.0f} | "
        f"{' / '.join(f'{b / 1e6:.1f}' for b in r['bytes_per_shard'])} | {r['largest_shard_share']:.3f} | "
        f"{r['max_abs_diff_vs_degree_1']:.1e} |"
        for d, r in report["degrees"].items()
    )
    markdown = f"""# Tensor-parallel shards: degree 1 vs 2 vs 4

`{report["command"]}` on {report["machine"]} ({args.device}); medians of {args.runs} runs; minilm, 16-token texts.

| degree | latency, 1 text (ms) | throughput, batch 32 (sentences/s) | weights per shard (MB) | largest shard's share | max abs diff vs degree 1 |
|---|---|---|---|---|---|
{rows}

Each shard holds about 1/N of the weights (shard 0 also holds the position and token-type embeddings).
""" + (
        "On the CPU the shards split the same cores, so sharding only adds its cost: 14 segment runs "
        "and 13 all-reduces per batch in place of one graph."
        if args.device == "cpu"
        else ""
    )

    def plot(rep, path):
        plt = pyplot()

        degrees = list(rep["degrees"])
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        axes[0].bar([str(d) for d in degrees], [rep["degrees"][d]["latency_ms_batch1"] for d in degrees])
        axes[0].set_title("latency, 1 text (ms)")
        axes[1].bar([str(d) for d in degrees], [rep["degrees"][d]["sentences_per_s_batch32"] for d in degrees])
        axes[1].set_title("throughput at batch 32 (sentences/s)")
        for ax in axes:
            ax.set_xlabel("tensor-parallel degree")
        fig.suptitle(f"minilm shards on {rep['device']}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    write(args.out, name, report, markdown, plot)
    for model in models.values():
        if isinstance(model, ShardedSession):
            model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
