"""Load through the real ghz, which finds our API by server reflection alone."""

import json
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def transport(mesh) -> list[str]:
    """ghz's flags for the mesh: plaintext, or mutual TLS with the mesh's client certificate."""
    files = mesh.client_files()
    if files is None:
        return ["--insecure"]
    ca, cert, key = files
    return ["--cacert", ca, "--cert", cert, "--key", key]


def test_ghz_thousand_requests_without_errors(mesh, ghz_binary):
    run = subprocess.run(
        [
            str(ghz_binary),
            *transport(mesh),
            "--call",
            "inference.GRPCInferenceService.ModelInfer",
            "--data-file",
            str(ROOT / "bench" / "ghz" / "minilm-data.json"),
            "--total",
            "1000",
            "--concurrency",
            "16",
            "--format",
            "json",
            mesh.router,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(run.stdout)
    assert report["count"] == 1000
    assert report["statusCodeDistribution"] == {"OK": 1000}, report["statusCodeDistribution"]
    assert not report.get("errorDistribution")


def test_ghz_streams_through_model_stream_infer(mesh, ghz_binary):
    run = subprocess.run(
        [
            str(ghz_binary),
            *transport(mesh),
            "--call",
            "inference.GRPCInferenceService.ModelStreamInfer",
            "--data-file",
            str(ROOT / "bench" / "ghz" / "minilm-data.json"),
            "--total",
            "50",
            "--concurrency",
            "5",
            "--format",
            "json",
            mesh.router,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(run.stdout)
    assert report["statusCodeDistribution"] == {"OK": 50}, report
