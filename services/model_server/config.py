"""The model server's configuration."""

import dataclasses
import enum
import os
import pathlib
from typing import ClassVar

from services.common import tls
from services.common.budget import GIB, KIB, ServingLimits
from services.common.config import require

CONTROL_MODES = ("none", "explicit", "poll")


class ControlMode(enum.Enum):
    NONE = "none"  # load everything at startup; no changes afterwards
    EXPLICIT = "explicit"  # changes by RPC only
    POLL = "poll"  # changes follow the repository on disk


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """What the model manager (services/model_server/core.py) is built from."""

    repository: str  # the model repository's folder: <model>/<version>/ and a config.json per model
    device: str = "auto"  # cpu, cuda or auto
    threads: int = 1  # intra-op threads per session
    control_mode: ControlMode = ControlMode.EXPLICIT
    startup_models: tuple[str, ...] = ("*",)  # loaded at start ("*": all)
    rollback_grace_s: float = 600.0  # how long a replaced version stays loaded as a standby
    probe_interval_s: float = 30.0  # between rounds of the correctness probe; 0: none
    poll_interval_s: float = 5.0  # poll mode: between looks at the repository
    slice_s: float = 0.0  # the longest slice a standard batch runs in while VIP batches come; 0: whole batches

    def __post_init__(self) -> None:
        require(self.threads >= 1, f"threads must be >= 1, got {self.threads}")
        for name in ("rollback_grace_s", "probe_interval_s", "poll_interval_s", "slice_s"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def repository_path(self) -> pathlib.Path:
        return pathlib.Path(self.repository)


@dataclasses.dataclass(frozen=True)
class ModelServerConfig(ServingLimits):
    # The runtime and the models' sessions (minilm, its variants, their arenas), what it takes serving nothing.
    baseline_bytes: ClassVar[int] = 2 * GIB

    memory_limit_bytes: int = dataclasses.field(
        default=6 * GIB,
        metadata={
            "help": "the memory this process may use (its pod's limit); sizes request_budget_bytes when that is 0"
        },
    )
    # A load's overrides may be 64 KiB (MAX_OVERRIDES_BYTES), refused by their own rule, which names the parameter.
    max_control_request_bytes: int = dataclasses.field(
        default=256 * KIB,
        metadata={
            "help": "largest request of a control RPC (health, metadata, model control, listings); larger gets "
            "RESOURCE_EXHAUSTED"
        },
    )
    model_repository: str = dataclasses.field(default="build/models", metadata={"help": "model repository folder"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port, 0 picks a free one"})
    metrics_port: int = dataclasses.field(default=0, metadata={"help": "Prometheus port, 0 picks a free one"})
    device: str = dataclasses.field(default="auto", metadata={"help": "auto, cpu or cuda"})
    intra_op_threads: int = dataclasses.field(
        default=0, metadata={"help": "ORT intra-op threads, 0 = one per core this process may run on"}
    )
    model_control_mode: str = dataclasses.field(
        default="explicit",
        metadata={
            "help": "none: models fixed at startup; explicit: load/unload by RPC; poll: follow the repository on disk"
        },
    )
    load_models: str = dataclasses.field(
        default="*", metadata={"help": "comma-separated models to load at startup in explicit mode; * for all"}
    )
    tenants_file: str = dataclasses.field(
        default="",
        metadata={
            "help": "tenant registry (as the router's): repository Load and Unload need an admin tenant's credential "
            "(bearer key or client certificate); empty: they are refused"
        },
    )
    repository_poll_s: float = dataclasses.field(default=5.0, metadata={"help": "poll mode: seconds between scans"})
    rollback_grace_s: float = dataclasses.field(
        default=600.0, metadata={"help": "how long a replaced version stays loaded for instant rollback"}
    )
    probe_interval_s: float = dataclasses.field(
        default=30.0,
        metadata={"help": "seconds between golden-probe correctness checks of serving versions; 0 turns them off"},
    )
    slice_ms: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "while VIP batches come, run a standard batch in slices of about this long, so a VIP batch waits "
            "for one slice instead of the whole batch; 0 = whole batches"
        },
    )
    labels: str = dataclasses.field(
        default="",
        metadata={"help": "comma-separated key=value labels a DestinationRule subset selects, e.g. version=blue"},
    )
    gpu_sample_s: float = dataclasses.field(
        default=5.0, metadata={"help": "seconds between NVML samples when a GPU is present"}
    )
    max_message_bytes: int = dataclasses.field(default=64 * 1024 * 1024)
    max_concurrent_rpcs: int = dataclasses.field(default=256)
    drain_grace_s: float = dataclasses.field(default=10.0)
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
        require(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        require(
            self.model_control_mode in CONTROL_MODES,
            f"model_control_mode must be one of {CONTROL_MODES}, got {self.model_control_mode!r}",
        )
        require(0 <= self.port < 65536, f"port must be 0..65535, got {self.port}")
        require(self.intra_op_threads >= 0, f"intra_op_threads must be >= 0, got {self.intra_op_threads}")
        require(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        require(self.repository_poll_s > 0, f"repository_poll_s must be > 0, got {self.repository_poll_s}")
        require(self.rollback_grace_s >= 0, f"rollback_grace_s must be >= 0, got {self.rollback_grace_s}")
        require(self.probe_interval_s >= 0, f"probe_interval_s must be >= 0, got {self.probe_interval_s}")
        require(self.slice_ms >= 0, f"slice_ms must be >= 0, got {self.slice_ms}")
        require(self.gpu_sample_s > 0, f"gpu_sample_s must be > 0, got {self.gpu_sample_s}")
        require(bool(self.startup_models), "load_models must name at least one model or '*'")
        require(
            all("=" in item for item in self.labels.split(",") if item.strip()),
            f"labels must be comma-separated key=value pairs, got {self.labels!r}",
        )

    @property
    def threads(self) -> int:
        return self.intra_op_threads or len(os.sched_getaffinity(0)) or 1

    @property
    def label_map(self) -> dict[str, str]:
        pairs = [item.split("=", 1) for item in self.labels.split(",") if item.strip()]
        return {key.strip(): value.strip() for key, value in pairs}

    @property
    def startup_models(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.load_models.split(",") if name.strip())

    def manager(self) -> ManagerConfig:
        return ManagerConfig(
            self.model_repository,
            self.device,
            self.threads,
            control_mode=ControlMode(self.model_control_mode),
            startup_models=self.startup_models,
            rollback_grace_s=self.rollback_grace_s,
            probe_interval_s=self.probe_interval_s,
            poll_interval_s=self.repository_poll_s,
            slice_s=self.slice_ms / 1000,
        )
