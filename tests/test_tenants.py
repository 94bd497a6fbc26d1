"""Tiers from identity, not from claims: the registry, the router's
authenticator and rate limiter in-process, then the mesh attacked as a
caller would (spoofed tiers, unknown keys, a tenant over its rate)."""

import asyncio
import uuid

import grpc
import pytest
from inference import grpc_predict_v2_pb2 as pb
from inference import grpc_predict_v2_pb2_grpc as pb_grpc

from services.common import errors, identity
from services.meshctl import tenants as meshctl_tenants
from services.router.tenants import XFCC_HEADER, Authenticator, RateLimiter, Settings
from tests.oip import text_request

KEY = "imk_test-key-of-acme"


def registry(**overrides) -> identity.Registry:
    doc = {
        "anonymous": "standard",
        "tenants": {
            "acme": {
                "tier": "vip",
                "keys": [identity.hash_key(KEY)],
                "certificates": ["acme-client"],
                "principals": ["spiffe://cluster.local/ns/acme/sa/app"],
            },
            "shop": {"tier": "standard", "keys": [identity.hash_key("imk_shop")], "rate_per_s": 10, "burst": 5},
            "ops": {"admin": True, "keys": [identity.hash_key("imk_ops")]},
        },
    } | overrides
    return identity.Registry.from_document(doc, "test")


@pytest.mark.unit
def test_a_key_names_its_tenant_and_a_tier_beyond_it_is_refused_by_name():
    found = registry().authenticate(identity.Credentials(bearer=KEY))
    assert found.name == "acme" and found.tier_for(None) == 1 and found.tier_for(0) == 0
    shop = registry().authenticate(identity.Credentials(bearer="imk_shop"))
    refusal = r"tenant 'shop' may not use tier 'vip': it may use \['standard'\]"
    with pytest.raises(errors.PermissionDenied, match=refusal):
        shop.tier_for(1)


@pytest.mark.unit
@pytest.mark.parametrize(
    "credentials, complaint",
    [
        (identity.Credentials(bearer="imk_guess"), "the bearer key is not known"),
        (identity.Credentials(bearer="x" * 5000), "5000 characters long"),
        (
            identity.Credentials(certificate=("mallory",)),
            r"client certificate \(identities 'mallory'\) names no tenant",
        ),
    ],
)
def test_a_credential_that_is_not_known_is_refused_never_anonymous(credentials, complaint):
    with pytest.raises(errors.Unauthenticated, match=complaint):
        registry().authenticate(credentials)


@pytest.mark.unit
def test_anonymous_callers_are_standard_or_refused():
    assert registry().authenticate(identity.Credentials()).tier == 0
    with pytest.raises(errors.Unauthenticated, match="needs credentials"):
        registry(anonymous="refuse").authenticate(identity.Credentials())


@pytest.mark.unit
@pytest.mark.parametrize(
    "doc, complaint",
    [
        ({"tenants": {"a": {"keys": ["plain-text-key"]}}}, "keys are stored hashed"),
        ({"tenants": {"a": {"tier": "gold"}}}, "field 'tier' is 'gold'"),
        ({"tenants": {"a": {"weight": float("nan")}}}, "field 'weight' must be a finite number in"),
        ({"tenants": {"a": {"rate_per_s": -1}}}, "field 'rate_per_s' must be a finite number >= 0"),
        ({"tenants": {"a": {"owner": "x"}}}, r"unknown field\(s\) \['owner'\]"),
        (
            {"tenants": {"a": {"keys": [identity.hash_key("k")]}, "b": {"keys": [identity.hash_key("k")]}}},
            "is also tenant 'a''s",
        ),
        ({"anonymous": {"tier": "vip", "admin": True}}, "anonymous callers have no credentials and no admin rights"),
    ],
)
def test_a_registry_that_cannot_be_used_is_refused_naming_the_field(doc, complaint):
    with pytest.raises(identity.RegistryError, match=complaint):
        identity.Registry.from_document(doc, "test")


@pytest.mark.unit
def test_admin_needs_an_admin_tenant():
    reg = registry()
    assert reg.admin(identity.Credentials(bearer="imk_ops"), "load models").name == "ops"
    with pytest.raises(errors.PermissionDenied, match="tenant 'acme' may not load models"):
        reg.admin(identity.Credentials(bearer=KEY), "load models")
    with pytest.raises(errors.Unauthenticated, match="load models needs an admin credential"):
        reg.admin(identity.Credentials(), "load models")


@pytest.mark.unit
def test_sidecar_headers_count_only_behind_a_configured_sidecar():
    xfcc = {XFCC_HEADER: "By=spiffe://cluster.local/ns/x/sa/router;URI=spiffe://cluster.local/ns/acme/sa/app"}
    spoofed = {**xfcc, "x-infermesh-jwt-tenant": "acme"}
    direct = Authenticator(Settings(registry()))
    assert direct.caller(spoofed).name == identity.ANONYMOUS  # a client's own copies are ignored
    behind = Authenticator(Settings(registry(), trust_sidecar_identity=True))
    assert behind.caller(xfcc).name == "acme"
    assert behind.caller({"x-infermesh-jwt-tenant": "shop"}).name == "shop"
    with pytest.raises(errors.Unauthenticated, match="token's tenant 'nobody' is not in the registry"):
        behind.caller({"x-infermesh-jwt-tenant": "nobody"})
    twice = (("x-infermesh-jwt-tenant", "shop"), ("x-infermesh-jwt-tenant", "acme"))  # a client's copy beside it
    with pytest.raises(errors.Unauthenticated, match="'x-infermesh-jwt-tenant' appears 2 times"):
        behind.caller(dict(twice), raw=twice)


