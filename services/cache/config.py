"""The cache service's configuration."""

import dataclasses

from services.common.config import require


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    redis_url: str = dataclasses.field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis (L1) URL; redis:// or unix://"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port, 0 picks a free one"})
    metrics_port: int = dataclasses.field(default=0, metadata={"help": "Prometheus port, 0 picks a free one"})
    namespace: str = dataclasses.field(default="infermesh", metadata={"help": "prefix of every Redis key"})
    ttl_s: int = dataclasses.field(default=300, metadata={"help": "time to live of an L1 entry"})
    redis_timeout_ms: float = dataclasses.field(default=50.0, metadata={"help": "socket timeout of one Redis call"})
    breaker_open_s: float = dataclasses.field(default=2.0, metadata={"help": "how long Redis is skipped after a failure"})
    max_message_bytes: int = dataclasses.field(default=64 * 1024 * 1024)
    drain_grace_s: float = dataclasses.field(default=5.0)
    log_level: str = dataclasses.field(default="info")

    def __post_init__(self):
        require(self.ttl_s >= 1, f"ttl_s must be >= 1, got {self.ttl_s}")
        require(self.redis_timeout_ms > 0, f"redis_timeout_ms must be > 0, got {self.redis_timeout_ms}")
        require(self.breaker_open_s >= 0, f"breaker_open_s must be >= 0, got {self.breaker_open_s}")
        require(self.redis_url.startswith(("redis://", "rediss://", "unix://")),
                f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
