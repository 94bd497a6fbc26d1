"""Who is calling: the tenant registry, and credentials mapped to a tenant.

A caller's privileges (its tier, admin rights, its limits) come from the tenant
its verified credential names, never from what the request says of itself. A
credential is a bearer key (stored only as its SHA-256, compared in constant
time), the identity of a client certificate verified by mutual TLS, or, behind
an Istio sidecar that verified it, a peer principal or a JWT's tenant claim.

The registry is a YAML file (a Secret in Kubernetes):

    anonymous: standard          # the tier of callers without credentials, or "refuse"
    tenants:
      acme:
        tier: vip                # the highest tier it may use; its requests default to it
        keys: ["sha256:<hex>"]   # bearer keys, hashed (meshctl tenants hash)
        certificates: ["acme-client"]          # client-certificate CN or SAN (mTLS)
        principals: ["spiffe://cluster.local/ns/acme/sa/app"]  # Istio peer principals
        admin: false             # may call the control RPCs (model load/unload, cache purge)
        rate_per_s: 200          # rows a second through the router (token bucket); absent: no limit
        burst: 400               # rows the bucket holds
        weight: 1                # its share of its tier's capacity at the batcher, against other tenants

A JWT's `tenant` claim (written by Istio's RequestAuthentication into a header)
names a tenant directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import os
import pathlib
import secrets

from services.common import errors
from services.common.tier import BY_LABEL, Tier
from services.common.tls import peer_identities

ANONYMOUS = "anonymous"
KEY_PREFIX = "sha256:"
MAX_TENANTS = 10_000  # a registry is an operator's file; this bounds a mistake, not a design
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0  # a tenant's share against others (the batcher holds the same bounds)
MAX_CREDENTIAL_CHARS = 4096  # of a presented key or identity: longer is refused before it is hashed


class RegistryError(ValueError):
    """A registry that cannot be used; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str
    tier: Tier  # the highest tier it may use, and its default
    admin: bool = False
    rate_per_s: float = 0.0  # rows a second; 0: no limit
    burst: float = 0.0
    weight: float = 1.0
    default_tier: Tier | None = None  # of a request that asks for none; None: `tier`

    def __post_init__(self):
        object.__setattr__(self, "tier", Tier(self.tier))
        if self.default_tier is not None:
            object.__setattr__(self, "default_tier", Tier(self.default_tier))

    def allowed_tiers(self) -> list[str]:
        return [tier.label for tier in Tier if tier <= self.tier]

    def tier_for(self, claimed: Tier | None) -> Tier:
        """The tier a request runs at: the one it asks for, if this tenant may
        use it, else PERMISSION_DENIED; the tenant's own tier if it asks none."""
        if claimed is None:
            return self.tier if self.default_tier is None else self.default_tier
        claimed = Tier(claimed)
        if claimed > self.tier:
            raise errors.PermissionDenied(
                f"tenant '{self.name}' may not use tier '{claimed.label}': it may use "
                f"{self.allowed_tiers()}; ask for one of those or none"
            )
        return claimed


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What a call presents; only the verified parts count. `bearer` is the key of
    an `authorization: Bearer <key>` header; `certificate` the identities of a
    client certificate mutual TLS verified; `principal` and `jwt_tenant` what a
    trusted sidecar verified (None unless the service is configured to trust it)."""

    bearer: str | None = None
    certificate: tuple[str, ...] = ()
    principal: str | None = None
    jwt_tenant: str | None = None


def hash_key(key: str) -> str:
    """How a bearer key is stored in a registry."""
    return KEY_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh bearer key: 256 random bits."""
    return "imk_" + secrets.token_urlsafe(32)


def bearer_of(metadata: dict[str, str]) -> str | None:
    """The key of an `authorization: Bearer <key>` header, None without one;
    any other authorization scheme is refused by name."""
    value = metadata.get("authorization")
    if value is None:
        return None
    scheme, _, key = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise errors.Unauthenticated("metadata 'authorization' must be 'Bearer <key>'")
    return key.strip()


