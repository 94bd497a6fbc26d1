"""A local mesh: redis-server, model_server, batcher, cache and router as child
processes, started in dependency order on loopback and stopped in reverse.

Each service prints one JSON line when it serves, with its bound addresses;
internal services bind port 0, so meshes never collide with each other. The
router binds the public host, the others an internal one (loopback unless
told). With a certificate folder (`make certs`) every hop is mutual TLS.
"""

import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import grpc
import redis

from services.common import identity, tls
from services.common.serving import DIE_WITH_PARENT
from services.launcher.config import MODEL_SERVER_NICE, MeshConfig
from services.launcher.supervisor import Supervisor

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _lower_priority(pid: int, nice: int) -> None:
    """Lowers a child's CPU priority by `nice`. Where the kernel schedules
    each session as a group (autogroup, on by default in many distributions),
    a process's own niceness only ranks it within its session, and every
    service here is a session of its own: the session's niceness is set too."""
    os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice))
    try:
        with open(f"/proc/{pid}/autogroup", "w") as autogroup:
            autogroup.write(str(nice))
    except OSError:
        pass  # no autogroup scheduling here: the process's niceness is what counts


# The certificate (tools.certs) each service serves and presents.
CERTIFICATES = {
    "services.router": "router",
    "services.batcher": "batcher",
    "services.cache": "cache",
    "services.model_server": "model-server",
}


class MeshError(RuntimeError):
    """A service did not come up; the message carries the tail of its log."""


