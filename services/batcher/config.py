"""The batcher's configuration: the service's (BatcherConfig, from its command
line) and the frozen objects its core and replica client are built from."""

import dataclasses
from typing import ClassVar

from services.batcher.policy import POLICIES
from services.common import tls
from services.common.budget import MIB, ServingLimits
from services.common.config import require
from services.common.tier import TIERS, Tier


@dataclasses.dataclass(frozen=True)
class LevelPolicy:
    """Triton's queue policy, per queue level (one per tier): how many may wait, and the
    longest a request may wait when it brings no tighter deadline."""

    max_queue_size: int
    default_timeout_s: float


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    levels: dict[Tier, LevelPolicy]  # the queue level of each tier
    # Once a standard request has waited this long, VIP-led batches alternate
    # with standard-led ones: a steady VIP stream cannot starve standard traffic.
    aging_s: float = 1.0
    # Deadline-aware admission lets the work ahead of a request fill at most
    # this share of its time left; the rest absorbs the error of a rate
    # measured on a busy machine, so that what is admitted is served.
    admission_share: float = 0.5

    @classmethod
    def uniform(
        cls, max_queue_size: int, default_timeout_s: float, aging_s: float = 1.0, admission_share: float = 0.5
    ) -> "QueuePolicy":
        return cls({tier: LevelPolicy(max_queue_size, default_timeout_s) for tier in TIERS}, aging_s, admission_share)


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """What the batching core (services/batcher/core.py) is built from."""

    max_batch_size: int  # rows per batch, capped by each model's own max
    max_queue_delay_ms: float  # longest wait of the oldest request for a fuller batch
    max_queue_size: int = 2048  # per level, when no `policy` is given
    default_timeout_s: float = 30.0  # of a batch whose requests do not all have a deadline
    policy: QueuePolicy | None = None  # None: QueuePolicy.uniform(max_queue_size, default_timeout_s)
    length_aware: bool = True  # batch texts of similar length together
    batch_policy: str = "fixed"  # services/batcher/policy.py
    # The adaptive policy's latency target per tier.
    latency_targets_s: dict[Tier, float] = dataclasses.field(
        default_factory=lambda: {Tier.VIP: 0.2, Tier.STANDARD: 1.0}
    )

    def __post_init__(self) -> None:
        require(self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}")
        require(self.max_queue_delay_ms >= 0, f"max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms}")
        require(self.batch_policy in POLICIES, f"batch_policy must be one of {POLICIES}, got {self.batch_policy!r}")
        if self.policy is None:
            object.__setattr__(self, "policy", QueuePolicy.uniform(self.max_queue_size, self.default_timeout_s))

    @property
    def max_delay_s(self) -> float:
        return self.max_queue_delay_ms / 1000


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """What the model-server client (services/batcher/replicas.py) is built from."""

    addresses: tuple[str, ...]  # host:port of each replica (behind a mesh: one Service)
    max_inflight_per_replica: int  # batches in flight at a replica that does not report its instances
    poll_s: float  # how often the replicas are asked for their models
    max_message_bytes: int
    behind_mesh: bool = False  # the address is a mesh Service whose sidecar balances, retries and ejects
    queued_per_replica: int = 0  # standard batches sent beyond what a replica's instances can start

    def __post_init__(self) -> None:
        require(len(self.addresses) > 0, "addresses must name at least one host:port")
        require(
            self.max_inflight_per_replica >= 1,
            f"max_inflight_per_replica must be >= 1, got {self.max_inflight_per_replica}",
        )
        require(self.poll_s > 0, f"poll_s must be > 0, got {self.poll_s}")
        require(self.queued_per_replica >= 0, f"queued_per_replica must be >= 0, got {self.queued_per_replica}")


