"""The router's gRPC clients: the batcher (submit and catalog) and the cache."""

import asyncio
import contextlib
import logging

import grpc
from infermesh.batcher.v1 import batcher_pb2, batcher_pb2_grpc
from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc

from services.common import errors, tls, tracing
from services.common.protoconv import tensors_from_proto, tensors_to_proto, tier_to_proto
from services.common.serving import client_options
from services.common.streams import Framing, StreamLost, StreamMux
from services.common.tensors import TensorData
from services.common.tier import Tier
from services.router import metrics
from services.router.core import Catalog, ModelSignature, Spec

log = logging.getLogger(__name__)


STREAM_TURN_S = 0.02
# A request whose stream was lost goes once more, if this much of its time is left
# (less would only turn into DEADLINE_EXCEEDED), after the batcher's channel is back
# or RETRY_WAIT_S has passed: a restarted batcher serves again within about that.
MIN_RETRY_S = 0.05
RETRY_WAIT_S = 5.0
RETRY_PAUSE_S = 0.05
FAILED_POLLS = 3  # catalog polls in a row that fail before the router stops offering the batcher's models


def batcher_target(address: str) -> tuple[str, list]:
    """The channel target and options for one batcher address (a Kubernetes
    Service: the sidecar spreads the streams) or a comma-separated list of
    IP:port (a local mesh's several batchers): each new stream then goes to the
    next ready one (round robin), so a draining batcher, which takes no new
    stream, hands its callers to the others."""
    if "," not in address:
        return address, client_options()
    return f"ipv4:{address}", [
        *client_options(),
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.default_authority", address.split(",", 1)[0]),
    ]


def submit_framing(linger_s: float) -> Framing[batcher_pb2.SubmitRequest, batcher_pb2.SubmitManyResponse]:
    """Submits go several to a message (SubmitMany): whatever is queued when
    gRPC takes the next one, after up to `linger_s` for company while others
    are in flight."""
    return Framing(
        pack=lambda requests: batcher_pb2.SubmitManyRequest(requests=requests),
        unpack=lambda frame: frame.responses,
        linger_s=linger_s,
    )


class BatcherClient:
    """Submits requests over a few multiplexed bidi streams and keeps the catalog fresh."""

    def __init__(
        self,
        address: str,
        streams: int,
        catalog: Catalog,
        poll_s: float,
        stream_max_age_s: float = 0.0,
        linger_s: float = 0.0,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        target, options = batcher_target(address)
        self._channel = tls.aio_channel(target, credentials, options)
        self._stub = batcher_pb2_grpc.BatcherStub(self._channel)
        framing = submit_framing(linger_s)
        self._muxes = [
            StreamMux(
                f"batcher {address}",
                self._stub.SubmitMany,
                lambda i: batcher_pb2.SubmitRequest(id=i, cancel=True),
                stream_max_age_s or None,
                framing,
            )
            for _ in range(streams)
        ]
        self._catalog = catalog
        self._poll_s = poll_s
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        missed = 0
        while True:
            try:
                response = await self._stub.ListModels(batcher_pb2.ListModelsRequest(), timeout=max(self._poll_s, 1.0))
                self._catalog.replace([_signature(m) for m in response.models])
                missed = 0
            except grpc.aio.AioRpcError as exc:
                missed += 1
                log.warning("batcher did not list models (%d in a row): %s: %s", missed, exc.code().name, exc.details())
                # A batcher too busy to answer in time still serves: one slow poll must not
                # turn every request into UNAVAILABLE. (One that is gone fails submits anyway.)
                if missed >= FAILED_POLLS:
                    self._catalog.replace([])
            await asyncio.sleep(self._poll_s)

    async def submit(
        self,
        model: str,
        version: str,
        inputs: list[TensorData],
        outputs: list[str],
        tier: Tier,
        timeout_s: float,
        tenant: str = "",
        weight: float = 1.0,
    ) -> tuple[str, list[TensorData]]:
        proto_inputs = tensors_to_proto(inputs)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        traceparent = tracing.current_traceparent()  # now: the message is built in the stream's sending task

        def build(request_id: int):  # when it is sent: the batcher counts timeout_ms from when it reads it
            timeout_ms = min(max(1, int((deadline - loop.time()) * 1000)), 2**32 - 1)
            return batcher_pb2.SubmitRequest(
                id=request_id,
                model=model,
                version=version,
                inputs=proto_inputs,
                outputs=outputs,
                tier=tier_to_proto(tier),
                timeout_ms=timeout_ms,
                tenant=tenant,
                tenant_weight=weight,
                traceparent=traceparent,
            )

        # The batcher answers DEADLINE_EXCEEDED by then; past it (plus a margin
        # for the answer's trip), the batcher is not answering at all.
        try:
            try:
                response = await self._mux(loop).request(build, timeout_s + 1.0, at_once=tier == Tier.VIP)
            except StreamLost as lost:
                response = await self._again(lost, build, deadline, tier)
        except TimeoutError:
            raise errors.Unavailable(f"the batcher did not answer within {timeout_s + 1.0:.1f}s") from None
        if response.HasField("error"):
            raise errors.from_code(response.error.code, response.error.message, response.error.retry_after_ms)
        return response.version, tensors_from_proto(response.outputs)

    async def _again(self, lost: StreamLost, build, deadline: float, tier: Tier):
        """Sends a request whose stream was lost once more, on a new stream (to
        whichever batcher the channel reaches now), once the channel is ready
        again; UNAVAILABLE with both reasons if that fails too or no time is left."""
        loop = asyncio.get_running_loop()
        if deadline - loop.time() < MIN_RETRY_S:
            raise errors.Unavailable(f"{lost}; no time left to send it again") from None
        # A moment for the channel to see the connection that broke, so that
        # "ready" below means a new one, not the old one not yet known dead.
        await asyncio.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - loop.time() - MIN_RETRY_S)))
        with contextlib.suppress(TimeoutError):  # the second try says why it fails
            await asyncio.wait_for(self._channel.channel_ready(), min(RETRY_WAIT_S, deadline - loop.time()))
        try:
            response = await self._mux(loop).request(
                build, max(0.0, deadline - loop.time()) + 1.0, at_once=tier == Tier.VIP
            )
        except StreamLost as again:
            metrics.RETRIES.labels("failed").inc()
            raise errors.Unavailable(f"{lost}; sent again: {again}") from None
        metrics.RETRIES.labels("ok").inc()
        return response

    def _mux(self, loop) -> StreamMux:
        """The streams take turns by time, STREAM_TURN_S each, not request by
        request: the requests of one moment share a stream, and so its frames
        (a request each on four streams, a frame of requests on one), while
        over a second every stream, and behind a mesh every batcher pod they
        reach, gets its share."""
        return self._muxes[int(loop.time() / STREAM_TURN_S) % len(self._muxes)]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(m.close() for m in self._muxes))
        await self._channel.close()