class Process:
    """One child process; `respawn` starts it again with the same command line,
    pinned to the ports it announced the first time."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: pathlib.Path | None,
        env: dict[str, str],
        announces: bool = True,
        nice: int = 0,
    ):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log" if log_dir else None
        self.env = env
        self.announces = announces
        self.nice = nice
        self.info: dict = {}
        self._buffer = b""
        self._launch(argv)

    def _launch(self, argv: list[str]) -> None:
        stderr = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - lives with the child
        # Our services print one ready line on stdout; other programs' output is their log.
        stdout = subprocess.PIPE if self.announces else (stderr or subprocess.DEVNULL)
        # A session of its own: a terminal's Ctrl-C reaches only the launcher,
        # which then stops the services in order; and the child dies with us
        # (die_with_parent, as it starts). No code runs between fork and exec.
        self.popen = subprocess.Popen(
            argv,
            stdout=stdout,
            stderr=stderr,
            cwd=ROOT,
            env={**self.env, DIE_WITH_PARENT: str(os.getpid())},
            start_new_session=True,
        )
        if self.nice:
            _lower_priority(self.popen.pid, self.nice)
        if stderr is not None:
            stderr.close()
        self._buffer = b""

    def respawn(self) -> None:
        """Starts the process again (the last one has exited), on the ports it had:
        its callers reconnect to the address they know."""
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        pinned = []
        if self.announces and self.info:
            pinned = ["--port", self.info["grpc"].rsplit(":", 1)[1]]
            if self.info.get("metrics"):
                pinned += ["--metrics-port", self.info["metrics"].rsplit(":", 1)[1]]
        self._launch([*self.argv, *pinned])  # the last of a repeated option wins

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise MeshError(
                    f"{self.name} exited with code {self.popen.returncode} before it was ready\n{self.log_tail()}"
                )
            if self.poll_ready(0.1):
                return self.info
        raise MeshError(f"{self.name} was not ready within {timeout_s:.0f}s\n{self.log_tail()}")

    def poll_ready(self, wait_s: float = 0.0) -> bool:
        """Reads what the process has printed (waiting up to wait_s) and says
        whether its ready line is among it; `info` is then that line. A process
        that does not announce itself is ready once it runs."""
        if not self.announces:
            return self.alive()
        stdout = self.popen.stdout
        assert stdout is not None  # a process that announces itself prints to a pipe (_launch)
        readable, _, _ = select.select([stdout], [], [], wait_s)
        if readable:
            self._buffer += os.read(stdout.fileno(), 65536)
            for line in self._buffer.splitlines():
                if line.startswith(b"{") and b'"ready"' in line:
                    self.info = json.loads(line)
                    return True
        return False

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()


class Mesh:
    """Starts the whole mesh; `router` is the public address once started."""

    def __init__(
        self,
        config: MeshConfig | None = None,
        *,
        model_server_via: Callable[[str], str] | None = None,
        on_event: Callable[[str], None] | None = None,
    ):
        """`model_server_via`: given a model server's address, the one the batchers call
        it at instead (bench/chaos.py's fault-injecting proxy); `on_event`: told of each
        exit and restart when supervised (make run prints them)."""
        self.config = config = config if config is not None else MeshConfig()
        self.models = str(config.models)
        self.tls_dir = pathlib.Path(config.tls_dir) if config.tls_dir else None
        if self.tls_dir is not None and not (self.tls_dir / "ca.pem").is_file():
            raise MeshError(
                f"{self.tls_dir} has no ca.pem: run 'make certs' (python -m tools.certs --out {self.tls_dir})"
            )
        self.redis_url = config.redis_url  # our own redis-server's, once started
        self.log_dir = pathlib.Path(config.log_dir) if config.log_dir else None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tenants_file = str(config.tenants_file) if config.tenants_file else None
        self.keys: dict[str, str] = {}  # the development registry's, when the mesh made one
        self.processes: dict[str, Process] = {}
        self.lock = threading.RLock()  # `processes` and each one's restarts, shared with the supervisor
        self.supervisor = Supervisor(self, config.restart_policy, on_event) if config.supervise else None
        self.model_server_via = model_server_via
        self.redis_dir: str | None = None
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if config.otlp_endpoint:  # every service reads the same tracing settings (tracing.TracingConfig)
            self.env.update(INFERMESH_OTLP_ENDPOINT=config.otlp_endpoint, INFERMESH_TRACE_RATIO=str(config.trace_ratio))

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> "Mesh":
        try:
            if self.config.cache and self.redis_url is None:
                self.start_redis()
            servers = [
                self._spawn(
                    f"model_server-{i}" if self.config.model_servers > 1 else "model_server",
                    "services.model_server",
                    [
                        "--model-repository",
                        self.models,
                        "--tenants-file",
                        self._tenants(),
                        *self._core_share(),
                        *self.config.model_server_args,
                        *(
                            ["--labels", self.config.model_server_labels[i]]
                            if i < len(self.config.model_server_labels)
                            else []
                        ),
                    ],
                    nice=self._model_server_nice(i),
                )
                for i in range(self.config.model_servers)
            ]
            addresses = ",".join(p.wait_ready(self.config.ready_timeout_s)["grpc"] for p in servers)
            if self.model_server_via is not None:
                addresses = ",".join(self.model_server_via(a) for a in addresses.split(","))
            batchers = [
                self._spawn(name, "services.batcher", ["--model-servers", addresses, *self.config.batcher_args])
                for name in self.batcher_names()
            ]
            cache = None
            if self.config.cache:
                cache = self.start_cache()
            batcher_addresses = ",".join(b.wait_ready(self.config.ready_timeout_s)["grpc"] for b in batchers)
            router_argv = ["--batcher", batcher_addresses, "--tenants-file", self._tenants()]  # one registry for all
            if cache is not None:
                router_argv += ["--cache", cache.wait_ready(self.config.ready_timeout_s)["grpc"]]
            self.start_routers(router_argv)
            if self.supervisor is not None:
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _tenants(self) -> str:
        if self.tenants_file is None:
            doc, self.keys = identity.development_registry()
            folder = self.log_dir if self.log_dir is not None else pathlib.Path(tempfile.mkdtemp(prefix="infermesh-"))
            self.tenants_file = str(folder / "tenants.yaml")
            identity.write_registry(self.tenants_file, doc, replace=True)
        return self.tenants_file

    def credentials(self, tenant: str = "dev-vip") -> tuple[tuple[str, str], ...]:
        """gRPC metadata that calls as one of the development tenants."""
        return identity.bearer_metadata(self.keys[tenant])

    def start_routers(self, common: list[str]) -> None:
        """The first router binds the public port (a free one for port 0), the
        others the same port: with more than one, each takes SO_REUSEPORT and
        the kernel spreads callers' connections among them. Each has its own
        metrics port (the given one plus its index, or a free one)."""
        port = self.config.router_port
        for index in range(self.config.routers):
            name = self.router_names()[index]
            metrics_port = self.config.metrics_port + index if self.config.metrics_port else 0
            argv = [*common, "--port", str(port), "--metrics-port", str(metrics_port)]
            if self.config.routers > 1:
                argv.append("--reuse-port")
            if self.log_dir is not None:  # requests that failed while a breaker counted, for analysis
                argv += [
                    "--failure-samples-path",
                    str(
                        self.log_dir / f"failure-samples-{name}.jsonl"
                        if index
                        else self.log_dir / "failure-samples.jsonl"
                    ),
                ]
            info = self._spawn(name, "services.router", [*argv, *self.config.router_args]).wait_ready(
                self.config.ready_timeout_s
            )
            port = int(info["grpc"].rsplit(":", 1)[1])

    def router_names(self) -> list[str]:
        return ["router", *(f"router-{i}" for i in range(2, self.config.routers + 1))]

    def batcher_names(self) -> list[str]:
        return ["batcher", *(f"batcher-{i}" for i in range(2, self.config.batchers + 1))]

    def _core_share(self) -> list[str]:
        """Several model servers on one machine split its cores, as pods do a
        node's by their CPU requests: each taking them all, their ONNX Runtime
        threads would outnumber the cores (a thread of a parallel operator
        then waits for one that lost its core). Unless the caller chose."""
        if self.config.model_servers == 1 or any(
            a.startswith("--intra-op-threads") for a in self.config.model_server_args
        ):
            return []
        cores = len(os.sched_getaffinity(0))
        return ["--intra-op-threads", str(max(1, cores // self.config.model_servers))]

    def _model_server_nice(self, index: int) -> int:
        nice = self.config.model_server_nice
        if isinstance(nice, tuple):
            return nice[index] if index < len(nice) else MODEL_SERVER_NICE
        return nice

    def argv(self, module: str, args: list[str]) -> list[str]:
        """The command line of one of our services: the router binds the public
        host, the others the internal one; with a TLS folder, its certificates."""
        public = module == "services.router"
        argv = [
            sys.executable,
            "-m",
            module,
            "--host",
            self.config.host if public else self.config.internal_host,
            *tls_args(self.tls_dir, module),
            *args,
        ]
        if not public:
            argv += ["--metrics-port", "0"]
        return argv

    def _spawn(self, name: str, module: str, args: list[str], nice: int = 0) -> Process:
        with self.lock:
            process = Process(name, self.argv(module, args), self.log_dir, self.env, nice=nice)
            self.processes[name] = process
        return process

    def probe_channel(self, address: str) -> grpc.Channel:
        """A channel the supervisor checks a service's health on (TLS where the mesh is)."""
        credentials = self.client_credentials()
        return grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)

    def status(self) -> dict[str, dict]:
        """Each service's pid, state, restarts and ready flag (the supervisor's view,
        or, unsupervised, whether each process runs)."""
        if self.supervisor is not None:
            return self.supervisor.status()
        with self.lock:
            return {
                name: {
                    "pid": p.popen.pid,
                    "state": "running" if p.alive() else "stopped",
                    "restarts": 0,
                    "ready": p.alive(),
                    "last_exit": "",
                }
                for name, p in self.processes.items()
            }

    def client_files(self, client: str = "admin-dev") -> tuple[str, str, str] | None:
        """The CA, certificate and key files a caller of this mesh uses (`client`'s
        of the TLS folder, for tools such as ghz); None for a plaintext mesh."""
        if self.tls_dir is None:
            return None
        return str(self.tls_dir / "ca.pem"), str(self.tls_dir / f"{client}.pem"), str(self.tls_dir / f"{client}.key")

    def client_credentials(self, client: str = "admin-dev") -> grpc.ChannelCredentials | None:
        """What a caller of any service of this mesh presents; None for a plaintext mesh."""
        files = self.client_files(client)
        return tls.channel_credentials(*files) if files else None

    def start_cache(self) -> Process:
        """Spawns the cache service (also to restart it); the caller waits for it."""
        assert self.redis_url is not None  # given, or our own redis-server's (start)
        argv = ["--redis-url", self.redis_url, "--tenants-file", self._tenants(), *self.config.cache_args]
        if self.config.l2_path:
            argv += ["--l2-path", str(self.config.l2_path)]
        return self._spawn("cache", "services.cache", argv)

    def stop_service(self, name: str) -> None:
        with self.lock:
            process = self.processes.pop(name, None)
        if process is not None:
            process.stop(15)

    def start_redis(self) -> None:
        """Our own redis-server on a Unix socket: no TCP port to collide or expose."""
        executable = shutil.which("redis-server")
        if executable is None:
            raise MeshError("redis-server is not installed; run 'make setup' or set REDIS_URL")
        if self.redis_dir is None:
            self.redis_dir = tempfile.mkdtemp(prefix="infermesh-redis-")
        socket_path = os.path.join(self.redis_dir, "redis.sock")
        with self.lock:
            process = Process(
                "redis", redis_argv(executable, socket_path, self.redis_dir), self.log_dir, self.env, announces=False
            )
            self.processes["redis"] = process
        self.redis_url = f"unix://{socket_path}"
        wait_for_redis(process, self.redis_url, timeout_s=10)

    def stop_redis(self) -> None:
        self.stop_service("redis")

    def stop(self, grace_s: float = 15.0) -> None:
        """Drains the router first, then the services behind it, then Redis."""
        if self.supervisor is not None:
            self.supervisor.hold()  # nothing restarts what is being stopped
        order = [
            *self.router_names(),
            *self.batcher_names(),
            "cache",
            *[n for n in self.processes if n.startswith("model_server")],
            "redis",
        ]
        for name in self.router_names():  # the routers drain together, each finishing its own calls
            process = self.processes.get(name)
            if process is not None and process.alive():
                process.popen.send_signal(signal.SIGTERM)
        for name in order:
            with self.lock:
                process = self.processes.pop(name, None)
            if process is not None:
                process.stop(grace_s)
        if self.redis_dir is not None:
            shutil.rmtree(self.redis_dir, ignore_errors=True)
            self.redis_dir = None
        if self.supervisor is not None:
            self.supervisor.close()  # after the processes it started: they end with its thread

    def __enter__(self) -> "Mesh":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- addresses -----------------------------------------------------------------
    @property
    def router(self) -> str:
        return self.processes["router"].info["grpc"]

    @property
    def router_metrics(self) -> str:
        return "http://" + self.processes["router"].info["metrics"] + "/metrics"

    def address(self, name: str) -> str:
        return self.processes[name].info["grpc"]

    def metrics_url(self, name: str) -> str:
        return "http://" + self.processes[name].info["metrics"] + "/metrics"

    def dead(self) -> list[str]:
        return [name for name, p in self.processes.items() if not p.alive()]


