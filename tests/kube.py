"""A real Kubernetes API server for the tests: etcd and kube-apiserver, built
from source by `make setup` (tools/kube), on loopback ports, with Istio's CRDs
and the Prometheus Operator's PrometheusRule CRD installed. No scheduler or
kubelet: nothing runs, but every object is validated, defaulted and stored
exactly as a cluster would."""

import contextlib
import pathlib
import subprocess
import tempfile
import time

import yaml

from services.launcher.ports import free_ports

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = ROOT / "bin"
CRD_FILES = (
    ROOT / "build" / "istio" / "customresourcedefinitions.gen.yaml",
    ROOT / "build" / "monitoring" / "monitoring.coreos.com_prometheusrules.yaml",
)
TOKEN = "infermesh-test-admin"


class KubeAPI:
    """`with KubeAPI() as api:` gives api.kubeconfig (a file) and api.client()."""

    def __enter__(self):
        for binary in ("etcd", "kube-apiserver"):
            if not (BIN / binary).exists():
                raise RuntimeError(f"{BIN / binary} is missing: run `make setup`")
        self._stack = contextlib.ExitStack()
        try:
            self._begin()
        except BaseException:  # a server that started must not outlive a failed start
            self._stack.close()
            raise
        return self

    def _begin(self) -> None:
        self.dir = pathlib.Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="kube-")))
        client_port, peer_port, self.port = free_ports(3)
        etcd_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        self._start(
            "etcd",
            [
                str(BIN / "etcd"),
                "--data-dir",
                str(self.dir / "etcd"),
                "--listen-client-urls",
                etcd_url,
                "--advertise-client-urls",
                etcd_url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"default={peer_url}",
                "--log-level",
                "warn",
            ],
        )
        key = self.dir / "service-accounts.key"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        (self.dir / "tokens.csv").write_text(f'{TOKEN},admin,admin,"system:masters"\n')
        self._start(
            "kube-apiserver",
            [
                str(BIN / "kube-apiserver"),
                "--etcd-servers",
                etcd_url,
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(self.port),
                "--cert-dir",
                str(self.dir / "certs"),
                "--service-account-issuer",
                "https://kubernetes.default.svc",
                "--service-account-key-file",
                str(key),
                "--service-account-signing-key-file",
                str(key),
                "--token-auth-file",
                str(self.dir / "tokens.csv"),
                "--authorization-mode",
                "RBAC",
                "--service-cluster-ip-range",
                "10.96.0.0/16",
            ],
        )
        self.kubeconfig = self.dir / "kubeconfig"
        self._wait_ready()
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "test",
                    "clusters": [
                        {
                            "name": "test",
                            "cluster": {
                                "server": f"https://127.0.0.1:{self.port}",
                                "certificate-authority": str(self.dir / "certs" / "apiserver.crt"),
                            },
                        }
                    ],
                    "users": [{"name": "admin", "user": {"token": TOKEN}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
                }
            )
        )
        self.install_crds()

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the stack, after the process
        self._stack.callback(log.close)
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)

        def stop():
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

        self._stack.callback(stop)
        setattr(self, f"_{name.replace('-', '_')}", process)

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        import ssl
        import urllib.request

        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the server makes its cert as it starts
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.port}/readyz", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name in ("etcd", "kube_apiserver"):
                if getattr(self, f"_{name}").poll() is not None:
                    raise RuntimeError(
                        f"{name} exited: "
                        + (self.dir / f"{name.replace('_', '-')}.log").read_text(errors="replace")[-2000:]
                    )
            try:
                with urllib.request.urlopen(request, context=context, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(
            "kube-apiserver was not ready in time: "
            + (self.dir / "kube-apiserver.log").read_text(errors="replace")[-2000:]
        )

    def client(self):
        from kubernetes import config, dynamic

        return dynamic.DynamicClient(config.new_client_from_config(config_file=str(self.kubeconfig)))

    def install_crds(self, timeout_s: float = 60.0) -> None:
        api = self.client()
        definitions = api.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
        crds = [
            d
            for path in CRD_FILES
            for d in yaml.safe_load_all(path.read_text())
            if d and d.get("kind") == "CustomResourceDefinition"
        ]
        for crd in crds:
            definitions.create(body=crd)
        deadline = time.monotonic() + timeout_s
        for crd in crds:
            while not any(
                c["type"] == "Established" and c["status"] == "True"
                for c in (definitions.get(name=crd["metadata"]["name"]).status or {}).get("conditions") or []
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"CRD {crd['metadata']['name']} not established in time")
                time.sleep(0.1)

    def __exit__(self, *exc):
        self._stack.close()
