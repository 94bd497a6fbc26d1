"""The cache service's configuration."""

import dataclasses
from typing import ClassVar

from services.common import tls
from services.common.budget import MIB, ServingLimits
from services.common.config import require


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """What the result cache (services/cache/core.py) is built from."""

    redis_url: str
    namespace: str  # prefix of every Redis key
    ttl_s: int  # time to live of an L1 entry
    redis_timeout_ms: float  # socket timeout of one Redis call
    breaker_open_s: float  # how long Redis is skipped after a failure
    model_ttl_s: dict[str, int] | None = None  # per-model TTLs
    l2_fp16: bool = False  # store FP32 outputs as FP16 in L2

    def __post_init__(self) -> None:
        require(self.ttl_s >= 1, f"ttl_s must be >= 1, got {self.ttl_s}")
        require(self.redis_timeout_ms > 0, f"redis_timeout_ms must be > 0, got {self.redis_timeout_ms}")
        require(self.breaker_open_s >= 0, f"breaker_open_s must be >= 0, got {self.breaker_open_s}")


@dataclasses.dataclass(frozen=True)
class CacheConfig(ServingLimits):
    baseline_bytes: ClassVar[int] = 256 * MIB

    redis_url: str = dataclasses.field(
        default="redis://127.0.0.1:6379/0", metadata={"help": "Redis (L1) URL; redis:// or unix://"}
    )
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port, 0 picks a free one"})
    metrics_port: int = dataclasses.field(default=0, metadata={"help": "Prometheus port, 0 picks a free one"})
    namespace: str = dataclasses.field(default="infermesh", metadata={"help": "prefix of every Redis key"})
    ttl_s: int = dataclasses.field(default=300, metadata={"help": "time to live of an L1 entry"})
    model_ttl_s: tuple[str, ...] = dataclasses.field(
        default=(), metadata={"help": "per-model TTLs, e.g. minilm=600,mlp=60"}
    )
    redis_timeout_ms: float = dataclasses.field(default=50.0, metadata={"help": "socket timeout of one Redis call"})
    breaker_open_s: float = dataclasses.field(
        default=2.0, metadata={"help": "how long Redis is skipped after a failure"}
    )
    l2_path: str = dataclasses.field(default="", metadata={"help": "folder of the on-disk L2 store; empty disables L2"})
    l2_max_bytes: int = dataclasses.field(
        default=1 << 30,
        metadata={"help": "bound on the bytes of L2's entries (keys, values, LMDB's per-entry overhead)"},
    )
    l2_fp16: bool = dataclasses.field(
        default=False, metadata={"help": "store FP32 outputs as FP16 in L2 (half the bytes)"}
    )
    generation_poll_s: float = dataclasses.field(
        default=1.0, metadata={"help": "how often model generations are re-read"}
    )
    admin_token: str = dataclasses.field(
        default="", metadata={"help": "a bearer token for Purge (besides the registry's admin tenants); empty: none"}
    )
    tenants_file: str = dataclasses.field(
        default="",
        metadata={
            "help": "tenant registry (as the router's): its admin tenants may Purge; with neither this nor "
            "admin_token, Purge is disabled"
        },
    )
    max_message_bytes: int = dataclasses.field(default=64 * 1024 * 1024)
    drain_grace_s: float = dataclasses.field(default=5.0)
    tls_cert_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_cert_file"]})
    tls_key_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_key_file"]})
    tls_ca_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_ca_file"]})
    tls_require_client_cert: bool = dataclasses.field(
        default=False, metadata={"help": tls.TLS_HELP["tls_require_client_cert"]}
    )
    log_level: str = dataclasses.field(default="info")

    def __post_init__(self) -> None:
        super().__post_init__()
        tls.check(self)
        self.check_largest("max_message_bytes", self.max_message_bytes)
        require(self.ttl_s >= 1, f"ttl_s must be >= 1, got {self.ttl_s}")
        require(self.redis_timeout_ms > 0, f"redis_timeout_ms must be > 0, got {self.redis_timeout_ms}")
        require(self.breaker_open_s >= 0, f"breaker_open_s must be >= 0, got {self.breaker_open_s}")
        require(
            self.redis_url.startswith(("redis://", "rediss://", "unix://")),
            f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}",
        )
        require(self.l2_max_bytes >= 1 << 20, f"l2_max_bytes must be >= 1 MiB, got {self.l2_max_bytes}")
        require(self.generation_poll_s > 0, f"generation_poll_s must be > 0, got {self.generation_poll_s}")
        self.model_ttls()  # checks the format

    def model_ttls(self) -> dict[str, int]:
        ttls = {}
        for item in self.model_ttl_s:
            model, sep, value = item.partition("=")
            require(
                bool(sep) and value.isdigit() and int(value) >= 1,
                f"model_ttl_s entries look like model=seconds, got {item!r}",
            )
            ttls[model] = int(value)
        return ttls

    def settings(self) -> CacheSettings:
        return CacheSettings(
            self.redis_url,
            self.namespace,
            self.ttl_s,
            self.redis_timeout_ms,
            self.breaker_open_s,
            self.model_ttls(),
            self.l2_fp16,
        )