class Registry:
    """Tenants by credential. Lookups cost the same whichever entry matches:
    a presented key's hash is compared with every stored hash."""

    def __init__(
        self,
        tenants: list[Tenant],
        keys: dict[str, str],
        certificates: dict[str, str],
        principals: dict[str, str],
        anonymous: Tenant | None,
        source: str = "registry",
    ):
        self.tenants = {t.name: t for t in tenants}
        self._keys = list(keys.items())  # (stored hash, tenant): every one is compared (_by_key)
        self._certificates = certificates
        self._principals = principals
        self.anonymous = anonymous
        self.source = source

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Registry:
        import yaml

        path = pathlib.Path(path)
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise RegistryError(f"{path}: cannot read the tenant registry: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise RegistryError(f"{path}: not valid YAML: {exc}") from None
        return cls.from_document(doc, str(path))

    @classmethod
    def from_document(cls, doc, where: str = "registry") -> Registry:
        if not isinstance(doc, dict):
            raise RegistryError(f"{where}: must hold a mapping with 'tenants' (and 'anonymous')")
        unknown = set(doc) - {"tenants", "anonymous"}
        if unknown:
            raise RegistryError(f"{where}: unknown field(s) {sorted(unknown)}; known: ['anonymous', 'tenants']")
        entries = doc.get("tenants") or {}
        if not isinstance(entries, dict):
            raise RegistryError(f"{where}: field 'tenants' must map tenant names to their settings")
        if len(entries) > MAX_TENANTS:
            raise RegistryError(f"{where}: {len(entries)} tenants, more than {MAX_TENANTS}")
        tenants: list[Tenant] = []
        keys: dict[str, str] = {}  # credential: tenant name
        certificates: dict[str, str] = {}
        principals: dict[str, str] = {}
        for name, body in entries.items():
            at = f"{where}: tenants.{name}"
            if not isinstance(name, str) or not name or name == ANONYMOUS:
                raise RegistryError(f"{at}: a tenant's name must be a non-empty string other than '{ANONYMOUS}'")
            tenant, credentials = _tenant(name, body or {}, at)
            tenants.append(tenant)
            for kind, table, found in zip(
                ("keys", "certificates", "principals"), (keys, certificates, principals), credentials, strict=True
            ):
                for value in found:
                    if value in table and table[value] != name:
                        raise RegistryError(f"{at}: {kind} entry {value!r} is also tenant '{table[value]}''s")
                    table[value] = name
        anonymous = _anonymous(doc.get("anonymous", "standard"), where)
        return cls(tenants, keys, certificates, principals, anonymous, where)

    def authenticate(self, credentials: Credentials) -> Tenant:
        """The tenant the credentials verify: a bearer key first, then a client
        certificate, a sidecar's principal, a JWT's tenant; without any, the
        anonymous tenant, or UNAUTHENTICATED where the registry refuses anonymous
        callers. A key or identity presented and not known is UNAUTHENTICATED,
        never anonymous: a mistyped key must not quietly lower a caller's tier."""
        if credentials.bearer is not None:
            return self._by_key(credentials.bearer)
        for identity in credentials.certificate:
            name = self._certificates.get(identity)
            if name is not None:
                return self.tenants[name]
        if credentials.certificate:
            raise errors.Unauthenticated(
                f"the client certificate (identities {', '.join(map(repr, credentials.certificate))}) names no tenant "
                "in the registry"
            )
        if credentials.principal is not None:
            name = self._principals.get(credentials.principal)
            if name is None:
                raise errors.Unauthenticated(f"peer principal {errors.shown(credentials.principal)} names no tenant")
            return self.tenants[name]
        if credentials.jwt_tenant is not None:
            tenant = self.tenants.get(credentials.jwt_tenant)
            if tenant is None:
                raise errors.Unauthenticated(
                    f"the token's tenant {errors.shown(credentials.jwt_tenant)} is not in the registry"
                )
            return tenant
        if self.anonymous is None:
            raise errors.Unauthenticated(
                "this service needs credentials: send 'authorization: Bearer <key>' or a client certificate"
            )
        return self.anonymous

    def _by_key(self, key: str) -> Tenant:
        if len(key) > MAX_CREDENTIAL_CHARS:
            raise errors.Unauthenticated(f"the bearer key is {len(key)} characters long; keys are far shorter")
        presented = hash_key(key).encode()
        found = None
        for stored, name in self._keys:  # every entry, matched or not: the time does not tell which
            if hmac.compare_digest(presented, stored.encode()):
                found = name
        if found is None:
            raise errors.Unauthenticated("the bearer key is not known")
        return self.tenants[found]

    def admin(self, credentials: Credentials, action: str) -> Tenant:
        """The tenant, if it may do `action` (a control RPC); else UNAUTHENTICATED
        (no credentials) or PERMISSION_DENIED (a tenant without admin rights)."""
        if credentials == Credentials():
            raise errors.Unauthenticated(
                f"{action} needs an admin credential: 'authorization: Bearer <key>' or a client certificate"
            )
        tenant = self.authenticate(credentials)
        if not tenant.admin:
            raise errors.PermissionDenied(f"tenant '{tenant.name}' may not {action}: it has no admin rights")
        return tenant


def _strings(body: dict, key: str, at: str) -> list[str]:
    values = body.get(key) or []
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise RegistryError(f"{at}: field '{key}' must be a list of non-empty strings")
    return values


def _number(body: dict, key: str, at: str, default: float, minimum: float, maximum: float = math.inf) -> float:
    value = body.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not minimum <= value <= maximum
    ):
        bounds = f">= {minimum:g}" if maximum == math.inf else f"in [{minimum:g}, {maximum:g}]"
        raise RegistryError(f"{at}: field '{key}' must be a finite number {bounds}, got {value!r}")
    return float(value)


