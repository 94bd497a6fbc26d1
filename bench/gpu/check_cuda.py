"""On a GPU machine: the model server's CUDA path (one device per instance,
IOBinding) and a tensor-parallel version with its shards on the GPUs give the
CPU's embeddings within 1e-3. Writes a JSON line per check to stdout.

    .venv/bin/python -m bench.gpu.check_cuda
"""

import asyncio
import json
import pathlib
import shutil
import tempfile

import numpy as np

from services.common.tensors import from_numpy, to_numpy
from services.model_server.core import ManagerConfig, ModelManager

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXTS = ["", "a GPU check", "Проверка на видеокарте", " ".join(["long"] * 300)]


async def embed(repository: pathlib.Path, device: str, overrides: dict | None = None) -> tuple[str, np.ndarray]:
    manager = ModelManager(ManagerConfig(str(repository), device, 4, startup_models=("minilm",), probe_interval_s=0))
    await manager.start()
    if overrides:
        await manager.load("minilm", overrides)
    texts = np.array([t.encode() for t in TEXTS], dtype=object)
    _, outputs = await manager.execute("minilm", "", [from_numpy("TEXT", texts, "BYTES")], [])
    provider = manager.resolve("minilm", "").provider
    await manager.close()
    return provider, to_numpy(outputs[0])


async def main() -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-gpu-"))
    (work / "minilm").symlink_to((ROOT / "build" / "models" / "minilm").resolve(), target_is_directory=True)
    _, cpu = await embed(work, "cpu")
    failed = 0
    for label, overrides in (
        ("whole model", None),
        ("tp_degree 2", {"tp_degree": 2}),
        ("tp_degree 4", {"tp_degree": 4}),
    ):
        provider, gpu = await embed(work, "cuda", overrides)
        diff = float(np.abs(gpu - cpu).max())
        ok = provider == "CUDAExecutionProvider" and diff <= 1e-3
        failed += not ok
        print(json.dumps({"check": label, "provider": provider, "max_abs_diff_vs_cpu": diff, "ok": ok}), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