@pytest.mark.unit
def test_the_old_mode_believes_claims_only_when_asked_and_labels_stay_bounded():
    legacy = Authenticator(Settings(None, trust_tier_header=True))
    assert legacy.caller({}).tier_for(1) == 1 and legacy.caller({}).tier_for(None) == 0
    plain = Authenticator(Settings(None))
    with pytest.raises(errors.PermissionDenied, match="tenant 'anonymous' may not use tier 'vip'"):
        plain.tier(plain.caller({}), 1)
    with pytest.raises(errors.Unauthenticated, match="no tenant registry"):
        plain.caller({"authorization": "Bearer imk_x"})
    with pytest.raises(errors.Unauthenticated, match="must be 'Bearer <key>'"):
        plain.caller({"authorization": "Basic dXNlcg=="})
    many = identity.Registry.from_document({"tenants": {f"t{i:03}": {} for i in range(200)}}, "test")
    labelled = Authenticator(Settings(many))
    assert len({labelled.label(f"t{i:03}") for i in range(200)}) == 51  # 50 names and "other"


@pytest.mark.unit
def test_a_tenant_over_its_rate_is_refused_with_the_time_until_it_may_send():
    now = [100.0]
    limiter = RateLimiter(clock=lambda: now[0])
    shop = registry().tenants["shop"]  # 10 rows a second, a burst of 5
    for _ in range(5):
        limiter.take(shop, 1)
    with pytest.raises(errors.ResourceExhausted, match="tenant 'shop' is over its rate of 10 rows a second") as over:
        limiter.take(shop, 1)
    assert over.value.retry_after_ms == 100
    now[0] += 0.1
    limiter.take(shop, 1)  # refilled by one row
    limiter.take(registry().tenants["acme"], 10_000)  # no rate: not limited


@pytest.mark.unit
def test_meshctl_makes_keys_the_registry_accepts(tmp_path, capsys):
    path = tmp_path / "tenants.yaml"
    assert meshctl_tenants.parse_and_run(["--registry", str(path), "init"]) == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    printed = capsys.readouterr().out
    keys = dict(line.split()[0 :: len(line.split()) - 1] for line in printed.splitlines()[1:])
    reg = identity.Registry.load(path)
    assert reg.authenticate(identity.Credentials(bearer=keys["dev-vip"])).tier == 1
    assert path.read_text().count("imk_") == 0  # only hashes are stored
    meshctl_tenants.parse_and_run(["--registry", str(path), "add", "acme", "--tier", "vip", "--rate-per-s", "5"])
    key = capsys.readouterr().out.split("Bearer ")[1].strip()
    assert identity.Registry.load(path).authenticate(identity.Credentials(bearer=key)).rate_per_s == 5
    with pytest.raises(meshctl_tenants.TenantsError, match="exists"):
        meshctl_tenants.parse_and_run(["--registry", str(path), "init"])


async def _infer(stub, metadata=(), priority=None):
    request = text_request([f"tenant test {uuid.uuid4().hex}"])
    if priority is not None:
        request.parameters["priority"].int64_param = priority
    return await stub.ModelInfer(request, timeout=30, metadata=metadata)


@pytest.mark.e2e
async def test_a_vip_claim_without_a_vip_identity_is_refused(mesh):
    async with grpc.aio.insecure_channel(mesh.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for claim in (
            {"metadata": (("x-user-tier", "vip"),)},
            {"priority": 1},
            {"metadata": (("x-user-tier", "vip"), *mesh.credentials("dev-standard"))},
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _infer(stub, **claim)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "may not use tier 'vip': it may use ['standard']" in refused.value.details()
        await _infer(stub, mesh.credentials("dev-vip"), priority=1)  # the VIP tenant may
        await _infer(stub, mesh.credentials("dev-vip"), priority=2)  # and may ask for less
        await _infer(stub)  # anonymous: standard
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await _infer(stub, (("authorization", "Bearer imk_guessed"),))
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "the bearer key is not known" in unknown.value.details()

        async def requests():
            yield pb.ModelInferRequest(model_name="minilm")

        with pytest.raises(grpc.aio.AioRpcError) as stream:
            async for _ in stub.ModelStreamInfer(
                requests(), timeout=30, metadata=(("authorization", "Bearer imk_guessed"),)
            ):
                pass
        assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.e2e
async def test_a_rate_limited_tenant_is_refused_with_a_hint_and_the_registry_reloads(
    model_repository, tmp_path, capsys
):
    from services.launcher.mesh import Mesh, MeshConfig

    path = tmp_path / "tenants.yaml"
    identity.write_registry(
        path, {"tenants": {"slow": {"keys": [identity.hash_key("imk_slow")], "rate_per_s": 1, "burst": 2}}}
    )
    with Mesh(MeshConfig(models=model_repository, cache=False, log_dir=tmp_path / "logs", tenants_file=path)) as mesh:
        async with grpc.aio.insecure_channel(mesh.router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            slow = identity.bearer_metadata("imk_slow")
            outcomes = await asyncio.gather(*(_infer(stub, slow) for _ in range(6)), return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert 4 <= len(refused) <= 5 and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
            assert "tenant 'slow' is over its rate of 1 rows a second" in refused[0].details()
            assert errors.retry_after_ms(refused[0].trailing_metadata()) > 0
            await _infer(stub)  # others are not held back

            capsys.readouterr()
            meshctl_tenants.parse_and_run(["--registry", str(path), "add", "late", "--tier", "vip"])
            late = identity.bearer_metadata(capsys.readouterr().out.split("Bearer ")[1].strip())
            for _ in range(100):  # the router reads the changed file within its poll (2 s)
                try:
                    await _infer(stub, late, priority=1)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                    await asyncio.sleep(0.2)
            else:
                pytest.fail("the router never took the new tenant")
