"""The router's configuration."""

import dataclasses
import ipaddress
from typing import TYPE_CHECKING, ClassVar

from services.common import tls
from services.common.budget import MIB, ServingLimits
from services.common.config import require
from services.common.outcomes import OutcomeSettings

if TYPE_CHECKING:  # imported where needed: the router's modules import this one
    from services.router.breaker import BreakerPolicy, FailureSamples
    from services.router.core import RouterSettings
    from services.router.limits import RequestLimits


@dataclasses.dataclass(frozen=True)
class RouterConfig(ServingLimits):
    baseline_bytes: ClassVar[int] = 256 * MIB  # an idle router's RSS is about a third of this

    batcher: str = dataclasses.field(
        default="127.0.0.1:8021",
        metadata={
            "help": "batcher host:port (a Kubernetes Service), or several IPv4:port comma-separated (each new stream "
            "to the next ready one)"
        },
    )
    cache: str = dataclasses.field(default="", metadata={"help": "cache service host:port; empty disables caching"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = dataclasses.field(default=8001, metadata={"help": "gRPC port (Triton's default), 0 picks a free one"})
    metrics_port: int = dataclasses.field(
        default=8002, metadata={"help": "Prometheus port (Triton's default), 0 picks a free one"}
    )
    reuse_port: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "let other router processes bind the same gRPC port (SO_REUSEPORT): the kernel spreads "
            "connections among them; off, a second process on the port fails to start"
        },
    )
    max_request_bytes: int = dataclasses.field(
        default=16 * 1024 * 1024, metadata={"help": "largest ModelInfer request; larger gets RESOURCE_EXHAUSTED"}
    )
    max_stream_message_bytes: int = dataclasses.field(
        default=0,
        metadata={
            "help": "largest ModelStreamInfer message; a larger one is answered RESOURCE_EXHAUSTED alone, the stream "
            "goes on; 0: max_request_bytes"
        },
    )
    max_concurrent_rpcs: int = dataclasses.field(
        default=4096, metadata={"help": "calls served at once, streams included"}
    )
    max_stream_inflight: int = dataclasses.field(
        default=1024, metadata={"help": "requests in flight per ModelStreamInfer stream"}
    )
    stream_idle_timeout_s: float = dataclasses.field(
        default=120.0,
        metadata={
            "help": "a ModelStreamInfer stream with nothing in flight and nothing sent for this long is ended (OK), "
            "so that idle streams do not hold the calls of max_concurrent_rpcs; 0 keeps them"
        },
    )
    batcher_streams: int = dataclasses.field(
        default=4, metadata={"help": "bidi streams multiplexing requests to the batcher"}
    )
    batcher_linger_ms: float = dataclasses.field(
        default=1.0,
        metadata={
            "help": "while requests are in flight to the batcher, how long a new one may wait to share a stream "
            "message with others (VIP requests never wait); 0 sends each at once"
        },
    )
    stream_max_age_s: float = dataclasses.field(
        default=60.0,
        metadata={
            "help": "a stream to the batcher or cache takes new requests this long, then is replaced (its requests "
            "still answered), so that behind a mesh new replicas get their share; 0 keeps streams for good"
        },
    )
    default_timeout_s: float = dataclasses.field(
        default=60.0, metadata={"help": "deadline of a request that brings none"}
    )
    cache_lookup_timeout_ms: float = dataclasses.field(
        default=25.0, metadata={"help": "a slower lookup counts as a miss"}
    )
    cache_bypass_window: int = dataclasses.field(
        default=500, metadata={"help": "lookups per model that judge its hit rate"}
    )
    cache_min_hit_rate: float = dataclasses.field(
        default=0.01, metadata={"help": "below this a model's lookups are bypassed"}
    )
    cache_bypass_memory: int = dataclasses.field(
        default=10_000,
        metadata={
            "help": "request digests remembered per bypassed model: a request repeating one of them counts toward "
            "lifting the bypass (the cache sees none of a bypassed model's traffic)"
        },
    )
    near_cache_ttl_s: float = dataclasses.field(
        default=1.0,
        metadata={
            "help": "how long the router keeps hot results in memory (0 disables); also how long a Purge takes to reach it"
        },
    )
    near_cache_max_bytes: int = dataclasses.field(
        default=32 * 1024 * 1024, metadata={"help": "bound on the near cache"}
    )
    catalog_poll_s: float = dataclasses.field(
        default=1.0, metadata={"help": "how often the batcher is asked for models"}
    )
    breaker_open_error_rate: float = dataclasses.field(
        default=0.05,
        metadata={"help": "a model's failure share that opens its circuit breaker (models with a fallback)"},
    )
    breaker_recover_error_rate: float = dataclasses.field(
        default=0.01, metadata={"help": "failure share under which a half-open breaker lets more traffic back"}
    )
    breaker_window_s: float = dataclasses.field(
        default=10.0, metadata={"help": "the window failure shares are taken over"}
    )
    breaker_min_requests: int = dataclasses.field(
        default=20, metadata={"help": "answers a window needs before it can change the breaker"}
    )
    breaker_open_s: float = dataclasses.field(
        default=5.0, metadata={"help": "how long an open breaker degrades everything before probing"}
    )
    failure_samples_path: str = dataclasses.field(
        default="", metadata={"help": "JSON-lines file for requests that failed while a breaker counted (empty: none)"}
    )
    tenants_file: str = dataclasses.field(
        default="",
        metadata={
            "help": "the tenant registry (YAML: tenants, their credentials, tiers and limits; docs/security.md); "
            "empty: every caller is anonymous and standard, and credentials are refused"
        },
    )
    trust_tier_header: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "the old mode: believe the tier a request claims (x-user-tier, the OIP priority) whoever sends "
            "it; for a router that only trusted callers can reach"
        },
    )
    trust_sidecar_identity: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "the router sits behind its own Istio sidecar: take the peer principal from "
            "x-forwarded-client-cert and a tenant from jwt_tenant_header (the mesh refuses client copies)"
        },
    )
    jwt_tenant_header: str = dataclasses.field(
        default="x-infermesh-jwt-tenant",
        metadata={"help": "the header Istio's RequestAuthentication writes a verified token's tenant claim into"},
    )
    drain_grace_s: float = dataclasses.field(default=10.0)
    tls_cert_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_cert_file"]})
    tls_key_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_key_file"]})
    tls_ca_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_ca_file"]})
    tls_require_client_cert: bool = dataclasses.field(
        default=False, metadata={"help": tls.TLS_HELP["tls_require_client_cert"]}
    )
    upstream_tls: bool = dataclasses.field(default=False, metadata={"help": tls.TLS_HELP["upstream_tls"]})
    log_level: str = dataclasses.field(default="info")
    slow_request_ms: float = dataclasses.field(
        default=1000.0, metadata={"help": "a request slower than this writes an outcome line (JSON, stderr)"}
    )
    log_success_ratio: float = dataclasses.field(
        default=0.001, metadata={"help": "the share of other successful requests that write an outcome line"}
    )
    outcome_lines_per_s: float = dataclasses.field(
        default=20.0, metadata={"help": "at most this many outcome lines a second per reason (a status, slow, sampled)"}
    )
    breaker_min_counted_timeout_ms: float = dataclasses.field(
        default=1000.0,
        metadata={
            "help": "a DEADLINE_EXCEEDED counts against a model's breaker only for a request whose own deadline was at "
            "least this far: a shorter one is the caller's, and a model that is really hung times out "
            "requests with ample deadlines too"
        },
    )
    failure_samples_content: str = dataclasses.field(
        default="redacted",
        metadata={
            "help": "what a failure sample holds of the inputs: redacted (shapes and a keyed hash of each text), "
            "full (texts cut to 200 characters) or off (no samples written)"
        },
    )
    failure_samples_max_bytes: int = dataclasses.field(
        default=8 * 1024 * 1024,
        metadata={
            "help": "bound on the failure-samples file; past it the file becomes <path>.1 (one rotated file is kept)"
        },
    )
    max_text_bytes: int = dataclasses.field(
        default=64 * 1024,
        metadata={
            "help": "largest BYTES element (one text) of a request; longer is INVALID_ARGUMENT naming the element"
        },
    )
    max_inputs: int = dataclasses.field(default=64, metadata={"help": "inputs (and raw_input_contents) of one request"})
    max_outputs: int = dataclasses.field(default=64, metadata={"help": "requested outputs of one request"})
    max_parameters: int = dataclasses.field(
        default=32,
        metadata={"help": "entries of each parameter map of a request (its own, each input's, each output's)"},
    )
    max_typed_elements: int = dataclasses.field(
        default=1 << 16,
        metadata={
            "help": "elements of typed contents in one request, all inputs together; larger tensors go as "
            "raw_input_contents (parsing typed ones costs a step per element)"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        tls.check(self)
        OutcomeSettings(self.slow_request_ms / 1000, self.log_success_ratio, self.outcome_lines_per_s)  # checks them
        if "," in self.batcher:
            for entry in self.batcher.split(","):
                host, _, port = entry.rpartition(":")
                require(
                    _is_ipv4(host) and port.isdigit() and 0 < int(port) < 65536,
                    f"batcher: a list of batchers takes IPv4:port entries, got {entry!r} in {self.batcher!r}",
                )
        require(self.max_request_bytes >= 1024, f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        require(
            not (self.trust_tier_header and self.tenants_file),
            "trust_tier_header believes every claim: it cannot go with a tenants_file, whose tiers it would ignore",
        )
        require(
            self.jwt_tenant_header == self.jwt_tenant_header.lower() and bool(self.jwt_tenant_header.strip()),
            f"jwt_tenant_header must be a lower-case header name, got {self.jwt_tenant_header!r}",
        )
        require(
            self.max_stream_message_bytes == 0 or self.max_stream_message_bytes >= 1024,
            f"max_stream_message_bytes must be 0 or >= 1024, got {self.max_stream_message_bytes}",
        )
        require(
            self.stream_idle_timeout_s >= 0, f"stream_idle_timeout_s must be >= 0, got {self.stream_idle_timeout_s}"
        )
        self.check_largest("max_request_bytes", self.max_request_bytes)
        self.check_largest("max_stream_message_bytes", self.stream_message_bytes)
        require(self.default_timeout_s > 0, f"default_timeout_s must be > 0, got {self.default_timeout_s}")
        require(self.batcher_streams >= 1, f"batcher_streams must be >= 1, got {self.batcher_streams}")
        require(
            0 <= self.batcher_linger_ms <= 100, f"batcher_linger_ms must be in [0, 100], got {self.batcher_linger_ms}"
        )
        require(self.stream_max_age_s >= 0, f"stream_max_age_s must be >= 0, got {self.stream_max_age_s}")
        require(self.max_stream_inflight >= 1, f"max_stream_inflight must be >= 1, got {self.max_stream_inflight}")
        require(
            self.cache_lookup_timeout_ms > 0, f"cache_lookup_timeout_ms must be > 0, got {self.cache_lookup_timeout_ms}"
        )
        require(self.cache_bypass_window >= 1, f"cache_bypass_window must be >= 1, got {self.cache_bypass_window}")
        require(self.cache_bypass_memory >= 1, f"cache_bypass_memory must be >= 1, got {self.cache_bypass_memory}")
        require(
            0 <= self.cache_min_hit_rate < 0.5, f"cache_min_hit_rate must be in [0, 0.5), got {self.cache_min_hit_rate}"
        )
        require(self.near_cache_ttl_s >= 0, f"near_cache_ttl_s must be >= 0, got {self.near_cache_ttl_s}")
        require(self.near_cache_max_bytes >= 0, f"near_cache_max_bytes must be >= 0, got {self.near_cache_max_bytes}")
        require(self.catalog_poll_s > 0, f"catalog_poll_s must be > 0, got {self.catalog_poll_s}")
        require(
            0 < self.breaker_recover_error_rate <= self.breaker_open_error_rate < 1,
            f"need 0 < breaker_recover_error_rate <= breaker_open_error_rate < 1, got "
            f"{self.breaker_recover_error_rate} and {self.breaker_open_error_rate}",
        )
        require(
            self.breaker_window_s > 0 and self.breaker_open_s > 0 and self.breaker_min_requests >= 1,
            f"breaker window, open time and minimum requests must be positive, got {self.breaker_window_s}, "
            f"{self.breaker_open_s}, {self.breaker_min_requests}",
        )
        require(
            self.breaker_min_counted_timeout_ms >= 0,
            f"breaker_min_counted_timeout_ms must be >= 0, got {self.breaker_min_counted_timeout_ms}",
        )
        require(
            self.failure_samples_content in ("off", "redacted", "full"),
            f"failure_samples_content must be off, redacted or full, got {self.failure_samples_content!r}",
        )
        require(
            self.failure_samples_max_bytes >= 64 * 1024,
            f"failure_samples_max_bytes must be >= 65536 (a sample line fits), got {self.failure_samples_max_bytes}",
        )
        for name in ("max_text_bytes", "max_inputs", "max_outputs", "max_parameters", "max_typed_elements"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")

    def request_limits(self) -> "RequestLimits":
        from services.router.limits import RequestLimits

        return RequestLimits(
            self.max_inputs, self.max_outputs, self.max_parameters, self.max_typed_elements, self.max_text_bytes
        )

    @property
    def stream_message_bytes(self) -> int:
        return self.max_stream_message_bytes or self.max_request_bytes

    def settings(self) -> "RouterSettings":
        from services.router.core import RouterSettings

        return RouterSettings(
            self.default_timeout_s,
            self.breaker_policy(),
            self.request_limits(),
            OutcomeSettings(self.slow_request_ms / 1000, self.log_success_ratio, self.outcome_lines_per_s),
        )

    def breaker_policy(self) -> "BreakerPolicy":
        from services.router.breaker import BreakerPolicy

        return BreakerPolicy(
            self.breaker_open_error_rate,
            self.breaker_recover_error_rate,
            self.breaker_window_s,
            self.breaker_min_requests,
            self.breaker_open_s,
            self.breaker_min_counted_timeout_ms / 1000,
        )

    def failure_samples(self) -> "FailureSamples | None":
        """The failure-samples file, or None where there is none."""
        from services.router.breaker import FailureSamples

        if not self.failure_samples_path or self.failure_samples_content == "off":
            return None
        return FailureSamples(
            self.failure_samples_path, content=self.failure_samples_content, max_bytes=self.failure_samples_max_bytes
        )


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True
