"""Fixtures: the model repository, a real local mesh, a real redis-server; and
the test tiers (pytest.ini): each test has one, and a unit test stays in-process."""

import asyncio
import contextlib
import inspect
import os
import pathlib
import shutil
import socket
import subprocess
import time

import grpc
import numpy as np
import pytest

from services.common.metrics import scrape

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "build" / "models"
GHZ = ROOT / "bin" / "ghz"
MAX_REQUEST_BYTES = 4 * 1024 * 1024
TIERS = ("unit", "service", "e2e")


# INFERMESH_TEST_TLS=1 (make test TLS=1): every mesh the tests start runs on
# mutual TLS with certificates made for the run, and the tests' channels to
# its services present the admin-dev certificate (as programs the tests run
# do when given Mesh.client_files()).
TLS = os.environ.get("INFERMESH_TEST_TLS", "") not in ("", "0")


def pytest_configure(config):
    if TLS:
        _run_meshes_on_tls(config)


def _run_meshes_on_tls(config) -> None:
    """Made before any test runs (a unit test may start no process, openssl included)."""
    import tempfile
    import weakref

    from services.launcher import mesh as launcher
    from tools import certs

    folder = pathlib.Path(tempfile.mkdtemp(prefix="infermesh-test-certs-"))
    certs.make_all(folder)
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    meshes: weakref.WeakSet = weakref.WeakSet()
    init = launcher.Mesh.__init__

    def tls_init(self, *args, **kwargs):
        if "tls_dir" in kwargs:  # a test that chose (tests/test_tls.py) keeps its own channels
            return init(self, *args, **kwargs)
        init(self, *args, tls_dir=folder, **kwargs)
        meshes.add(self)

    def secure_to_meshes(open_plain, open_secure):
        def opened(target, *args, **kwargs):
            for running in list(meshes):
                if target in {p.info.get("grpc") for p in running.processes.values()}:
                    return open_secure(target, running.client_credentials(), *args, **kwargs)
            return open_plain(target, *args, **kwargs)

        return opened

    launcher.Mesh.__init__ = tls_init
    grpc.insecure_channel = secure_to_meshes(grpc.insecure_channel, grpc.secure_channel)
    grpc.aio.insecure_channel = secure_to_meshes(grpc.aio.insecure_channel, grpc.aio.secure_channel)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Refuses the run unless every test has exactly one tier: before -m selects by
    them, so a test without one is found by any run, `make test-fast` included."""
    wrong = []
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {' and '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one of the markers unit, service or e2e "
            "(pytest.ini says which is which):\n  " + "\n  ".join(wrong)
        )


@contextlib.contextmanager
def _in_process_only(broken: list[str]):
    """While it lasts, starting a process or a server, or binding an IP socket,
    fails and is written down in `broken` (in case the code swallows the error)."""

    def refuse(what):
        def refused(*args, **kwargs):
            broken.append(what)
            raise RuntimeError(f"a unit test {what}: mark it service or e2e")

        return refused

    bind = socket.socket.bind

    def guarded_bind(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            refuse(f"bound a socket to {address}")()
        return bind(sock, address)

    saved = [(subprocess.Popen, "__init__"), (socket.socket, "bind"), (grpc.aio, "server"), (grpc, "server")]
    originals = [getattr(owner, name) for owner, name in saved]
    subprocess.Popen.__init__ = refuse("started a subprocess")
    socket.socket.bind = guarded_bind
    grpc.aio.server = refuse("started a grpc.aio server")
    grpc.server = refuse("started a gRPC server")
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals, strict=True):
            setattr(owner, name, original)


def _unit_phase(item):
    """Runs one phase of a test; a unit test's fails if it left the process."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    broken: list[str] = []
    with _in_process_only(broken):
        result = yield
    if broken:
        pytest.fail(f"marked unit, but it {broken[0]}: mark it service or e2e (pytest.ini)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _unit_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _unit_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _unit_phase(item))


@pytest.fixture(scope="session")
def model_repository() -> pathlib.Path:
    if not (MODELS / "minilm" / "1" / "model.onnx").exists():
        pytest.fail(f"{MODELS} has no minilm model: run 'make setup' first")
    return MODELS


def _test_mesh(model_repository, tmp_path_factory):
    """A whole mesh (with its own redis-server) as the end-to-end tests expect it."""
    from services.launcher.mesh import Mesh, MeshConfig

    # Automatic cache bypass is off here (the tests send mostly unique texts yet expect lookups),
    # and so is the near cache: these tests watch the cache service itself.
    return Mesh(
        MeshConfig(
            models=model_repository,
            log_dir=tmp_path_factory.mktemp("mesh-logs"),
            l2_path=tmp_path_factory.mktemp("l2"),
            router_args=(
                "--max-request-bytes",
                str(MAX_REQUEST_BYTES),
                "--cache-min-hit-rate",
                "0",
                "--near-cache-ttl-s",
                "0",
            ),
        )
    )


@pytest.fixture(scope="session")
def mesh(model_repository, tmp_path_factory):
    """One whole mesh shared by the end-to-end tests. It learns from their traffic
    (batch latencies per size): a test whose outcome depends on what it has
    learned, or whose traffic would teach it what others must not inherit,
    takes `own_mesh` instead."""
    with _test_mesh(model_repository, tmp_path_factory) as running:
        yield running
        dead = running.dead()
        assert not dead, f"services died during the tests: {dead}"


@pytest.fixture
def own_mesh(model_repository, tmp_path_factory):
    """A mesh like `mesh` for one test alone, starting with nothing learned."""
    with _test_mesh(model_repository, tmp_path_factory) as running:
        yield running
        dead = running.dead()
        assert not dead, f"services died during the test: {dead}"


@pytest.fixture(scope="session")
def reference_embeddings():
    """sentence-transformers' own embeddings of the package weights (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tools.build_models.repository import reference_embeddings as compute

    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> np.ndarray:
        missing = [t for t in texts if t not in cache]
        if missing:
            for text, row in zip(missing, compute(missing), strict=True):
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


def fuzz_examples(full: int) -> int:
    """How many examples a property or fuzz test generates: `full` under make test, a share of
    it under make test-fast (INFERMESH_FUZZ_SCALE, 0 < scale <= 1), at least 50."""
    scale = float(os.environ.get("INFERMESH_FUZZ_SCALE", "1"))
    if not 0 < scale <= 1:
        raise ValueError(f"INFERMESH_FUZZ_SCALE must be in (0, 1], got {scale}")
    return max(50, round(full * scale))


def metric(url: str, name: str, **labels) -> float:
    """The sum of samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in scrape(url).items() if n == name and set(labels.items()) <= set(ls))


async def until(condition, what: str, timeout_s: float = 30.0, interval_s: float = 0.02):
    """Polls `condition` (a function, its result awaited if it is awaitable) until
    it returns something true, and returns that; fails naming `what` if it has
    not within timeout_s. The wait stands for a state, never for a time."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not so within {timeout_s:.0f} s")
        await asyncio.sleep(interval_s)


def wait_until(condition, what: str, timeout_s: float = 30.0, interval_s: float = 0.02):
    """`until` for tests without an event loop."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not so within {timeout_s:.0f} s")
        time.sleep(interval_s)
    return result


async def settle() -> None:
    """Lets every task that can go on run until it waits again (a turn handed on
    through a future takes more than one step of the event loop)."""
    for _ in range(5):
        await asyncio.sleep(0)
