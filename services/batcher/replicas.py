"""The model_server replicas as the batcher's backend: discovery by polling
ListModels, one RPC per batch to the least-loaded replica, one retry
elsewhere. Given Istio's VirtualService and DestinationRule files, the same
hop follows them as Envoy would: a route per batch (matched on the batch's
tier as the x-user-tier header), one weighted pick of a subset per batch, retries and
back-off per the route, outlier detection per subset.

Behind a service mesh (Kubernetes with Istio) the batcher is given one
address, a Service, and its sidecar balances, retries and ejects: then
(`behind_mesh`) a failed batch neither marks that address unready nor is
retried here, and since each poll reaches some pod, the catalog keeps what
recent polls saw instead of only the last one, through a failed poll or two."""

import asyncio
import logging
import random
from collections.abc import Callable

import grpc
from infermesh.model_server.v1 import model_server_pb2

from services.batcher import metrics, upstream
from services.batcher.config import ReplicaConfig
from services.batcher.discovery import Discovery, Replica
from services.batcher.pending import ModelLimits
from services.batcher.routing import Routing, tier_metadata
from services.common import errors, tracing, traffic
from services.common.protoconv import tensors_from_proto, tensors_to_proto, tier_to_proto
from services.common.tensors import TensorData
from services.common.tier import Tier

log = logging.getLogger(__name__)
# Worth one try on another replica: this one is down or has no ready version of the
# model (UNAVAILABLE), or too busy to finish the batch in time (a refusal:
# RESOURCE_EXHAUSTED with a retry-after-ms hint; gRPC's own RESOURCE_EXHAUSTED,
# e.g. a message over the size limit, is no reason to try elsewhere). See
# upstream.retry_elsewhere.


