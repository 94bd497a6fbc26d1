"""The garbage collector helpers every service runs: pauses timed, startup heap frozen."""

import asyncio
import gc
import weakref

import prometheus_client
import pytest

from services.common import collector
from services.model_server.core import ManagerConfig, ModelManager
from tests.test_model_repository import repo  # noqa: F401 - the mlp repository fixture

pytestmark = pytest.mark.unit


def sample(name: str, **labels) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def test_each_collection_is_timed_by_its_generation():
    collector.measure_pauses()
    collector.measure_pauses()  # once is enough: a second call adds no second timer
    assert gc.callbacks.count(collector._observe) == 1
    full, young = (sample("infermesh_gc_pause_seconds_count", generation=g) for g in ("2", "0"))
    spent = sample("infermesh_gc_pause_seconds_sum", generation="2")
    gc.collect(2)
    gc.collect(0)
    assert sample("infermesh_gc_pause_seconds_count", generation="2") == full + 1
    assert sample("infermesh_gc_pause_seconds_sum", generation="2") > spent
    assert sample("infermesh_gc_pause_seconds_count", generation="0") >= young + 1


def test_the_startup_heap_leaves_the_collectors_walks_and_still_dies_by_reference_count():
    class Built:
        pass

    try:
        built = Built()
        frozen = collector.freeze_startup_heap()
        # Another thread (a gRPC poller, a client's) may free a frozen object meanwhile: never more.
        assert frozen >= gc.get_freeze_count() > 0.99 * frozen
        assert sample("infermesh_gc_frozen_objects") == frozen
        assert not any(obj is built for obj in gc.get_objects())  # no generation holds it now
        gone = []
        weakref.finalize(built, gone.append, True)
        del built  # frozen, yet freed as soon as nothing refers to it
        assert gone == [True]
    finally:
        gc.unfreeze()


async def test_a_version_loaded_before_the_freeze_is_freed_when_unloaded(repo):
    """A model server freezes its startup models; hot swap and unload must
    still give their sessions back."""
    manager = ModelManager(ManagerConfig(str(repo), "cpu", 1, probe_interval_s=0))
    await manager.start()
    try:
        loaded = manager.resolve("mlp", "")
        alive = [weakref.ref(loaded), *(weakref.ref(instance.session) for instance in loaded.instances)]
        del loaded
        collector.freeze_startup_heap()
        await manager.unload("mlp")
        await manager.close()  # waits for the retired version to close
        # The executor thread that ran close() drops its work item (the bound
        # method, and so the version) only after it has woken this loop: on a
        # busy machine that can come a moment later.
        for _ in range(500):
            gc.collect()
            if all(ref() is None for ref in alive):
                break
            await asyncio.sleep(0.01)
        assert [ref() for ref in alive] == [None] * len(alive)
    finally:
        gc.unfreeze()