def tls_args(tls_dir: pathlib.Path | None, module: str) -> list[str]:
    """The options that put one of our services on mutual TLS with tools.certs' files."""
    if tls_dir is None:
        return []
    certificate = CERTIFICATES[module]
    argv = [
        "--tls-cert-file",
        str(tls_dir / f"{certificate}.pem"),
        "--tls-key-file",
        str(tls_dir / f"{certificate}.key"),
        "--tls-ca-file",
        str(tls_dir / "ca.pem"),
        "--tls-require-client-cert",
    ]
    if module in ("services.router", "services.batcher"):  # they call other services
        argv.append("--upstream-tls")
    return argv


def redis_argv(executable: str, socket_path: str, folder: str) -> list[str]:
    """A redis-server on a Unix socket only (no TCP port to collide or expose), nothing saved,
    bounded in memory. redis-server cannot ask for a death signal itself as our services do;
    where util-linux's setpriv is there it asks for it before it execs redis-server."""
    setpriv = shutil.which("setpriv")
    options = {
        "port": "0",
        "bind": "127.0.0.1",
        "unixsocket": socket_path,
        "unixsocketperm": "700",
        "save": "",
        "appendonly": "no",
        "daemonize": "no",
        "maxmemory": "512mb",
        "maxmemory-policy": "allkeys-lru",
        "dir": folder,
    }
    return [
        *([setpriv, "--pdeathsig", "TERM"] if setpriv else []),
        executable,
        *(item for name, value in options.items() for item in (f"--{name}", value)),
    ]


def wait_for_redis(process: "Process", url: str, timeout_s: float) -> None:
    """Returns once redis-server answers PING; raises MeshError if it exits or stays silent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.alive():
            raise MeshError(f"redis-server exited with code {process.popen.returncode}\n{process.log_tail()}")
        try:
            if redis.Redis.from_url(url, socket_timeout=0.5).ping():
                return
        except (redis.RedisError, OSError):
            time.sleep(0.05)
    raise MeshError(f"redis-server did not answer PING within {timeout_s:.0f}s")
