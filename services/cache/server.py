"""The cache service's gRPC face: streamed lookups, streamed stores, an admin purge."""

import asyncio
import hmac
import logging
import time

from infermesh.cache.v1 import cache_pb2, cache_pb2_grpc
from redis.exceptions import RedisError

from services.cache import codec, metrics
from services.cache.config import CacheConfig
from services.cache.core import STALE, ResultCache
from services.common import errors, identity, serving, tls, tracing
from services.common.budget import ByteBudget
from services.common.protoconv import tensors_from_proto, tensors_to_proto
from services.common.streams import answer_concurrently
from services.common.tier import Tier

log = logging.getLogger(__name__)
SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
MAX_INFLIGHT_PER_STREAM = 8192
# The router's request digest is BLAKE2b with digest_size=16; any other size is not one of its keys.
DIGEST_BYTES = 16
MAX_MODEL_BYTES = 255  # a model is a folder of the model repository


def check_model(what: str, model: str) -> None:
    """Raises InvalidArgument naming the field and its value."""
    if not model:
        raise errors.InvalidArgument(f"{what}: model is empty; name the model")
    if len(model.encode()) > MAX_MODEL_BYTES or "\x00" in model:
        raise errors.InvalidArgument(
            f"{what}: model {errors.shown(model)} is not a model name (at most {MAX_MODEL_BYTES} bytes, no NUL)"
        )


def check_key(what: str, model: str, digest: bytes) -> None:
    check_model(what, model)
    if len(digest) != DIGEST_BYTES:
        raise errors.InvalidArgument(
            f"{what}: digest of model '{model}' is {len(digest)} bytes "
            f"({digest[:8].hex() or 'empty'}); a request digest is {DIGEST_BYTES}"
        )


def checked_outputs(index: int, request) -> list:
    """The request's outputs as tensors, or InvalidArgument naming what is wrong."""
    what = f"StoreRequest {index} of this stream"
    check_key(what, request.model, request.digest)
    outputs = tensors_from_proto(request.outputs)
    try:
        codec.check(outputs)
    except codec.UnstorableValue as exc:
        raise errors.InvalidArgument(f"{what}: outputs of model '{request.model}': {exc}") from None
    return outputs


