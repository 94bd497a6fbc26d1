"""Routing of batches to the model-server replicas: which replicas a batch of
a tier may reach (all, or under a traffic policy those of the subsets its
route weighs above 0, less the ejected), how many batches each may hold, the
least-loaded choice, and the wait for room.

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

import asyncio
import contextlib
import math

from services.batcher import metrics
from services.batcher.discovery import Replica
from services.common import errors, traffic
from services.common.tier import Tier


class Routing:
    """Where the batches of each tier may go, and whether there is room."""

    def __init__(
        self,
        replicas: list[Replica],
        policy: traffic.PolicyFiles | None,
        max_inflight_per_replica: int,
        queued_per_replica: int,
        behind_mesh: bool,
    ):
        self._replicas = replicas
        self._policy = policy
        self._max_inflight = max_inflight_per_replica
        self._queued = queued_per_replica
        self._behind_mesh = behind_mesh
        self._detectors: dict[str, traffic.OutlierDetector] = {}  # per subset, as Envoy has one per subset cluster
        self._room_waiters: list[asyncio.Future] = []  # batches waiting for a replica under its in-flight bound
        self._rpc_s = 0.0  # a moving average of how long a batch's Execute takes

    def detector(self, subset: str) -> traffic.OutlierDetector | None:
        return self._detectors.get(subset)

    def reload_policy(self) -> None:
        """After a round of polls: the policy files may have changed, and the subsets' hosts."""
        if self._policy is None:
            return
        self._policy.reload()
        self.sync_detectors()
        now = asyncio.get_running_loop().time()
        for subset in self._policy.rule.subsets if self._policy.rule is not None else {}:
            detector = self._detectors.get(subset)
            metrics.SUBSET_READY.labels(subset).set(
                sum(
                    1
                    for r in self.subset_hosts(subset)
                    if r.ready and not (detector is not None and detector.is_ejected(r.address, now))
                )
            )

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
            return (
                sum(self._bound(r, model, Tier.STANDARD) for r in standard),
                sum(self._bound(r, model, Tier.VIP) for r in vip),
                0,
            )
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
            reachable += [r for r in self.in_service(destination.subset, now) if r in serving and r not in reachable]
        return reachable

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
            return replica.running[(model, Tier.VIP if tier >= Tier.VIP else Tier.STANDARD)] < self._bound(
                replica, model, tier
            )
        running = replica.running[(model, Tier.STANDARD)]
        if tier >= Tier.VIP:
            running += replica.running[(model, Tier.VIP)]
        return running < self._bound(replica, model, tier)

    def choose(self, model: str, version: str, tier: Tier, exclude: set[str]) -> Replica | None:
        """The least-loaded of the candidates (see _candidates) not yet tried,
        among those with room for the batch when any has."""
        candidates = _candidates([r for r in self._replicas if r.address not in exclude], model, version)
        roomy = [r for r in candidates if self._has_room(r, model, tier)]
        return min(roomy or candidates, key=lambda r: r.inflight, default=None)

    def observe_rpc(self, seconds: float) -> None:
        self._rpc_s = 0.8 * self._rpc_s + 0.2 * seconds if self._rpc_s else seconds

    def subset_hosts(self, subset: str) -> list[Replica]:
        assert self._policy is not None  # subsets are a traffic policy's
        rule = self._policy.rule
        if not subset:
            return list(self._replicas)
        labels = rule.subsets.get(subset, {}) if rule is not None else {}
        return [r for r in self._replicas if all(r.labels.get(k) == v for k, v in labels.items())]

    def in_service(self, subset: str, now: float) -> list[Replica]:
        """The subset's ready replicas that its outlier detection lets a batch
        reach: those not ejected, or all of them in Envoy's panic mode."""
        hosts = [r for r in self.subset_hosts(subset) if r.ready]
        detector = self._detectors.get(subset)
        if detector is None:
            return hosts
        routable = set(detector.routable([r.address for r in hosts], now))
        return [r for r in hosts if r.address in routable]

    def sync_detectors(self) -> None:
        """One detector per subset, kept across reloads of the policy: a
        VirtualService edit (meshctl set-weights) leaves ejections, error
        streaks and ejection multipliers as they were, as it does in Istio,
        where it reaches Envoy's routes and not its clusters. Only a subset
        whose outlierDetection changed starts afresh, as Envoy's cluster does
        when Istio sends it a changed configuration."""
        assert self._policy is not None  # subsets are a traffic policy's
        rule = self._policy.rule
        outliers = {} if rule is None else {s: rule.outlier_for(s) for s in [*rule.subsets, ""]}
        policies = {subset: policy for subset, policy in outliers.items() if policy is not None}
        self._detectors = {s: d for s, d in self._detectors.items() if s in policies}
        for subset, policy in policies.items():
            hosts = [r.address for r in self.subset_hosts(subset)]
            detector = self._detectors.get(subset)
            if detector is None or detector.policy != policy:
                self._detectors[subset] = traffic.OutlierDetector(policy, hosts)
            else:
                detector.set_hosts(hosts)

    async def hosts_with_room(
        self, route, destination, model: str, version: str, tier: Tier, deadline: float
    ) -> list[Replica]:
        """The hosts of the destination's subset in service (_in_service) that
        serve the version and have room for the batch (see the class), waiting
        for room if need be: the batcher's slots are counted over every subset
        the route reaches, and the weighted pick chose one of them."""
        loop = asyncio.get_running_loop()
        while True:
            candidates = _candidates(self.in_service(destination.subset, loop.time()), model, version)
            if not candidates:  # Envoy's "no healthy upstream": a 503 in the subset's figures too
                metrics.UPSTREAM.labels(destination.subset, "UNAVAILABLE").inc()
                raise errors.Unavailable(
                    f"no healthy upstream for model '{model}' in subset "
                    f"'{destination.subset or destination.host}' (route {route.name})"
                )
            roomy = [r for r in candidates if self._has_room(r, model, tier)]
            if roomy:
                return roomy
            await self._wait_for_room(
                model,
                destination.subset or destination.host,
                max(self._bound(r, model, tier) for r in candidates),
                deadline,
            )

    @contextlib.contextmanager
    def inflight(self, replica: Replica, model: str, tier: Tier):
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
            self.wake_room_waiters()

    def wake_room_waiters(self) -> None:
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
                retry_after_ms=max(1, round(1000 * self._rpc_s)),
            ) from None
        finally:
            if waiter in self._room_waiters:
                self._room_waiters.remove(waiter)


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
    ready = [
        r for r in usable if (version in r.models[model].ready_versions if version else r.models[model].ready_versions)
    ]
    if ready or not version:
        return ready
    return [r for r in usable if version in r.models[model].versions]
