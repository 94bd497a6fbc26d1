"""What a local mesh is made of: one frozen, checked MeshConfig."""

import dataclasses
import os

from services.common.tracing import TracingConfig
from services.launcher.supervisor import RestartPolicy

# Local model servers run below the router and the batcher: the model is the heavy, batched
# part and takes whatever CPU is left, while the hops in front of it are light and decide
# latency, a refusal's most of all (bench/batching.py runs its layouts at this niceness).
MODEL_SERVER_NICE = 5

Path = str | os.PathLike[str]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A mesh on one machine; every field has a default that `make run` and the tests use."""

    models: Path = "build/models"
    """The model repository every model server loads (tools/build_models writes it)."""

    host: str = "127.0.0.1"
    """The router's (public) host; `internal_host` is every other service's."""

    internal_host: str = "127.0.0.1"

    router_port: int = 0
    """The public port; 0 takes a free one (tests), `make run` passes 8001."""

    metrics_port: int = 0
    """The first router's /metrics port (each further router the next one); 0: free ones."""

    redis_url: str | None = None
    """An existing Redis for the cache; None starts a redis-server of the mesh's own."""

    cache: bool = True
    """Whether the cache service (and its Redis) runs; without it the router looks up nothing."""

    l2_path: Path | None = None
    """The cache's on-disk store; None: the cache service's default."""

    log_dir: Path | None = None
    """Where each service's log (and the development tenant registry) goes; None: no logs."""

    routers: int = 1
    """Router processes sharing the public port (SO_REUSEPORT): router, router-2, ..."""

    batchers: int = 1
    """Batcher processes: batcher, batcher-2, ...; the routers open each new stream to the
    next ready one (round robin)."""

    model_servers: int = 1
    """Model server replicas: model_server-0, model_server-1, ... when more than one."""

    model_server_labels: tuple[str, ...] = ()
    """One --labels value per replica (e.g. "version=blue"), as pods of two colours carry."""

    model_server_nice: int | tuple[int, ...] = MODEL_SERVER_NICE
    """A niceness for the model servers (one for all, or one per replica): on one machine
    the model takes every core it can get, and a lower CPU priority leaves the router and
    the batcher a core at once when they need one (bench/batching.py measures it)."""

    router_args: tuple[str, ...] = ()
    """Further command-line options of each service (the last of a repeated option wins)."""

    batcher_args: tuple[str, ...] = ()
    model_server_args: tuple[str, ...] = ()
    cache_args: tuple[str, ...] = ()

    tenants_file: Path | None = None
    """The tenant registry of every service (the router's tenants, the control RPCs'
    admins); None: a development registry of the mesh's own (a VIP, a standard and an
    admin tenant) whose keys are in Mesh.keys."""

    tls_dir: Path | None = None
    """A folder of tools.certs' files: each service serves its own certificate, asks
    every caller for one of the folder's CA, and calls the others with its own."""

    otlp_endpoint: str = ""
    """An OTLP/gRPC collector (host:port, Jaeger's for `make run TRACING=1`) that every
    service sends its spans to; "" traces nothing."""

    trace_ratio: float = 0.01
    """The share of requests without a sampled traceparent whose trace the router samples."""

    ready_timeout_s: float = 120.0
    """How long each service may take to print its ready line."""

    supervise: bool = False
    """Restart a service that exits or stops answering its health checks (supervisor.py)."""

    restart_policy: RestartPolicy = dataclasses.field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        for name in ("routers", "batchers", "model_servers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("router_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port (0 to 65535), got {getattr(self, name)}")
        TracingConfig(otlp_endpoint=self.otlp_endpoint, trace_ratio=self.trace_ratio)  # the services' own checks
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        if len(self.model_server_labels) > self.model_servers:
            raise ValueError(
                f"model_server_labels has {len(self.model_server_labels)} values for {self.model_servers} model servers"
            )
        for name in ("router_args", "batcher_args", "model_server_args", "cache_args", "model_server_labels"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(item, str) for item in value):
                raise ValueError(f"{name} must be a sequence of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))  # a list given stays the caller's
