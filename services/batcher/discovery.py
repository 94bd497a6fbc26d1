"""Discovery of the model-server replicas: each polled with ListModels, its
catalog kept, marked ready or not. Behind a service mesh (one Service address
whose sidecar balances) each poll reaches some pod, so the catalog is what the
last few polls saw, merged."""

import asyncio
import collections
import logging
from collections.abc import Callable, Iterable

import grpc
from infermesh.common.v1.tensor_pb2 import ModelInfo
from infermesh.model_server.v1 import model_server_pb2, model_server_pb2_grpc

from services.batcher import metrics, upstream
from services.batcher.pending import ModelLimits
from services.common import tls
from services.common.serving import client_options

log = logging.getLogger(__name__)
MESH_HISTORY_POLLS = 5  # behind a mesh, the catalog is what this many recent polls saw
FAILED_POLLS = 3  # polls in a row that fail before a replica is taken out (or, behind a mesh, the catalog dropped)


class Replica:
    def __init__(self, address: str, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.channel = tls.aio_channel(address, credentials, client_options(max_message_bytes))
        self.stub = model_server_pb2_grpc.ModelServerStub(self.channel)
        self.models: dict[str, ModelInfo] = {}  # by name
        # Behind a mesh: the models of the last few polls.
        self.history: collections.deque[dict[str, ModelInfo]] = collections.deque(maxlen=MESH_HISTORY_POLLS)
        self.labels: dict[str, str] = {}
        self.running: collections.Counter = collections.Counter()  # (model, VIP or STANDARD) -> batches in flight
        self.polled_at = 0.0  # loop time the last answered poll was sent
        self.vip_sent_at: dict[str, float] = {}  # model -> loop time its latest VIP batch was sent here
        self.ready = False
        self.failed_polls = 0  # in a row

    @property
    def inflight(self) -> int:
        """Batches in flight here, of every model and tier."""
        return sum(self.running.values())


class Discovery:
    """What the replicas serve, as their latest polls say."""

    def __init__(self, replicas: list[Replica], poll_s: float, behind_mesh: bool, on_polled: Callable[[], None]):
        self.replicas = replicas
        self._poll_s = poll_s
        self._behind_mesh = behind_mesh
        self._on_polled = on_polled  # after each round of polls
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self.poll_once()
            except Exception:  # one bad round must not end discovery for good
                log.exception("replica poll failed")

    async def poll_once(self) -> None:
        """Polls every replica once, then tells `on_polled`."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas))
        self._on_polled()

    async def _poll(self, replica: Replica) -> None:
        sent_at = asyncio.get_running_loop().time()
        try:
            response = await replica.stub.ListModels(
                model_server_pb2.ListModelsRequest(), timeout=max(self._poll_s, 1.0)
            )
        except grpc.aio.AioRpcError as exc:
            replica.failed_polls += 1
            # A replica that is gone (its connection refused) is out at once, unless the address
            # is a mesh's Service, where the next poll reaches another pod. A slow answer is
            # not a dead replica: one too busy to answer its poll in time (overload, a long
            # batch holding its cores) keeps serving until FAILED_POLLS polls in a row fail.
            gone = upstream.gone(exc) and not self._behind_mesh
            if replica.ready and not gone and replica.failed_polls < FAILED_POLLS:
                log.warning("model server %s missed a poll (%s: %s)", replica.address, exc.code().name, exc.details())
            else:
                if replica.ready:
                    log.warning("replica %s stopped answering: %s: %s", replica.address, exc.code().name, exc.details())
                replica.ready, replica.models = False, {}
                replica.history.clear()
        else:
            replica.failed_polls = 0
            if not replica.ready:
                log.info("replica %s ready with models %s", replica.address, [m.name for m in response.models])
            seen = {m.name: m for m in response.models}
            if self._behind_mesh:  # each poll reached one pod of several: what the last few saw, merged
                replica.history.append(seen)
                replica.models = _merge_polls(replica.history)
            else:
                replica.models = seen
            replica.polled_at = sent_at
            replica.ready = True
            replica.labels = dict(response.labels)
        metrics.REPLICA_READY.labels(replica.address).set(1 if replica.ready else 0)

    def models(self) -> list[ModelInfo]:
        """Every model some ready replica serves, merged over replicas: the
        versions are the union (replicas of two colours may serve different
        versions during a rollout), newest first."""
        merged: dict[str, ModelInfo] = {}
        for replica in self.replicas:
            if not replica.ready:
                continue
            for name, info in replica.models.items():
                if name not in merged:
                    merged[name] = type(info)()
                    merged[name].CopyFrom(info)
                    continue
                for version, revision in info.revisions.items():
                    known = merged[name].revisions.get(version)
                    if known is not None and known != revision:  # replicas hold different files as one version
                        revision = "+".join(sorted(set(known.split("+")) | {revision}))
                    merged[name].revisions[version] = revision
                _add_versions(merged[name], info)
        return [merged[name] for name in sorted(merged)]

    def limits(self, model: str) -> ModelLimits | None:
        infos = [r.models[model] for r in self.replicas if r.ready and model in r.models]
        if not infos:
            return None
        return ModelLimits(
            min(i.max_batch_size for i in infos),
            tuple(spec.name for spec in infos[0].inputs),
            frozenset(v for i in infos for v in i.versions),
        )

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()


def _merge_polls(polls: Iterable[dict[str, ModelInfo]]) -> dict[str, ModelInfo]:
    """The models of several polls that may have reached different pods: each
    model as the newest poll that saw it describes it, with the versions every
    poll saw (pods of two colours serve different versions in a rollout).
    What no recent poll saw is gone."""
    merged: dict[str, ModelInfo] = {}
    for seen in polls:  # oldest first
        for name, info in seen.items():
            known = merged.get(name)
            merged[name] = type(info)()
            merged[name].CopyFrom(info)
            if known is None:
                continue
            _add_versions(merged[name], known)
            for version, revision in known.revisions.items():
                if version not in merged[name].revisions:
                    merged[name].revisions[version] = revision
    return merged


def _add_versions(into: ModelInfo, other: ModelInfo) -> None:
    """Gives the ModelInfo `into` the versions and ready versions of `other` too, newest first."""
    for field in ("versions", "ready_versions"):
        union = sorted(set(getattr(into, field)) | set(getattr(other, field)), key=_version_order, reverse=True)
        del getattr(into, field)[:]
        getattr(into, field).extend(union)


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
