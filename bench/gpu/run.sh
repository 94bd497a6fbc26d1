#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine: the model server's CUDA
# path (provider, IOBinding) and the shard benchmark with shard i on GPU
# i % (number of GPUs). Results go to $OUT (default bench/results/gpu).
#
#   bash bench/gpu/run.sh            # after 'make setup' on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=.venv/bin/python
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$OUT/gpus.csv"
"$PY" -c 'import onnxruntime as o; print(o.get_available_providers())' | tee "$OUT/providers.txt"
# The same shard benchmark as on the CPU, on the GPUs.
"$PY" -m bench.shards --runs 3 --device cuda --out "$OUT" 2>&1 | tee "$OUT/shards.log"
# The model server on CUDA (IOBinding), whole and sharded, against the CPU's answers.
"$PY" -m bench.gpu.check_cuda 2>&1 | tee "$OUT/check_cuda.jsonl"
