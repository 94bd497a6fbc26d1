"""Jaeger v2 beside a local mesh (make run TRACING=1, and the tests): bin/jaeger with
tools/jaeger/config.yaml, every listener on 127.0.0.1, spans kept in memory."""

import contextlib
import os
import pathlib
import subprocess
import tempfile
import time
import urllib.request

from services.launcher.ports import free_ports

BINARY = pathlib.Path("bin/jaeger")  # relative to the repository root, where make runs
CONFIG = pathlib.Path("tools/jaeger/config.yaml")
# The environment variable that sets each listener's port (tools/jaeger/config.yaml),
# and Jaeger's usual port, which `make run TRACING=1` keeps.
PORT_VARIABLES = {
    "otlp_grpc": "INFERMESH_JAEGER_OTLP_GRPC_PORT",
    "otlp_http": "INFERMESH_JAEGER_OTLP_HTTP_PORT",
    "query_http": "INFERMESH_JAEGER_QUERY_HTTP_PORT",
    "query_grpc": "INFERMESH_JAEGER_QUERY_GRPC_PORT",
    "health": "INFERMESH_JAEGER_HEALTH_PORT",
}
USUAL_PORTS = {"otlp_grpc": 4317, "otlp_http": 4318, "query_http": 16686, "query_grpc": 16685, "health": 13133}


class Jaeger:
    """`with Jaeger() as jaeger:` runs bin/jaeger until the block ends, on free
    loopback ports (Jaeger(usual_ports=True): 4317 for OTLP/gRPC, 16686 for the
    query API); spans go to jaeger.otlp_grpc_endpoint ("127.0.0.1:port") or
    jaeger.otlp_http_endpoint ("http://127.0.0.1:port", at /v1/traces)."""

    def __init__(self, root: pathlib.Path | str = ".", usual_ports: bool = False):
        self.binary = pathlib.Path(root) / BINARY
        self.config = (pathlib.Path(root) / CONFIG).resolve()
        self.usual_ports = usual_ports

    def __enter__(self):
        if not self.binary.exists():
            raise RuntimeError(f"{self.binary} is missing: run `make setup`")
        self._stack = contextlib.ExitStack()
        try:
            self._begin()
        except BaseException:  # a server that started must not outlive a failed start
            self._stack.close()
            raise
        return self

    def _begin(self) -> None:
        self.dir = pathlib.Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="jaeger-")))
        self.ports = (
            dict(USUAL_PORTS)
            if self.usual_ports
            else dict(zip(PORT_VARIABLES, free_ports(len(PORT_VARIABLES)), strict=True))
        )
        self.otlp_grpc_endpoint = f"127.0.0.1:{self.ports['otlp_grpc']}"
        self.otlp_http_endpoint = f"http://127.0.0.1:{self.ports['otlp_http']}"
        self.query_url = f"http://127.0.0.1:{self.ports['query_http']}"
        self.log_path = self.dir / "jaeger.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed by the stack, after the process
        self._stack.callback(log.close)
        environment = os.environ | {PORT_VARIABLES[name]: str(port) for name, port in self.ports.items()}
        self.process = subprocess.Popen(
            [str(self.binary.resolve()), "--config", str(self.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=environment,
        )
        self._stack.callback(self._stop)
        self._wait_ready()

    def _stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"jaeger exited with status {self.process.returncode}:\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        """Returns once the health check says every pipeline has started."""
        url = f"http://127.0.0.1:{self.ports['health']}/status"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while it starts
                pass
            time.sleep(0.1)
        raise RuntimeError(f"jaeger was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def __exit__(self, *exc):
        self._stack.close()