def _tier(value, at: str) -> Tier:
    if value not in BY_LABEL:
        raise RegistryError(f"{at}: field 'tier' is {value!r}; expected one of {list(BY_LABEL)}")
    return BY_LABEL[value]


def _tenant(name: str, body, at: str) -> tuple[Tenant, tuple[list[str], list[str], list[str]]]:
    if not isinstance(body, dict):
        raise RegistryError(f"{at}: must be a mapping of settings")
    known = {"tier", "keys", "certificates", "principals", "admin", "rate_per_s", "burst", "weight"}
    unknown = set(body) - known
    if unknown:
        raise RegistryError(f"{at}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    keys = _strings(body, "keys", at)
    bad = [k for k in keys if not k.startswith(KEY_PREFIX) or len(k) != len(KEY_PREFIX) + 64]
    if bad:
        raise RegistryError(
            f"{at}: keys are stored hashed, as '{KEY_PREFIX}<64 hex digits>' "
            f"(meshctl tenants hash); got {bad[0][:20]!r}..."
        )
    admin = body.get("admin", False)
    if not isinstance(admin, bool):
        raise RegistryError(f"{at}: field 'admin' must be true or false, got {admin!r}")
    rate = _number(body, "rate_per_s", at, 0.0, 0.0)
    burst = _number(body, "burst", at, max(rate, 1.0), 1.0)
    weight = _number(body, "weight", at, 1.0, MIN_WEIGHT, MAX_WEIGHT)
    tenant = Tenant(name, _tier(body.get("tier", "standard"), at), admin, rate, burst, weight)
    return tenant, (keys, _strings(body, "certificates", at), _strings(body, "principals", at))


def _anonymous(value, where: str) -> Tenant | None:
    """The tenant of callers without credentials: a tier name, "refuse", or a
    mapping with a tier and limits (rate_per_s, burst, weight)."""
    if value == "refuse":
        return None
    if isinstance(value, str):
        return Tenant(ANONYMOUS, _tier(value, f"{where}: anonymous"))
    if isinstance(value, dict):
        tenant, credentials = _tenant(ANONYMOUS, value, f"{where}: anonymous")
        if any(credentials) or tenant.admin:
            raise RegistryError(f"{where}: anonymous callers have no credentials and no admin rights")
        return tenant
    raise RegistryError(f"{where}: field 'anonymous' is {value!r}; expected a tier name, 'refuse', or a mapping")


def development_registry() -> tuple[dict, dict[str, str]]:
    """A registry document for local development, and the keys it was made
    with (to be shown once): a VIP tenant, a standard one, an admin."""
    keys = {name: new_key() for name in ("dev-vip", "dev-standard", "dev-admin")}
    doc = {
        "anonymous": "standard",
        "tenants": {
            "dev-vip": {"tier": "vip", "keys": [hash_key(keys["dev-vip"])], "certificates": ["tenant-vip-dev"]},
            "dev-standard": {
                "tier": "standard",
                "keys": [hash_key(keys["dev-standard"])],
                "certificates": ["tenant-standard-dev"],
            },
            "dev-admin": {
                "tier": "standard",
                "admin": True,
                "keys": [hash_key(keys["dev-admin"])],
                "certificates": ["admin-dev"],
            },
        },
    }
    return doc, keys


def write_registry(path: str | pathlib.Path, doc: dict, replace: bool = False) -> None:
    """Writes a registry document readable by its owner only; an existing file
    is kept (FileExistsError) unless `replace`."""
    import yaml

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Registry.from_document(doc, str(path))  # never write what the router would refuse
    text = yaml.safe_dump(doc, sort_keys=False)
    if replace:
        temporary = path.with_name(path.name + ".new")
        temporary.unlink(missing_ok=True)
        _write_private(temporary, text)
        temporary.replace(path)
    else:
        _write_private(path, text)


def _write_private(path: pathlib.Path, text: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata presenting `key`."""
    return (("authorization", f"Bearer {key}"),)


def call_credentials(context) -> Credentials:
    """What a grpc.aio call presents directly: its bearer key and client certificate."""
    metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return Credentials(bearer=bearer_of(metadata), certificate=peer_identities(context))


class AdminGate:
    """Control RPCs (model load and unload, cache purge) for admin tenants only."""

    def __init__(self, registry: Registry | None, service: str):
        self._registry = registry
        self._service = service

    @classmethod
    def from_file(cls, path: str, service: str) -> AdminGate:
        return cls(Registry.load(path) if path else None, service)

    @property
    def configured(self) -> bool:
        return self._registry is not None

    def check(self, context, action: str) -> Tenant:
        """The admin tenant of the call, or PERMISSION_DENIED / UNAUTHENTICATED."""
        if self._registry is None:
            raise errors.PermissionDenied(
                f"{action} needs an admin credential, and this {self._service} has no tenant registry to check one "
                "against (start it with --tenants-file)"
            )
        return self._registry.admin(call_credentials(context), action)
