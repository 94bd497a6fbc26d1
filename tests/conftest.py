"""Fixtures: the model repository, a real local mesh, a real redis-server."""

import asyncio
import os
import pathlib
import shutil

import numpy as np
import pytest

from services.common.metrics import scrape

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "build" / "models"
GHZ = ROOT / "bin" / "ghz"
MAX_REQUEST_BYTES = 4 * 1024 * 1024


@pytest.fixture(scope="session")
def model_repository() -> pathlib.Path:
    if not (MODELS / "minilm" / "1" / "model.onnx").exists():
        pytest.fail(f"{MODELS} has no minilm model: run 'make setup' first")
    return MODELS


@pytest.fixture(scope="session")
def mesh(model_repository, tmp_path_factory):
    """One whole mesh (with its own redis-server) shared by the end-to-end tests."""
    from services.launcher.mesh import Mesh

    log_dir = tmp_path_factory.mktemp("mesh-logs")
    # Automatic cache bypass is off here (the tests send mostly unique texts yet expect lookups),
    # and so is the near cache: these tests watch the cache service itself.
    with Mesh(models=model_repository, log_dir=log_dir, l2_path=tmp_path_factory.mktemp("l2"),
              router_args=("--max-request-bytes", str(MAX_REQUEST_BYTES), "--cache-min-hit-rate", "0",
                           "--near-cache-ttl-s", "0")) as running:
        yield running
        dead = running.dead()
        assert not dead, f"services died during the tests: {dead}"


@pytest.fixture(scope="session")
def reference_embeddings():
    """sentence-transformers' own embeddings of the package weights (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from services.model_server.build_repository import reference_embeddings as compute

    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> np.ndarray:
        missing = [t for t in texts if t not in cache]
        if missing:
            for text, row in zip(missing, compute(missing)):
                cache[text] = row
        return np.stack([cache[t] for t in texts])

    return embed


@pytest.fixture(scope="session")
def ghz_binary() -> pathlib.Path:
    if not GHZ.exists():
        pytest.fail(f"{GHZ} is missing: run 'make setup' first")
    return GHZ


@pytest.fixture(scope="session")
def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail("redis-server is not installed: run 'make setup' first")
    return path


def metric(url: str, name: str, **labels) -> float:
    """The sum of samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in scrape(url).items() if n == name and set(labels.items()) <= set(ls))


async def settle() -> None:
    """Lets every task that can go on run until it waits again (a turn handed on
    through a future takes more than one step of the event loop)."""
    for _ in range(5):
        await asyncio.sleep(0)