def _signature(info) -> ModelSignature:
    def specs(items):
        return tuple(Spec(s.name, s.datatype, tuple(s.shape)) for s in items)

    return ModelSignature(
        info.name,
        tuple(info.versions),
        tuple(info.ready_versions),
        info.platform,
        specs(info.inputs),
        specs(info.outputs),
        info.max_batch_size,
        tuple(sorted(info.revisions.items())),
        info.fallback,
    )


class CacheClient:
    """Lookups on a multiplexed stream with a short timeout; stores on a
    client stream that nobody waits for. Failures are misses, never errors."""

    def __init__(
        self,
        address: str,
        lookup_timeout_s: float,
        max_pending_stores: int = 10000,
        stream_max_age_s: float = 0.0,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self._channel = tls.aio_channel(address, credentials, client_options())
        self._stub = cache_pb2_grpc.CacheStub(self._channel)
        self._lookups = StreamMux(f"cache {address}", self._stub.Lookup, max_age_s=stream_max_age_s or None)
        self._max_age_s = stream_max_age_s
        self._timeout_s = lookup_timeout_s
        self._stores: asyncio.Queue = asyncio.Queue(max_pending_stores)
        self._writer: asyncio.Task | None = None

    async def lookup(self, model: str, digest: bytes, tier: Tier) -> tuple[list[TensorData] | None, int | None]:
        """(outputs or None, the generation the lookup read); a failed lookup is a miss of no known generation."""
        traceparent = tracing.current_traceparent()
        try:
            response = await self._lookups.request(
                lambda i: cache_pb2.LookupRequest(
                    id=i, model=model, digest=digest, tier=tier_to_proto(tier), traceparent=traceparent
                ),
                self._timeout_s,
            )
        except (errors.InfermeshError, TimeoutError) as exc:
            metrics.CACHE.labels("error").inc()
            metrics.CACHE_ERRORS.labels("lookup").inc()
            log.debug("cache lookup failed: %s", exc)
            return None, None
        if response.error:  # the cache found the lookup malformed: a miss, and a fault of ours worth a log line
            metrics.CACHE.labels("error").inc()
            metrics.CACHE_ERRORS.labels("lookup").inc()
            log.warning("cache refused a lookup: %s", response.error)
            return None, None
        metrics.CACHE.labels("hit" if response.hit else "miss").inc()
        return (tensors_from_proto(response.outputs) if response.hit else None), response.generation

    def store(self, model: str, digest: bytes, outputs: list[TensorData], generation: int | None = None) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_forever())
        request = cache_pb2.StoreRequest(
            model=model, digest=digest, outputs=tensors_to_proto(outputs), traceparent=tracing.current_traceparent()
        )
        if generation is not None:
            request.generation = generation
        try:
            self._stores.put_nowait(request)
        except asyncio.QueueFull:
            metrics.CACHE_ERRORS.labels("store_dropped").inc()

    async def _write_forever(self) -> None:
        async def messages():  # one Store stream, ended after stream_max_age_s like the lookups' (StreamMux)
            loop = asyncio.get_running_loop()
            opened = loop.time()
            while not self._max_age_s or loop.time() - opened < self._max_age_s:
                yield await self._stores.get()

        while True:
            try:
                await self._stub.Store(messages())
            except grpc.aio.AioRpcError as exc:
                metrics.CACHE_ERRORS.labels("store").inc()
                log.debug("cache store stream failed: %s", exc.code().name)
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
        await self._lookups.close()
        await self._channel.close()
