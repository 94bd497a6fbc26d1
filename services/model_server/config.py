"""The model server's configuration."""

import dataclasses
import os

from services.common.config import require


@dataclasses.dataclass(frozen=True)
class ModelServerConfig:
    model_repository: str = dataclasses.field(default="build/models", metadata={"help": "model repository folder"})
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port, 0 picks a free one"})
    metrics_port: int = dataclasses.field(default=0, metadata={"help": "Prometheus port, 0 picks a free one"})
    device: str = dataclasses.field(default="auto", metadata={"help": "auto, cpu or cuda"})
    intra_op_threads: int = dataclasses.field(default=0, metadata={"help": "ORT intra-op threads, 0 = one per core"})
    max_message_bytes: int = dataclasses.field(default=64 * 1024 * 1024)
    max_concurrent_rpcs: int = dataclasses.field(default=256)
    drain_grace_s: float = dataclasses.field(default=10.0)
    log_level: str = dataclasses.field(default="info")

    def __post_init__(self):
        require(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        require(0 <= self.port < 65536, f"port must be 0..65535, got {self.port}")
        require(self.intra_op_threads >= 0, f"intra_op_threads must be >= 0, got {self.intra_op_threads}")
        require(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")

    @property
    def threads(self) -> int:
        return self.intra_op_threads or os.cpu_count() or 1
