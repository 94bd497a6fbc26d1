"""The router's side of tenancy: who a call is from (Authenticator) and how
fast each tenant may send (RateLimiter). It knows nothing of gRPC: the
transport hands it metadata and the verified peer identities."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable

from services.common import errors, identity
from services.common.bucket import TokenBucket
from services.common.tier import Tier
from services.router import metrics

log = logging.getLogger(__name__)

# Identities as Envoy writes them into x-forwarded-client-cert: "By=...;Hash=...;URI=spiffe://..."
XFCC_HEADER = "x-forwarded-client-cert"
LABELLED_TENANTS = 50  # tenants that get a label value of their own; the rest are "other"


def legacy_tenant() -> identity.Tenant:
    """The caller of the old trust-the-header mode: any tier it claims, standard by default."""
    return identity.Tenant(identity.ANONYMOUS, tier=max(Tier), default_tier=Tier.STANDARD)


@dataclasses.dataclass(frozen=True)
class Settings:
    registry: identity.Registry | None  # None: every caller is anonymous and standard
    trust_tier_header: bool = False  # the old mode: a claimed tier is believed
    trust_sidecar_identity: bool = False  # the router sits behind its own Istio sidecar
    jwt_tenant_header: str = "x-infermesh-jwt-tenant"


def settings_from(config) -> Settings:
    """The router's tenancy settings from its RouterConfig; the registry is read
    now, and one that cannot be used raises RegistryError naming the file."""
    registry = identity.Registry.load(config.tenants_file) if config.tenants_file else None
    if registry is not None:
        log.info(
            "tenant registry %s: %d tenant(s); anonymous callers %s",
            config.tenants_file,
            len(registry.tenants),
            "refused" if registry.anonymous is None else f"run as {registry.anonymous.tier.label}",
        )
    elif config.trust_tier_header:
        log.warning("trust_tier_header is on: every caller gets the tier it claims")
    return Settings(registry, config.trust_tier_header, config.trust_sidecar_identity, config.jwt_tenant_header)


class Authenticator:
    """Maps a call's credentials to its tenant, counting refusals by reason."""

    def __init__(self, settings: Settings):
        self._settings = settings
        self._legacy = legacy_tenant()
        self._fallback = identity.Tenant(identity.ANONYMOUS, tier=Tier.STANDARD)
        self.use(settings.registry)

    def use(self, registry: identity.Registry | None) -> None:
        """From now on, calls are checked against `registry` (a reloaded file)."""
        self._registry = registry
        names = sorted(registry.tenants) if registry else []
        self._labels = {name: name for name in names[:LABELLED_TENANTS]} | {identity.ANONYMOUS: identity.ANONYMOUS}

    def caller(self, metadata: dict[str, str], certificate: tuple[str, ...] = (), raw: tuple = ()) -> identity.Tenant:
        """The tenant of a call (or UNAUTHENTICATED); `raw` is the call's metadata
        as sent (pairs), where an identity header may be repeated."""
        if self._settings.trust_tier_header:
            return self._legacy
        try:
            credentials = identity.Credentials(
                bearer=identity.bearer_of(metadata), certificate=certificate, **self._sidecar(metadata, raw)
            )
            if self._registry is None:
                if credentials != identity.Credentials():
                    raise errors.Unauthenticated(
                        "this router has no tenant registry (--tenants-file): it cannot "
                        "verify credentials; call it without them, as a standard caller"
                    )
                return self._fallback
            return self._registry.authenticate(credentials)
        except errors.Unauthenticated:
            metrics.AUTH_REFUSALS.labels("unauthenticated").inc()
            raise

    def _sidecar(self, metadata: dict[str, str], raw: tuple) -> dict:
        """What the sidecar verified, when the router is configured to sit behind
        one (the mesh's AuthorizationPolicy refuses client-supplied copies);
        otherwise such headers are ignored. The sidecar writes each once: a
        header seen twice may be a client's copy beside it, and is refused."""
        if not self._settings.trust_sidecar_identity:
            return {}
        for name in (XFCC_HEADER, self._settings.jwt_tenant_header):
            count = sum(1 for key, _ in raw if key == name)
            if count > 1:
                raise errors.Unauthenticated(
                    f"identity header '{name}' appears {count} times; the sidecar writes it once"
                )
        found = {}
        forwarded = metadata.get(XFCC_HEADER)
        if forwarded:
            # The last element is the hop closest to us: the sidecar's own view of its peer.
            uris = [part[4:] for part in forwarded.split(",")[-1].split(";") if part.startswith("URI=")]
            if uris:
                found["principal"] = uris[0].strip('"')
        tenant = metadata.get(self._settings.jwt_tenant_header)
        if tenant:
            found["jwt_tenant"] = tenant
        return found

    def tier(self, tenant: identity.Tenant, claimed: Tier | None) -> Tier:
        """The tier this tenant's request runs at (PERMISSION_DENIED beyond its own)."""
        try:
            return tenant.tier_for(claimed)
        except errors.PermissionDenied:
            metrics.AUTH_REFUSALS.labels("tier_denied").inc()
            raise

    def label(self, tenant: str) -> str:
        """A bounded label value for a tenant."""
        return self._labels.get(tenant, "other")


async def follow_registry(path: str, authenticator: Authenticator, poll_s: float = 2.0) -> None:
    """Reads the registry file again whenever it changes (meshctl tenants add);
    a file that cannot be used is logged and the last good registry stays."""

    def stamp():
        try:
            found = os.stat(path)
            return found.st_mtime_ns, found.st_size, found.st_ino
        except OSError:
            return None

    seen = stamp()
    while True:
        await asyncio.sleep(poll_s)
        now = stamp()
        if now == seen or now is None:
            continue
        seen = now
        try:
            registry = identity.Registry.load(path)
        except identity.RegistryError as exc:
            log.error("tenant registry not reloaded, the last good one stays: %s", exc)
            continue
        authenticator.use(registry)
        log.info("tenant registry %s reloaded: %d tenant(s)", path, len(registry.tenants))


class RateLimiter:
    """A token bucket per tenant (rows a second, a burst), as the registry sets
    them; tenants without a rate are not limited. Buckets exist only for
    registry tenants (and the anonymous one), so callers cannot grow them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, tenant: identity.Tenant, rows: int) -> None:
        """Spends `rows` tokens of the tenant's bucket, or refuses with
        RESOURCE_EXHAUSTED and the time until they would be there."""
        if tenant.rate_per_s <= 0:
            return
        bucket = self._buckets.get(tenant.name)
        if bucket is None:
            bucket = self._buckets[tenant.name] = TokenBucket(tenant.rate_per_s, tenant.burst, self._clock)
        bucket.rate, bucket.burst = tenant.rate_per_s, tenant.burst  # as the registry says now: it is reloaded live
        cost = min(rows, tenant.burst)  # a request larger than the burst waits for a full bucket
        if bucket.take(cost):
            return
        retry_ms = max(1, math.ceil(1000 * (cost - bucket.tokens) / tenant.rate_per_s))
        metrics.AUTH_REFUSALS.labels("rate_limited").inc()
        raise errors.ResourceExhausted(
            f"tenant '{tenant.name}' is over its rate of {tenant.rate_per_s:g} rows a second (burst "
            f"{tenant.burst:g}); this request has {rows} row(s); retry after about {retry_ms} ms",
            retry_after_ms=retry_ms,
        )