def _traced_store(traceparent: str, model: str):
    """A done-callback that records a store's span, from now to when its write lands, when its trace is sampled."""
    parent, started_ns = tracing.parse(traceparent), time.time_ns()

    def record(future: asyncio.Future) -> None:
        failed = future.cancelled() or future.exception() is not None
        attributes = {"model": model, "cache.stored": not failed and future.result() != STALE}
        tracing.record(parent, "cache.store", started_ns, time.time_ns(), attributes)

    return record


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(
        self,
        cache: ResultCache,
        admin_token: str,
        draining: asyncio.Event,
        admin: identity.AdminGate | None = None,
        budget: ByteBudget | None = None,
    ):
        self._cache = cache
        self._admin_token = admin_token
        self._admin = admin if admin is not None else identity.AdminGate(None, "cache")
        self._draining = draining
        self._budget = budget  # a stored result is held in it from when it is read until it is written

    async def Lookup(self, request_iterator, context):
        """One answer per lookup, in completion order; anything unreadable is a miss."""

        async def handle(request):
            try:
                check_key(f"LookupRequest id {request.id}", request.model, request.digest)
            except errors.InvalidArgument as exc:  # this lookup alone: a miss that says why
                return cache_pb2.LookupResponse(id=request.id, hit=False, error=exc.message)
            tier = Tier.of(request.tier) or Tier.STANDARD  # an unknown value only counts as standard
            span = (
                tracing.start_request("cache.lookup", request.traceparent, {"model": request.model})
                if request.traceparent and tracing.is_on()
                else None
            )
            outputs, generation = await self._cache.lookup(request.model, request.digest, tier)
            if span is not None:
                span.set_attribute("cache.hit", outputs is not None)
                tracing.end(span, "OK")
            response = cache_pb2.LookupResponse(id=request.id, hit=outputs is not None, generation=generation)
            if outputs is not None:
                response.outputs.extend(tensors_to_proto(outputs))
            return response

        def on_error(request, exc):  # the cache never fails a request: a miss
            return cache_pb2.LookupResponse(id=request.id, hit=False)

        async for response in answer_concurrently(
            request_iterator, handle, on_error, MAX_INFLIGHT_PER_STREAM, self._draining
        ):
            yield response

    async def Store(self, request_iterator, context):
        """Writes go out in batches while the stream keeps flowing; the summary
        counts them once the caller closes the stream. A malformed request ends
        the stream with INVALID_ARGUMENT once those before it are written."""
        counts = {"stored": 0, "failed": 0, "stale": 0}
        pending: set[asyncio.Future] = set()

        def settle(future: asyncio.Future) -> None:
            pending.discard(future)
            if future.cancelled() or future.exception():
                counts["failed"] += 1
            else:
                counts["stale" if future.result() == STALE else "stored"] += 1

        index = 0
        budget = self._budget
        try:
            async for request in request_iterator:
                held = request.ByteSize() if budget is not None else 0
                if budget is not None and held:
                    try:
                        budget.acquire(held, f"StoreRequest {index} of this stream")
                    except errors.ResourceExhausted as exc:  # dropped, as a store that failed: the caller waits on none
                        log.debug("store refused: %s", exc.message)
                        index += 1
                        counts["failed"] += 1
                        continue
                generation = request.generation if request.HasField("generation") else None
                try:
                    future = self._cache.put(request.model, request.digest, checked_outputs(index, request), generation)
                except BaseException:
                    if budget is not None and held:
                        budget.release(held)
                    raise
                index += 1
                if future is None:
                    if budget is not None and held:
                        budget.release(held)
                    counts["failed"] += 1
                    continue
                if budget is not None and held:
                    budget.release_when_done(future, held)
                if request.traceparent and tracing.is_on():
                    future.add_done_callback(_traced_store(request.traceparent, request.model))
                pending.add(future)
                future.add_done_callback(settle)
        except errors.InvalidArgument:
            await asyncio.gather(*list(pending), return_exceptions=True)
            raise
        # settle() was registered first, so it has run for each future by the time gather returns.
        await asyncio.gather(*list(pending), return_exceptions=True)
        return cache_pb2.StoreSummary(**counts)

    async def Purge(self, request, context):
        if not self._admin_token and not self._admin.configured:
            metrics.PURGES.labels("disabled").inc()
            raise errors.PermissionDenied(
                "Purge is disabled: the cache service has no admin token or tenant registry configured"
            )
        metadata = dict(context.invocation_metadata() or ())
        presented = metadata.get("authorization", "")
        token = bool(self._admin_token) and hmac.compare_digest(
            presented.encode(), f"Bearer {self._admin_token}".encode()
        )
        if not token:
            if not self._admin.configured:
                metrics.PURGES.labels("unauthenticated").inc()
                raise errors.Unauthenticated("Purge needs metadata 'authorization: Bearer <admin token>'")
            try:
                self._admin.check(context, f"purge model {errors.shown(request.model)}")
            except errors.Unauthenticated as exc:
                metrics.PURGES.labels("unauthenticated").inc()
                raise errors.Unauthenticated(
                    f"{exc.message}; Purge needs metadata 'authorization: Bearer <key>' "
                    "with an admin tenant's key or the cache's admin token"
                ) from None
            except errors.PermissionDenied:
                metrics.PURGES.labels("unauthenticated").inc()
                raise
        check_model("PurgeRequest", request.model)
        try:
            generation, deleted = await self._cache.purge(request.model)
        except (RedisError, OSError) as exc:
            metrics.PURGES.labels("failed").inc()
            raise errors.Unavailable(f"Purge of model '{request.model}' failed: Redis is unreachable ({exc})") from None
        metrics.PURGES.labels("ok").inc()
        return cache_pb2.PurgeResponse(generation=generation, l2_deleted=deleted)


async def build_server(config: CacheConfig, cache: ResultCache, draining: asyncio.Event, port: int | None = None):
    """Returns (server, bound_port, health servicer); the server is started."""
    server = serving.new_server(
        "cache", config.max_message_bytes, limits=config, data_methods=frozenset({"Lookup", "Store"})
    )
    admin = identity.AdminGate.from_file(config.tenants_file, "cache")
    budget = ByteBudget("cache", config.budget_bytes)
    cache_pb2_grpc.add_CacheServicer_to_server(
        CacheServicer(cache, config.admin_token, draining, admin, budget), server
    )
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    bound = tls.bind(server, f"{config.host}:{config.port if port is None else port}", tls.server_credentials(config))
    await server.start()
    await serving.set_serving(health, [SERVICE_NAME], True)
    return server, bound, health
