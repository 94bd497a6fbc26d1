"""The local mesh's kubelet: restarts a service that exits or stops answering.

One thread watches every process of a Mesh. A process that exits is started
again with the same command line, pinned to the ports it had (so whoever calls
it reconnects to the same address), after a delay that doubles with each
restart in a row, up to a bound, and starts over once the service has stayed
ready for a stable period (kubelet's CrashLoopBackOff). A service is live while
its health service answers, whatever it says: NOT_SERVING (loading, draining)
is live and not ready. One that does not answer `failure_threshold` liveness
checks in a row is killed and restarted, as kubelet does a container whose
liveness probe fails. A hang shorter than that (a GC pause, a SIGSTOP of a few
seconds) is waited out: the callers' own outlier detection routes around it.
"""

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a service that exited starts again, and when it is judged dead."""

    base_delay_s: float = 0.5  # after the first exit
    max_delay_s: float = 30.0  # the doubling stops here
    stable_s: float = 60.0  # ready this long: the next exit waits base_delay_s again
    probe_period_s: float = 2.0  # a liveness and readiness check per service this often
    probe_timeout_s: float = 1.0
    failure_threshold: int = 5  # liveness checks in a row unanswered: killed and restarted
    start_timeout_s: float = 180.0  # not ready this long after a restart: killed and restarted

    def __post_init__(self):
        if not 0 < self.base_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 < base_delay_s <= max_delay_s, got {self.base_delay_s} and {self.max_delay_s}")
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.probe_period_s <= 0 or self.probe_timeout_s <= 0:
            raise ValueError(
                f"probe_period_s and probe_timeout_s must be > 0, got {self.probe_period_s} and {self.probe_timeout_s}"
            )

    def delay_s(self, restarts_in_a_row: int) -> float:
        """The wait before restart number `restarts_in_a_row` (1, 2, ...) since the service was last stable."""
        return min(self.max_delay_s, self.base_delay_s * 2 ** max(0, restarts_in_a_row - 1))


@dataclasses.dataclass
class ServiceState:
    """What the supervisor knows of one service; `as_dict` is what status shows."""

    state: str = "running"  # running | starting | backoff | stopped
    pid: int | None = None
    restarts: int = 0
    in_a_row: int = 0  # restarts since it was last stable
    ready: bool = False
    ready_since: float | None = None
    last_exit: str = ""
    unanswered: int = 0  # liveness checks in a row
    next_start_at: float = 0.0
    started_at: float = 0.0
    next_probe_at: float = 0.0

    def as_dict(self) -> dict:
        return {
            "pid": self.pid,
            "state": self.state,
            "restarts": self.restarts,
            "ready": self.ready,
            "last_exit": self.last_exit,
        }


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """Watches `mesh.processes` from a thread of its own. `hold()` stops every
    restart and probe (before the mesh stops its services); `close()` ends the
    thread. The thread must outlive the processes it started: each asked the
    kernel for SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG)."""

    def __init__(self, mesh, policy: RestartPolicy, on_event: Callable[[str], None] | None = None):
        self._mesh = mesh
        self._policy = policy
        self._on_event = on_event or (lambda message: log.info("%s", message))
        self._states: dict[str, ServiceState] = {}
        self._lock = threading.Lock()  # _states, for readers on other threads
        self._held = threading.Event()
        self._idle = threading.Event()  # set while held and no step is under way
        self._closed = threading.Event()
        self._channels: dict[str, grpc.Channel] = {}
        self._redis: redis.Redis | None = None
        self._thread = threading.Thread(target=self._run, name="mesh-supervisor", daemon=True)

    def start(self) -> None:
        now = time.monotonic()
        with self._lock:
            for name, process in self._mesh.processes.items():
                self._states[name] = ServiceState(
                    pid=process.popen.pid, ready=True, ready_since=now, started_at=now, next_probe_at=now
                )
        self._thread.start()

    def status(self) -> dict[str, dict]:
        with self._lock:
            return {name: state.as_dict() for name, state in self._states.items()}

    def hold(self, timeout_s: float = 30.0) -> None:
        """No restart or probe after this returns (a restart under way finishes first)."""
        self._held.set()
        if self._thread.is_alive():
            self._idle.wait(timeout_s)

    def close(self) -> None:
        self._held.set()
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for channel in self._channels.values():
            channel.close()
        if self._redis is not None:
            self._redis.close()

    # -- the loop ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed.is_set():
            if self._held.is_set():
                self._idle.set()
                self._closed.wait(0.1)
                continue
            try:
                self._step(time.monotonic())
            except Exception:  # supervision must outlive any one service's oddity
                log.exception("supervisor step failed")
            self._closed.wait(0.1)

    def _step(self, now: float) -> None:
        with self._mesh.lock:
            processes = dict(self._mesh.processes)
        with self._lock:
            for name in list(self._states):
                if name not in processes:  # stopped on purpose (Mesh.stop_service)
                    del self._states[name]
            for name in processes:
                self._states.setdefault(
                    name,
                    ServiceState(pid=processes[name].popen.pid, started_at=now, state="starting", next_probe_at=now),
                )
        for name, process in processes.items():
            if self._held.is_set():
                return
            self._watch(name, process, self._states[name], now)

    def _watch(self, name: str, process, state: ServiceState, now: float) -> None:
        policy = self._policy
        if state.state in ("running", "starting") and not process.alive():
            stable = state.ready_since is not None and now - state.ready_since >= policy.stable_s
            with self._lock:
                state.in_a_row = 1 if stable else state.in_a_row + 1
                state.last_exit = exit_reason(process.popen.returncode)
                state.state, state.ready, state.ready_since = "backoff", False, None
                state.next_start_at = now + policy.delay_s(state.in_a_row)
            self._on_event(
                f"{name} (pid {state.pid}) {state.last_exit}; restarting in {policy.delay_s(state.in_a_row):.1f}s"
            )
            return
        if state.state == "backoff":
            if now >= state.next_start_at and self._respawn(name, process):
                with self._lock:
                    state.state, state.pid, state.started_at = "starting", process.popen.pid, now
                    state.restarts += 1
                    state.unanswered, state.next_probe_at = 0, now
            return
        if state.state == "starting":
            if process.poll_ready():
                with self._lock:
                    state.state, state.ready, state.ready_since = "running", True, now
                self._on_event(
                    f"{name} is back (pid {state.pid}, restart {state.restarts}, "
                    f"{now - state.started_at:.1f}s to start)"
                )
            elif now - state.started_at > policy.start_timeout_s:
                self._on_event(f"{name} (pid {state.pid}) not ready within {policy.start_timeout_s:.0f}s; killing it")
                process.popen.kill()
            return
        if now >= state.next_probe_at:
            state.next_probe_at = now + policy.probe_period_s
            answered, serving = self._probe(name, process)
            with self._lock:
                if answered:
                    state.unanswered = 0
                    if serving and not state.ready:
                        state.ready_since = now
                    state.ready = serving
                    if not serving:
                        state.ready_since = None
                else:
                    state.unanswered += 1
                    state.ready, state.ready_since = False, None
            if state.unanswered >= policy.failure_threshold:
                self._on_event(
                    f"{name} (pid {state.pid}) did not answer {state.unanswered} liveness checks in a row; killing it"
                )
                process.popen.kill()
                process.popen.wait()

    def _respawn(self, name: str, process) -> bool:
        with self._mesh.lock:
            if self._mesh.processes.get(name) is not process:
                return False  # stopped on purpose meanwhile
            try:
                process.respawn()
            except OSError as exc:
                self._on_event(f"{name} could not be started: {exc}")
                return False
        channel = self._channels.pop(name, None)
        if channel is not None:
            channel.close()
        return True

    def _probe(self, name: str, process) -> tuple[bool, bool]:
        """(answered, serving): a health check of one of our services, a PING of Redis."""
        timeout_s = self._policy.probe_timeout_s
        if name == "redis":
            if self._redis is None:  # one client: it reconnects by itself after a restart
                self._redis = redis.Redis.from_url(
                    self._mesh.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
                )
            try:
                return True, bool(self._redis.ping())
            except (redis.RedisError, OSError):
                return False, False
        channel = self._channels.get(name)
        if channel is None:
            channel = self._channels[name] = self._mesh.probe_channel(process.info["grpc"])
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False, False
        return True, response.status == health_pb2.HealthCheckResponse.SERVING