class ReplicaSet:
    """Implements batcher.core.Backend over gRPC: the client that sends each
    batch, over discovery (what the replicas serve) and routing (where a batch
    may go, and whether there is room)."""

    def __init__(
        self,
        config: ReplicaConfig,
        policy: traffic.PolicyFiles | None = None,
        rng: random.Random | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self._config = config
        self._replicas = [Replica(a, config.max_message_bytes, credentials) for a in config.addresses]
        self._policy = policy
        self._rng = rng or random.Random()
        self._listeners: list[Callable[[], None]] = []  # told after each round of polls
        self.discovery = Discovery(self._replicas, config.poll_s, config.behind_mesh, self._polled)
        self.routing = Routing(
            self._replicas, policy, config.max_inflight_per_replica, config.queued_per_replica, config.behind_mesh
        )

    async def start(self) -> None:
        await self.discovery.start()

    async def poll_once(self) -> None:
        await self.discovery.poll_once()

    def _polled(self) -> None:
        self.routing.wake_room_waiters()  # what the replicas can take may have grown
        for listener in self._listeners:
            listener()
        self.routing.reload_policy()

    def models(self) -> list:
        return self.discovery.models()

    def limits(self, model: str) -> ModelLimits | None:
        return self.discovery.limits(model)

    def slots(self, model: str) -> tuple[int, int, int]:
        return self.routing.slots(model)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Calls `listener` after each round of polls: the slots may have changed."""
        self._listeners.append(listener)

    async def execute(
        self,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        timeout_s: float,
        tier: Tier = Tier.STANDARD,
    ) -> tuple[str, list[TensorData]]:
        if self._policy is not None:
            return await self._execute_by_policy(self._policy, model, version, inputs, outputs, timeout_s, tier)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        request = model_server_pb2.ExecuteRequest(
            model=model, version=version, inputs=tensors_to_proto(inputs), outputs=outputs, tier=tier_to_proto(tier)
        )
        tried: set[str] = set()
        while True:
            replica = self.routing.choose(model, version, tier, tried)
            if replica is None:
                raise errors.Unavailable(
                    f"no ready model_server replica serves model '{model}'" + (f" version {version}" if version else "")
                )
            tried.add(replica.address)
            started = loop.time()
            try:
                with self.routing.inflight(replica, model, tier):
                    response = await replica.stub.Execute(
                        request,
                        timeout=max(deadline - loop.time(), 0.001),
                        metadata=(tier_metadata(tier) if self._config.behind_mesh else ()) + tracing.metadata() or None,
                    )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if (
                    upstream.retry_elsewhere(exc) and not self._config.behind_mesh
                ):  # behind a mesh its sidecar has retried already
                    # Out until its next poll says otherwise only when the connection failed: the model
                    # server's own UNAVAILABLE (a model with no ready version, a lost shard) is about
                    # one model, and the replica keeps serving the others.
                    gone = upstream.transport_failure(exc)
                    if gone:
                        replica.ready = False
                    # The model server's own status stands when no other replica could take the batch;
                    # a lost connection's is gRPC's, so the next turn answers why: no replica serves the model.
                    elsewhere = gone or self.routing.choose(model, version, tier, tried) is not None
                    if len(tried) < 2 and deadline - loop.time() > 0 and elsewhere:
                        log.warning(
                            "batch for %s failed on %s (%s); retrying once elsewhere", model, replica.address, code.name
                        )
                        metrics.RETRIES.labels(code.name).inc()
                        continue
                raise upstream.domain_error(exc) from None
            self.routing.observe_rpc(loop.time() - started)
            return response.version, tensors_from_proto(response.outputs)

    async def _execute_by_policy(
        self,
        policy: traffic.PolicyFiles,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        timeout_s: float,
        tier: Tier,
    ) -> tuple[str, list[TensorData]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        headers = dict(tier_metadata(tier))
        route = policy.service.route(headers)
        if route is None:
            raise errors.Unavailable(f"no route of VirtualService {policy.service.name} matches {headers}")
        destination = route.pick(self._rng)  # one weighted pick per batch; its retries stay in the subset
        detector = self.routing.detector(destination.subset)
        request = model_server_pb2.ExecuteRequest(
            model=model, version=version, inputs=tensors_to_proto(inputs), outputs=outputs, tier=tier_to_proto(tier)
        )
        tried: set[str] = set()
        if route.timeout_s is not None:  # the route's timeout bounds the call and all its retries
            deadline = min(deadline, loop.time() + route.timeout_s)
        for attempt in range(route.retries.attempts + 1):
            roomy = await self.routing.hosts_with_room(route, destination, model, version, tier, deadline)
            fresh = [r for r in roomy if r.address not in tried] or roomy  # Envoy's previous_hosts
            replica = min(fresh, key=lambda r: r.inflight)
            tried.add(replica.address)
            left = deadline - loop.time()
            per_try = min(left, route.retries.per_try_timeout_s or left)
            started = loop.time()
            try:
                with self.routing.inflight(replica, model, tier):
                    response = await replica.stub.Execute(
                        request, timeout=max(per_try, 0.001), metadata=tracing.metadata() or None
                    )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                metrics.UPSTREAM.labels(destination.subset, code.name).inc()
                metrics.UPSTREAM_LATENCY.labels(destination.subset).observe(loop.time() - started)
                if detector is not None and detector.record(
                    replica.address, code.name, loop.time(), local_origin=upstream.local_origin(exc)
                ):
                    log.warning(
                        "replica %s ejected from subset %s after consecutive errors",
                        replica.address,
                        destination.subset,
                    )
                    metrics.EJECTIONS.labels(replica.address).inc()
                if attempt < route.retries.attempts and route.retries.retries(
                    code.name, upstream.transport_failure(exc)
                ):
                    pause = traffic.backoff_s(attempt + 1, self._rng)
                    if deadline - loop.time() > pause:
                        metrics.RETRIES.labels(code.name).inc()
                        await asyncio.sleep(pause)
                        continue
                raise upstream.domain_error(exc) from None
            metrics.UPSTREAM.labels(destination.subset, "OK").inc()
            metrics.UPSTREAM_LATENCY.labels(destination.subset).observe(loop.time() - started)
            self.routing.observe_rpc(loop.time() - started)
            if detector is not None:
                detector.record(replica.address, "OK", loop.time())
            return response.version, tensors_from_proto(response.outputs)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def close(self) -> None:
        self.discovery.stop()
        await asyncio.gather(*(r.channel.close() for r in self._replicas))
