"""Mutual TLS: the whole mesh on it, callers with and without certificates,
and the identities a server reads from a verified client certificate."""

import json
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.common import tls
from services.router.config import RouterConfig
from tests.oip import output_array, text_request
from tools import certs

INTERNAL = ("batcher", "cache", "model_server")


@pytest.fixture(scope="module")
def cert_dirs(tmp_path_factory):
    """Two development CAs with their certificates: the mesh's and a stranger's."""
    ours, other = tmp_path_factory.mktemp("certs"), tmp_path_factory.mktemp("other-certs")
    certs.make_all(ours)
    certs.make_all(other)
    return ours, other


def credentials(folder, client: str | None = "tenant-vip-dev"):
    """A caller's credentials: the folder's CA verifies the server; `client`'s certificate, if any, is presented."""
    if client is None:
        return tls.channel_credentials(str(folder / "ca.pem"))
    return tls.channel_credentials(str(folder / "ca.pem"), str(folder / f"{client}.pem"), str(folder / f"{client}.key"))


# ---------------------------------------------------------------- one server in-process


class _Config:
    """The TLS fields of a service's config."""

    def __init__(self, folder, name="router", require_client_cert=True):
        self.tls_cert_file, self.tls_key_file = str(folder / f"{name}.pem"), str(folder / f"{name}.key")
        self.tls_ca_file = str(folder / "ca.pem")
        self.tls_require_client_cert = require_client_cert


async def _identity_server(server_credentials):
    """A real grpc.aio server whose one method answers the caller's peer_identities as JSON."""

    async def whoami(request: bytes, context) -> bytes:
        return json.dumps(tls.peer_identities(context)).encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Identity", {"WhoAmI": grpc.unary_unary_rpc_method_handler(whoami)}
            ),
        )
    )
    port = tls.bind(server, "127.0.0.1:0", server_credentials)
    await server.start()
    return server, port


async def _whoami(port: int, channel_credentials) -> list[str]:
    async with tls.aio_channel(f"127.0.0.1:{port}", channel_credentials) as channel:
        answer = await channel.unary_unary("/test.Identity/WhoAmI")(b"", timeout=10)
    return json.loads(answer)


@pytest.mark.service
async def test_peer_identities_are_the_verified_certificates_cn_and_sans(cert_dirs):
    ours, _ = cert_dirs
    certs.sign(
        ours,
        "svc-client",
        dns=["client.example"],
        ips=["127.0.0.1"],
        uris=["spiffe://cluster.local/ns/infermesh/sa/app"],
    )
    server, port = await _identity_server(tls.server_credentials(_Config(ours)))
    try:
        assert await _whoami(port, credentials(ours, "tenant-standard-dev")) == ["tenant-standard-dev"]
        common_name, *alternative = await _whoami(port, credentials(ours, "svc-client"))
        assert common_name == "svc-client"
        assert sorted(alternative) == ["127.0.0.1", "client.example", "spiffe://cluster.local/ns/infermesh/sa/app"]
    finally:
        await server.stop(None)


@pytest.mark.service
async def test_peer_identities_are_none_without_a_verified_certificate(cert_dirs):
    """A server that does not ask for certificates sees none, even from a caller
    that has one; a plaintext caller has none to see."""
    ours, _ = cert_dirs
    server, port = await _identity_server(tls.server_credentials(_Config(ours, require_client_cert=False)))
    plain, plain_port = await _identity_server(None)
    try:
        assert await _whoami(port, credentials(ours, "tenant-vip-dev")) == []
        assert await _whoami(plain_port, None) == []
    finally:
        await server.stop(None)
        await plain.stop(None)


@pytest.mark.service  # the certificates are openssl's
def test_config_checks_name_the_tls_fields(cert_dirs):
    ours, _ = cert_dirs
    with pytest.raises(ValueError, match="tls_key_file"):
        RouterConfig(tls_cert_file=str(ours / "router.pem"))
    with pytest.raises(ValueError, match="tls_require_client_cert needs"):
        RouterConfig(
            tls_cert_file=str(ours / "router.pem"), tls_key_file=str(ours / "router.key"), tls_require_client_cert=True
        )
    with pytest.raises(ValueError, match="upstream_tls needs tls_ca_file"):
        RouterConfig(upstream_tls=True)
    with pytest.raises(ValueError, match=r"tls_ca_file '.*missing.pem' is not a readable file"):
        RouterConfig(tls_ca_file=str(ours / "missing.pem"))
    complete = RouterConfig(
        tls_cert_file=str(ours / "router.pem"),
        tls_key_file=str(ours / "router.key"),
        tls_ca_file=str(ours / "ca.pem"),
        tls_require_client_cert=True,
        upstream_tls=True,
    )
    assert complete.upstream_tls and complete.tls_require_client_cert