@dataclasses.dataclass(frozen=True)
class BatcherConfig(ServingLimits):
    baseline_bytes: ClassVar[int] = 256 * MIB

    model_servers: tuple[str, ...] = dataclasses.field(
        default=("127.0.0.1:8011",), metadata={"help": "model_server replicas, comma-separated host:port"}
    )
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port, 0 picks a free one"})
    metrics_port: int = dataclasses.field(default=0, metadata={"help": "Prometheus port, 0 picks a free one"})
    max_batch_size: int = dataclasses.field(
        default=32, metadata={"help": "rows per batch, capped by each model's own max"}
    )
    max_queue_delay_ms: float = dataclasses.field(
        default=5.0, metadata={"help": "longest wait of the oldest request for a fuller batch"}
    )
    vip_max_queue_size: int = dataclasses.field(
        default=1024, metadata={"help": "VIP requests waiting per model before RESOURCE_EXHAUSTED"}
    )
    standard_max_queue_size: int = dataclasses.field(
        default=2048, metadata={"help": "standard requests waiting per model before RESOURCE_EXHAUSTED"}
    )
    vip_default_timeout_ms: float = dataclasses.field(
        default=30_000, metadata={"help": "longest a VIP request waits unless its deadline is sooner (0: no limit)"}
    )
    standard_default_timeout_ms: float = dataclasses.field(
        default=30_000,
        metadata={"help": "longest a standard request waits unless its deadline is sooner (0: no limit)"},
    )
    standard_aging_ms: float = dataclasses.field(
        default=1000,
        metadata={"help": "once a standard request waits this long, VIP-led batches alternate with standard-led ones"},
    )
    admission_share: float = dataclasses.field(
        default=0.5,
        metadata={
            "help": "a request with a deadline is refused at once (RESOURCE_EXHAUSTED) when the work queued and "
            "running ahead of it would fill more than this share of its time left"
        },
    )
    batch_policy: str = dataclasses.field(
        default="fixed", metadata={"help": "fixed, baseline or adaptive (services/batcher/policy.py)"}
    )
    vip_latency_target_ms: float = dataclasses.field(
        default=200, metadata={"help": "adaptive policy: VIP latency target"}
    )
    standard_latency_target_ms: float = dataclasses.field(
        default=1000, metadata={"help": "adaptive policy: standard latency target"}
    )
    length_aware: bool = dataclasses.field(default=True, metadata={"help": "batch texts of similar length together"})
    max_inflight_batches_per_replica: int = dataclasses.field(
        default=2,
        metadata={
            "help": "batches in flight per replica that does not report its instances (behind a mesh, a Service of "
            "several pods); others get as many as their instances can start"
        },
    )
    queued_batches_per_replica: int = dataclasses.field(
        default=0,
        metadata={
            "help": "standard batches sent to a replica beyond those its instances can start, to wait there: hides "
            "the RPC's round trip where a batch takes little longer (a GPU), at the cost of requests "
            "committed to a waiting batch, which under overload can only be refused late"
        },
    )
    replica_poll_s: float = dataclasses.field(
        default=1.0, metadata={"help": "how often replicas are asked for their models"}
    )
    execute_timeout_s: float = dataclasses.field(
        default=30.0, metadata={"help": "longest a batch RPC may take without a tighter deadline"}
    )
    traffic_policy: str = dataclasses.field(
        default="",
        metadata={
            "help": "comma-separated YAML files with the Istio VirtualService and DestinationRule for the model "
            "servers (e.g. mesh/istio/model-server.yaml); applied to this hop, reloaded when they change"
        },
    )
    traffic_host: str = dataclasses.field(default="model-server", metadata={"help": "the host those resources are for"})
    model_servers_behind_mesh: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "the model-server address is a mesh Service whose sidecar balances, retries and ejects "
            "(Kubernetes with Istio): a failed batch neither marks it unready nor is retried here"
        },
    )
    max_message_bytes: int = dataclasses.field(default=64 * 1024 * 1024)
    drain_grace_s: float = dataclasses.field(default=10.0)
    tls_cert_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_cert_file"]})
    tls_key_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_key_file"]})
    tls_ca_file: str = dataclasses.field(default="", metadata={"help": tls.TLS_HELP["tls_ca_file"]})
    tls_require_client_cert: bool = dataclasses.field(
        default=False, metadata={"help": tls.TLS_HELP["tls_require_client_cert"]}
    )
    upstream_tls: bool = dataclasses.field(default=False, metadata={"help": tls.TLS_HELP["upstream_tls"]})
    log_level: str = dataclasses.field(default="info")

    @property
    def traffic_policy_files(self) -> list[str]:
        return [p.strip() for p in self.traffic_policy.split(",") if p.strip()]

    def __post_init__(self) -> None:
        super().__post_init__()
        tls.check(self)
        self.check_largest("max_message_bytes", self.max_message_bytes)
        require(len(self.model_servers) > 0, "model_servers must name at least one host:port")
        require(self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}")
        require(self.max_queue_delay_ms >= 0, f"max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms}")
        require(self.batch_policy in POLICIES, f"batch_policy must be one of {POLICIES}, got {self.batch_policy!r}")
        require(
            self.vip_latency_target_ms > 0 and self.standard_latency_target_ms > 0,
            f"latency targets must be > 0, got {self.vip_latency_target_ms} and {self.standard_latency_target_ms}",
        )
        for name in ("vip_max_queue_size", "standard_max_queue_size"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("vip_default_timeout_ms", "standard_default_timeout_ms", "standard_aging_ms"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(0 < self.admission_share <= 1, f"admission_share must be in (0, 1], got {self.admission_share}")
        require(
            self.max_inflight_batches_per_replica >= 1,
            f"max_inflight_batches_per_replica must be >= 1, got {self.max_inflight_batches_per_replica}",
        )
        require(
            self.queued_batches_per_replica >= 0,
            f"queued_batches_per_replica must be >= 0, got {self.queued_batches_per_replica}",
        )
        require(self.replica_poll_s > 0, f"replica_poll_s must be > 0, got {self.replica_poll_s}")
        require(
            not (self.model_servers_behind_mesh and self.traffic_policy),
            "model_servers_behind_mesh and traffic_policy exclude each other: behind a mesh its sidecars apply "
            f"the traffic policy (got traffic_policy={self.traffic_policy!r})",
        )

    def queue_policy(self) -> QueuePolicy:
        return QueuePolicy(
            {
                Tier.VIP: LevelPolicy(self.vip_max_queue_size, self.vip_default_timeout_ms / 1000),
                Tier.STANDARD: LevelPolicy(self.standard_max_queue_size, self.standard_default_timeout_ms / 1000),
            },
            aging_s=self.standard_aging_ms / 1000,
            admission_share=self.admission_share,
        )

    def replicas(self) -> ReplicaConfig:
        return ReplicaConfig(
            self.model_servers,
            self.max_inflight_batches_per_replica,
            self.replica_poll_s,
            self.max_message_bytes,
            behind_mesh=self.model_servers_behind_mesh,
            queued_per_replica=self.queued_batches_per_replica,
        )

    def batching(self) -> BatchingConfig:
        return BatchingConfig(
            self.max_batch_size,
            self.max_queue_delay_ms,
            default_timeout_s=self.execute_timeout_s,
            policy=self.queue_policy(),
            length_aware=self.length_aware,
            batch_policy=self.batch_policy,
            latency_targets_s=self.latency_targets_s(),
        )

    def latency_targets_s(self) -> dict[Tier, float]:
        return {Tier.VIP: self.vip_latency_target_ms / 1000, Tier.STANDARD: self.standard_latency_target_ms / 1000}
