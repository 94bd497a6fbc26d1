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
import collections
import contextlib
import logging
import math
import random
from collections.abc import Callable

import grpc
from infermesh.model_server.v1 import model_server_pb2, model_server_pb2_grpc

from services.batcher import metrics
from services.batcher.pending import ModelLimits
from services.common import errors, tls, traffic
from services.common.serving import client_options
from services.common.protoconv import tensors_from_proto, tensors_to_proto
from services.common.tensors import TensorData
from services.common.tier import Tier

log = logging.getLogger(__name__)
# Worth one try on another replica: this one is down or has no ready version of the
# model (UNAVAILABLE), or too busy to finish the batch in time (a refusal:
# RESOURCE_EXHAUSTED with a retry-after-ms hint; gRPC's own RESOURCE_EXHAUSTED,
# e.g. a message over the size limit, is no reason to try elsewhere). See
# _retry_elsewhere.


class Replica:
    def __init__(self, address: str, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.channel = tls.aio_channel(address, credentials, client_options(max_message_bytes))
        self.stub = model_server_pb2_grpc.ModelServerStub(self.channel)
        self.models: dict[str, object] = {}  # name -> common.v1.ModelInfo
        self.history: collections.deque = collections.deque(maxlen=MESH_HISTORY_POLLS)  # behind a mesh
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


class ReplicaSet:
    """Implements batcher.core.Backend over gRPC.

    How many batches of a model a replica is sent at once follows what it
    reports of the model (ModelInfo.instances): standard batches up to the
    instances they may use now (the general ones, and the VIP-only ones while
    those are lent out), VIP batches up to every instance and one more, which
    waits at the model server's VIP-first gate rather than here. So a batch
    leaves the queue when an instance can start it: its requests are not
    committed to a batch that would wait at the model server, where they could
    only be refused late, while here admission refuses in microseconds and the
    queue may still regroup them (`queued_per_replica` sends more standard
    batches, to wait there). A replica that does not report its instances
    (behind a mesh, a Service of several pods) gets `max_inflight_per_replica`."""

    def __init__(self, addresses: tuple[str, ...], max_inflight_per_replica: int, poll_s: float, max_message_bytes: int,
                 policy: traffic.PolicyFiles | None = None, rng: random.Random | None = None,
                 behind_mesh: bool = False, queued_per_replica: int = 0,
                 credentials: grpc.ChannelCredentials | None = None):
        self._replicas = [Replica(a, max_message_bytes, credentials) for a in addresses]
        self._queued = queued_per_replica
        self._behind_mesh = behind_mesh
        self._max_inflight = max_inflight_per_replica
        self._poll_s = poll_s
        self._poller: asyncio.Task | None = None
        self._policy = policy
        self._rng = rng or random.Random()
        self._detectors: dict[str, traffic.OutlierDetector] = {}  # per subset, as Envoy has one per subset cluster
        self._room_waiters: list[asyncio.Future] = []  # batches waiting for a replica under its in-flight bound
        self._rpc_s = 0.0  # a moving average of how long a batch's Execute takes
        self._listeners: list[Callable[[], None]] = []  # told after each round of polls

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
        await asyncio.gather(*(self._poll(r) for r in self._replicas))
        self._wake_room_waiters()  # what the replicas can take may have grown
        for listener in self._listeners:
            listener()
        if self._policy is not None:
            self._policy.reload()
            self._sync_detectors()
            now = asyncio.get_running_loop().time()
            for subset in (self._policy.rule.subsets if self._policy.rule is not None else {}):
                detector = self._detectors.get(subset)
                metrics.SUBSET_READY.labels(subset).set(sum(
                    1 for r in self._subset_hosts(subset)
                    if r.ready and not (detector is not None and detector.is_ejected(r.address, now))))

    async def _poll(self, replica: Replica) -> None:
        sent_at = asyncio.get_running_loop().time()
        try:
            response = await replica.stub.ListModels(model_server_pb2.ListModelsRequest(), timeout=max(self._poll_s, 1.0))
        except grpc.aio.AioRpcError as exc:
            replica.failed_polls += 1
            # A replica that is gone (its connection refused) is out at once, unless the address
            # is a mesh's Service, where the next poll reaches another pod. A slow answer is
            # not a dead replica: one too busy to answer its poll in time (overload, a long
            # batch holding its cores) keeps serving until FAILED_POLLS polls in a row fail.
            gone = _gone(exc) and not self._behind_mesh
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

    def models(self) -> list:
        """Every model some ready replica serves, merged over replicas: the
        versions are the union (replicas of two colours may serve different
        versions during a rollout), newest first."""
        merged = {}
        for replica in self._replicas:
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
        infos = [r.models[model] for r in self._replicas if r.ready and model in r.models]
        if not infos:
            return None
        return ModelLimits(min(i.max_batch_size for i in infos), tuple(spec.name for spec in infos[0].inputs),
                           frozenset(v for i in infos for v in i.versions))

    def slots(self, model: str) -> tuple[int, int, int]:
        """(batches of any tier, more batches for VIP work only, how many of the
        first VIP batches can reach) that the ready replicas serving the model
        can take at once now. Each tier counts the replicas it can reach (see
        _reachable): under Istio's VIP-pool route, the VIP pool's room is VIP
        work's alone, and the standard pool's is standard work's alone, as a
        batch sent for room only the other pool has would wait for its own
        (_hosts_with_room)."""
        standard, vip = self._reachable(model, Tier.STANDARD), self._reachable(model, Tier.VIP)
        if self._behind_mesh:
            # One Service address, behind which the mesh may route VIP batches to a pool
            # of their own (mesh/istio's x-user-tier route): each tier has its own bound
            # there, so a standard surge cannot take the VIP batches' room.
            return (sum(self._bound(r, model, Tier.STANDARD) for r in standard),
                    sum(self._bound(r, model, Tier.VIP) for r in vip), 0)
        general = sum(self._bound(r, model, Tier.STANDARD) for r in standard)
        shared = sum(self._bound(r, model, Tier.STANDARD) for r in vip if r in standard)  # VIP may use those too
        return general, sum(self._bound(r, model, Tier.VIP) for r in vip) - shared, shared

    def _reachable(self, model: str, tier: Tier) -> list[Replica]:
        """The ready replicas serving the model that a batch of `tier`
        may be sent to: all of them, or under a traffic policy those of the
        subsets its route weighs above 0, less those ejected."""
        serving = [r for r in self._replicas if r.ready and model in r.models]
        if self._policy is None:
            return serving
        route = self._policy.service.route(dict(tier_metadata(tier)))
        if route is None:
            return []
        now = asyncio.get_running_loop().time()
        reachable = []
        for destination in route.destinations:
            if destination.weight == 0:
                continue
            reachable += [r for r in self._in_service(destination.subset, now) if r in serving and r not in reachable]
        return reachable

    def on_change(self, listener: Callable[[], None]) -> None:
        """Calls `listener` after each round of polls: the slots may have changed."""
        self._listeners.append(listener)

    def _bound(self, replica: Replica, model: str, tier: Tier) -> int:
        """How many batches of `model` the replica may have in flight when the
        next is of `tier` (see the class): a standard batch counts the
        standard ones, a VIP batch all of them; behind a mesh each tier counts
        its own (_has_room)."""
        if self._behind_mesh:
            return self._max_inflight
        info = replica.models.get(model)
        if info is None or info.instances < 1:
            standard = every = self._max_inflight
        else:
            # Lent out as of the last poll, unless a VIP batch went there since it was
            # sent: at the model server that batch ended the loan.
            lent = info.lending and replica.vip_sent_at.get(model, -math.inf) < replica.polled_at
            standard = info.instances - (0 if lent else info.reserved_instances) + self._queued
            every = info.instances + self._queued
        return every + 1 if tier >= Tier.VIP else standard

    def _has_room(self, replica: Replica, model: str, tier: Tier) -> bool:
        if self._behind_mesh:
            return replica.running[(model, Tier.VIP if tier >= Tier.VIP else Tier.STANDARD)] < self._bound(replica, model, tier)
        running = replica.running[(model, Tier.STANDARD)]
        if tier >= Tier.VIP:
            running += replica.running[(model, Tier.VIP)]
        return running < self._bound(replica, model, tier)

    def _choose(self, model: str, version: str, tier: Tier, exclude: set[str]) -> Replica | None:
        """The least-loaded of the candidates (see _candidates) not yet tried,
        among those with room for the batch when any has."""
        candidates = _candidates([r for r in self._replicas if r.address not in exclude], model, version)
        roomy = [r for r in candidates if self._has_room(r, model, tier)]
        return min(roomy or candidates, key=lambda r: r.inflight, default=None)

    async def execute(self, model: str, version: str, inputs: list[TensorData], outputs: list[str],
                      timeout_s: float, tier: Tier = Tier.STANDARD) -> tuple[str, list[TensorData]]:
        if self._policy is not None:
            return await self._execute_by_policy(model, version, inputs, outputs, timeout_s, tier)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        request = model_server_pb2.ExecuteRequest(model=model, version=version, inputs=tensors_to_proto(inputs),
                                                  outputs=outputs, tier=tier)
        tried: set[str] = set()
        while True:
            replica = self._choose(model, version, tier, tried)
            if replica is None:
                raise errors.Unavailable(
                    f"no ready model_server replica serves model '{model}'" + (f" version {version}" if version else ""))
            tried.add(replica.address)
            started = loop.time()
            try:
                with self._inflight(replica, model, tier):
                    response = await replica.stub.Execute(request, timeout=max(deadline - loop.time(), 0.001),
                                                          metadata=tier_metadata(tier) if self._behind_mesh else None)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if _retry_elsewhere(exc) and not self._behind_mesh:  # behind a mesh its sidecar has retried already
                    # Out until its next poll says otherwise only when the connection failed: the model
                    # server's own UNAVAILABLE (a model with no ready version, a lost shard) is about
                    # one model, and the replica keeps serving the others.
                    gone = _transport_failure(exc)
                    if gone:
                        replica.ready = False
                    # The model server's own status stands when no other replica could take the batch;
                    # a lost connection's is gRPC's, so the next turn answers why: no replica serves the model.
                    elsewhere = gone or self._choose(model, version, tier, tried) is not None
                    if len(tried) < 2 and deadline - loop.time() > 0 and elsewhere:
                        log.warning("batch for %s failed on %s (%s); retrying once elsewhere", model, replica.address, code.name)
                        metrics.RETRIES.labels(code.name).inc()
                        continue
                raise _domain_error(exc) from None
            self._observe_rpc(loop.time() - started)
            return response.version, tensors_from_proto(response.outputs)

    def _observe_rpc(self, seconds: float) -> None:
        self._rpc_s = 0.8 * self._rpc_s + 0.2 * seconds if self._rpc_s else seconds

    # ------------------------------------------------------------ Istio semantics

    def _subset_hosts(self, subset: str) -> list[Replica]:
        rule = self._policy.rule
        if not subset:
            return list(self._replicas)
        labels = rule.subsets.get(subset, {}) if rule is not None else {}
        return [r for r in self._replicas if all(r.labels.get(k) == v for k, v in labels.items())]

    def _in_service(self, subset: str, now: float) -> list[Replica]:
        """The subset's ready replicas that its outlier detection lets a batch
        reach: those not ejected, or all of them in Envoy's panic mode."""
        hosts = [r for r in self._subset_hosts(subset) if r.ready]
        detector = self._detectors.get(subset)
        if detector is None:
            return hosts
        routable = set(detector.routable([r.address for r in hosts], now))
        return [r for r in hosts if r.address in routable]

    def _sync_detectors(self) -> None:
        """One detector per subset, kept across reloads of the policy: a
        VirtualService edit (meshctl set-weights) leaves ejections, error
        streaks and ejection multipliers as they were, as it does in Istio,
        where it reaches Envoy's routes and not its clusters. Only a subset
        whose outlierDetection changed starts afresh, as Envoy's cluster does
        when Istio sends it a changed configuration."""
        rule = self._policy.rule
        policies = {} if rule is None else {s: rule.outlier_for(s) for s in [*rule.subsets, ""]}
        policies = {subset: policy for subset, policy in policies.items() if policy is not None}
        self._detectors = {s: d for s, d in self._detectors.items() if s in policies}
        for subset, policy in policies.items():
            hosts = [r.address for r in self._subset_hosts(subset)]
            detector = self._detectors.get(subset)
            if detector is None or detector.policy != policy:
                self._detectors[subset] = traffic.OutlierDetector(policy, hosts)
            else:
                detector.set_hosts(hosts)

    async def _execute_by_policy(self, model: str, version: str, inputs: list[TensorData], outputs: list[str],
                                 timeout_s: float, tier: Tier) -> tuple[str, list[TensorData]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        headers = dict(tier_metadata(tier))
        route = self._policy.service.route(headers)
        if route is None:
            raise errors.Unavailable(f"no route of VirtualService {self._policy.service.name} matches {headers}")
        destination = route.pick(self._rng)  # one weighted pick per batch; its retries stay in the subset
        detector = self._detectors.get(destination.subset)
        request = model_server_pb2.ExecuteRequest(model=model, version=version, inputs=tensors_to_proto(inputs),
                                                  outputs=outputs, tier=tier)
        tried: set[str] = set()
        if route.timeout_s is not None:  # the route's timeout bounds the call and all its retries
            deadline = min(deadline, loop.time() + route.timeout_s)
        for attempt in range(route.retries.attempts + 1):
            roomy = await self._hosts_with_room(route, destination, model, version, tier, deadline)
            fresh = [r for r in roomy if r.address not in tried] or roomy  # Envoy's previous_hosts
            replica = min(fresh, key=lambda r: r.inflight)
            tried.add(replica.address)
            left = deadline - loop.time()
            per_try = min(left, route.retries.per_try_timeout_s or left)
            started = loop.time()
            try:
                with self._inflight(replica, model, tier):
                    response = await replica.stub.Execute(request, timeout=max(per_try, 0.001))
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                metrics.UPSTREAM.labels(destination.subset, code.name).inc()
                metrics.UPSTREAM_LATENCY.labels(destination.subset).observe(loop.time() - started)
                if detector is not None and detector.record(replica.address, code.name, loop.time(),
                                                            local_origin=_local_origin(exc)):
                    log.warning("replica %s ejected from subset %s after consecutive errors", replica.address,
                                destination.subset)
                    metrics.EJECTIONS.labels(replica.address).inc()
                if attempt < route.retries.attempts and route.retries.retries(code.name, _transport_failure(exc)):
                    pause = traffic.backoff_s(attempt + 1, self._rng)
                    if deadline - loop.time() > pause:
                        metrics.RETRIES.labels(code.name).inc()
                        await asyncio.sleep(pause)
                        continue
                raise _domain_error(exc) from None
            metrics.UPSTREAM.labels(destination.subset, "OK").inc()
            metrics.UPSTREAM_LATENCY.labels(destination.subset).observe(loop.time() - started)
            self._observe_rpc(loop.time() - started)
            if detector is not None:
                detector.record(replica.address, "OK", loop.time())
            return response.version, tensors_from_proto(response.outputs)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _hosts_with_room(self, route, destination, model: str, version: str, tier: Tier,
                               deadline: float) -> list[Replica]:
        """The hosts of the destination's subset in service (_in_service) that
        serve the version and have room for the batch (see the class), waiting
        for room if need be: the batcher's slots are counted over every subset
        the route reaches, and the weighted pick chose one of them."""
        loop = asyncio.get_running_loop()
        while True:
            candidates = _candidates(self._in_service(destination.subset, loop.time()), model, version)
            if not candidates:  # Envoy's "no healthy upstream": a 503 in the subset's figures too
                metrics.UPSTREAM.labels(destination.subset, "UNAVAILABLE").inc()
                raise errors.Unavailable(f"no healthy upstream for model '{model}' in subset "
                                         f"'{destination.subset or destination.host}' (route {route.name})")
            roomy = [r for r in candidates if self._has_room(r, model, tier)]
            if roomy:
                return roomy
            await self._wait_for_room(model, destination.subset or destination.host,
                                      max(self._bound(r, model, tier) for r in candidates), deadline)

    @contextlib.contextmanager
    def _inflight(self, replica: Replica, model: str, tier: Tier):
        key = (model, Tier.VIP if tier >= Tier.VIP else Tier.STANDARD)
        if tier >= Tier.VIP:
            replica.vip_sent_at[model] = asyncio.get_running_loop().time()
        replica.running[key] += 1
        metrics.INFLIGHT.labels(replica.address).set(replica.inflight)
        try:
            yield
        finally:
            replica.running[key] -= 1
            metrics.INFLIGHT.labels(replica.address).set(replica.inflight)
            self._wake_room_waiters()

    def _wake_room_waiters(self) -> None:
        waiting, self._room_waiters = self._room_waiters, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_for_room(self, model: str, subset: str, limit: int, deadline: float) -> None:
        """Until some batch finishes (any replica: the caller looks again), or
        RESOURCE_EXHAUSTED once the batch could no longer run before its
        deadline: refused while the caller still has time to hear it."""
        loop = asyncio.get_running_loop()
        left = deadline - loop.time() - self._rpc_s - errors.REFUSAL_MARGIN_S
        waiter = loop.create_future()
        self._room_waiters.append(waiter)
        try:
            if left <= 0:
                raise TimeoutError
            await asyncio.wait_for(waiter, left)
        except TimeoutError:
            raise errors.ResourceExhausted(
                f"every replica of subset '{subset}' serving model '{model}' had as many batches in flight as "
                f"it may ({limit}) until this batch could no longer finish before its deadline; retry shortly",
                retry_after_ms=max(1, round(1000 * self._rpc_s))) from None
        finally:
            if waiter in self._room_waiters:
                self._room_waiters.remove(waiter)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(r.channel.close() for r in self._replicas))


MESH_HISTORY_POLLS = 5  # behind a mesh, the catalog is what this many recent polls saw
FAILED_POLLS = 3  # polls in a row that fail before a replica is taken out (or, behind a mesh, the catalog dropped)


def _merge_polls(polls) -> dict:
    """The models of several polls that may have reached different pods: each
    model as the newest poll that saw it describes it, with the versions every
    poll saw (pods of two colours serve different versions in a rollout).
    What no recent poll saw is gone."""
    merged: dict = {}
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


def _add_versions(into, other) -> None:
    """Gives the ModelInfo `into` the versions and ready versions of `other` too, newest first."""
    for field in ("versions", "ready_versions"):
        union = sorted(set(getattr(into, field)) | set(getattr(other, field)), key=_version_order, reverse=True)
        del getattr(into, field)[:]
        getattr(into, field).extend(union)


def tier_metadata(tier: Tier) -> tuple[tuple[str, str], ...]:
    """The batch's tier as the header a VirtualService route matches. A VIP-led
    batch holds VIP requests only, so the whole batch may take the VIP route.
    The model server reads the tier from ExecuteRequest.tier alone; the header
    is sent only behind a mesh, whose sidecar routes on headers, not messages
    (outside one, this batcher matches its own routes on it and sends none)."""
    return (("x-user-tier", Tier(tier).label),)


def _candidates(replicas: list[Replica], model: str, version: str) -> list[Replica]:
    """The ready replicas where the version (any, when none is named) is ready;
    failing that, for a named version, those that still hold it loaded (a
    standby right after a swap), so a request routed on a slightly older
    catalog still gets its answer."""
    usable = [r for r in replicas if r.ready and model in r.models]
    ready = [r for r in usable
             if (version in r.models[model].ready_versions if version else r.models[model].ready_versions)]
    if ready or not version:
        return ready
    return [r for r in usable if version in r.models[model].versions]


# How grpc reports a connection that failed or a stream that was lost, as
# opposed to a status our servers sent.
TRANSPORT_MARKERS = ("failed to connect", "socket closed", "connection reset", "connection refused", "broken pipe",
                     "goaway", "stream removed", "connect failed")


def _retry_elsewhere(exc: grpc.aio.AioRpcError) -> bool:
    """Down or without a ready version of the model, or refused for being busy
    (our servers' refusals carry a retry hint)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE or (
        exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and errors.retry_after_ms(exc.trailing_metadata()) > 0)


def _domain_error(exc: grpc.aio.AioRpcError) -> errors.InfermeshError:
    """The model server's status as our error, with its retry hint when it sent
    one (a refused batch carries `retry-after-ms` in its trailers)."""
    code = exc.code()
    return errors.from_code(code.value[0], exc.details() or code.name, errors.retry_after_ms(exc.trailing_metadata()))


def _local_origin(exc: grpc.aio.AioRpcError) -> bool:
    """A failure on our side of the call: the connection failed, or our own
    deadline ran out (gRPC's own "Deadline Exceeded"; a server that sends
    DEADLINE_EXCEEDED says more than that)."""
    return _transport_failure(exc) or (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                                       and (exc.details() or "") == "Deadline Exceeded")


def _gone(exc: grpc.aio.AioRpcError) -> bool:
    """The replica is not there: nothing listens, or the connection was torn
    down. A ping or a handshake that timed out is not that: a starved process
    misses those too."""
    details = (exc.details() or "").lower()
    return _transport_failure(exc) and not any(slow in details for slow in ("ping timeout", "keepalive", "timed out"))


def _transport_failure(exc: grpc.aio.AioRpcError) -> bool:
    """gRPC's UNAVAILABLE for a connection or stream that failed; never a
    status our server sent, whose message may quote such a failure of its own."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or errors.is_server_status(exc.trailing_metadata()):
        return False
    details = (exc.details() or "").lower()
    return any(marker in details for marker in TRANSPORT_MARKERS)


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