# ---------------------------------------------------------------- the whole mesh


@pytest.fixture(scope="module")
def tls_mesh(model_repository, cert_dirs, tmp_path_factory):
    """A whole mesh on mutual TLS: every service asks every caller for a certificate of our CA."""
    from services.launcher.mesh import Mesh, MeshConfig

    ours, _ = cert_dirs
    with Mesh(
        MeshConfig(
            models=model_repository,
            log_dir=tmp_path_factory.mktemp("tls-mesh-logs"),
            tls_dir=ours,
            router_args=("--near-cache-ttl-s", "0"),
        )
    ) as running:
        yield running
        assert not running.dead(), f"services died during the tests: {running.dead()}"


@pytest.mark.e2e
async def test_generated_stubs_infer_over_mutual_tls(tls_mesh, cert_dirs, reference_embeddings):
    ours, _ = cert_dirs
    texts = ["mutual TLS end to end", "every hop verified"]
    async with tls.aio_channel(tls_mesh.router, credentials(ours)) as channel:
        response = await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request(texts), timeout=60)
    embeddings = output_array(response, "EMBEDDING")
    assert embeddings.shape == (2, 384)
    assert np.allclose(embeddings, reference_embeddings(texts), atol=1e-4)


@pytest.mark.e2e
def test_tritonclient_infers_over_mutual_tls(tls_mesh, cert_dirs, tmp_path):
    ours, _ = cert_dirs
    texts_path = tmp_path / "texts.json"
    texts_path.write_text(json.dumps(["tritonclient over mutual TLS", "short"]))
    out = tmp_path / "out.npz"
    subprocess.run(
        [
            sys.executable,
            "tests/triton_client_run.py",
            tls_mesh.router,
            str(texts_path),
            str(out),
            str(ours / "ca.pem"),
            str(ours / "tenant-standard-dev.pem"),
            str(ours / "tenant-standard-dev.key"),
        ],
        check=True,
        timeout=300,
    )
    got = np.load(out)
    assert json.loads(str(got["facts"]))["live"]
    assert got["unary"].shape == (2, 384) and got["streamed"].shape == (2, 384)


def _health(address: str, channel_credentials) -> int:
    with tls.channel(address, channel_credentials) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


@pytest.mark.e2e
@pytest.mark.parametrize("service", ["router", *INTERNAL])
def test_every_service_answers_a_client_of_our_ca(tls_mesh, cert_dirs, service):
    ours, _ = cert_dirs
    assert _health(tls_mesh.address(service), credentials(ours, "admin-dev")) == health_pb2.HealthCheckResponse.SERVING


def _refusal(address: str, channel_credentials) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _health(address, channel_credentials)
    return refused.value


@pytest.mark.e2e
@pytest.mark.parametrize("service", ["router", *INTERNAL])
def test_a_client_without_a_certificate_is_refused_at_the_handshake(tls_mesh, cert_dirs, service):
    ours, _ = cert_dirs
    # The connection itself fails (the server's TLS alert closes it): no call is ever made.
    refused = _refusal(tls_mesh.address(service), credentials(ours, client=None))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed to connect" in refused.details(), refused.details()


@pytest.mark.e2e
@pytest.mark.parametrize("service", ["router", *INTERNAL])
def test_a_certificate_of_another_ca_is_refused(tls_mesh, cert_dirs, service):
    """The stranger trusts our servers (it has our CA) but presents its own CA's certificate."""
    ours, other = cert_dirs
    stranger = tls.channel_credentials(
        str(ours / "ca.pem"), str(other / "tenant-vip-dev.pem"), str(other / "tenant-vip-dev.key")
    )
    assert _refusal(tls_mesh.address(service), stranger).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.e2e
@pytest.mark.parametrize("service", ["router", *INTERNAL])
def test_a_plaintext_client_is_refused(tls_mesh, service):
    assert _refusal(tls_mesh.address(service), None).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.e2e
def test_a_client_refuses_a_server_of_another_ca(tls_mesh, cert_dirs):
    """Callers verify the server too: a client trusting only the stranger's CA does not talk to our router."""
    _ours, other = cert_dirs
    impostor_check = tls.channel_credentials(
        str(other / "ca.pem"), str(other / "admin-dev.pem"), str(other / "admin-dev.key")
    )
    assert _refusal(tls_mesh.router, impostor_check).code() == grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------- the launcher


@pytest.mark.unit
def test_the_router_binds_the_public_host_and_the_others_the_internal_one(tmp_path):
    from services.launcher.mesh import Mesh, MeshConfig

    (tmp_path / "ca.pem").write_text("")  # the folder's files are the services' to read
    mesh = Mesh(MeshConfig(host="0.0.0.0", internal_host="127.0.0.1", tls_dir=tmp_path))

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    router, batcher = mesh.argv("services.router", []), mesh.argv("services.batcher", [])
    cache, model_server = mesh.argv("services.cache", []), mesh.argv("services.model_server", [])
    assert flag(router, "--host") == "0.0.0.0"
    assert {flag(argv, "--host") for argv in (batcher, cache, model_server)} == {"127.0.0.1"}
    assert flag(model_server, "--tls-cert-file") == str(tmp_path / "model-server.pem")
    assert all("--tls-require-client-cert" in argv for argv in (router, batcher, cache, model_server))
    assert "--upstream-tls" in router and "--upstream-tls" in batcher and "--upstream-tls" not in cache
    plain = Mesh(MeshConfig(tls_dir=None)).argv("services.batcher", [])
    assert not any(arg.startswith("--tls") or arg == "--upstream-tls" for arg in plain)


@pytest.mark.e2e
def test_make_run_tls_serves_mutual_tls_and_the_admin_tool_follows(model_repository, cert_dirs, tmp_path):
    """python -m services.launcher --tls-dir, as `make run TLS=1` starts it: the run file
    says where the certificates are, and services.cache.admin presents the admin's."""
    ours, _ = cert_dirs
    run_file = tmp_path / "mesh.json"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "--models",
            str(model_repository),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--log-dir",
            str(tmp_path),
            "--run-file",
            str(run_file),
            "--l2-path",
            "",
            "--tls-dir",
            str(ours),
            "--tenants-file",
            str(tmp_path / "tenants.yaml"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "INFERMESH_CACHE_ADMIN_TOKEN": "t0ken"},
    )
    try:
        line = launcher.stdout.readline()
        while line.startswith(("wrote the tenant registry", "  dev-")):  # a new registry's keys, shown once
            line = launcher.stdout.readline()
        assert "(mutual TLS)" in line, line
        running = json.loads(run_file.read_text())
        assert running["tls_dir"] == str(ours)
        purge = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cache.admin",
                "purge",
                "minilm",
                "--run-file",
                str(run_file),
                "--token",
                "t0ken",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert purge.returncode == 0 and "purged model minilm" in purge.stdout, purge.stderr
        with tls.channel(running["router"], credentials(ours, "tenant-vip-dev")) as channel:
            response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request(["via make run"]), timeout=60)
        assert output_array(response, "EMBEDDING").shape == (1, 384)
        # The certificate names the tenant (the development registry maps these CNs): its tier is the tenant's.
        vip = text_request(["as a VIP tenant"])
        vip.parameters["priority"].int64_param = 1
        with tls.channel(running["router"], credentials(ours, "tenant-vip-dev")) as channel:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(vip, timeout=60)
        with (
            tls.channel(running["router"], credentials(ours, "tenant-standard-dev")) as channel,
            pytest.raises(grpc.RpcError) as denied,
        ):
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(vip, timeout=60)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "tenant 'dev-standard' may not use tier 'vip'" in denied.value.details()
        with pytest.raises(grpc.RpcError) as refused, grpc.insecure_channel(running["cache"]) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
        launcher.stdout.close()
