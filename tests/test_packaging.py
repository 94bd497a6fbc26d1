"""The project as installed by make setup (pyproject.toml, pip install -e .): its console
scripts, and the services and stubs importable from outside the repository."""

import importlib.metadata
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.unit
def test_every_console_script_is_installed_and_names_a_main():
    installed = {e.name: e for e in importlib.metadata.entry_points(group="console_scripts")}
    assert {
        "meshctl",
        "infermesh-launcher",
        "infermesh-router",
        "infermesh-batcher",
        "infermesh-model-server",
        "infermesh-cache",
    } <= set(SCRIPTS)
    for name, target in SCRIPTS.items():
        assert name in installed, f"{name} is not installed: run make setup"
        assert installed[name].value == target
        assert callable(installed[name].load()), target


@pytest.mark.unit
def test_the_environment_puts_no_path_file_of_ours_on_the_import_path():
    """The install, not a .pth file naming this checkout, makes the packages importable."""
    import sysconfig

    assert not (pathlib.Path(sysconfig.get_paths()["purelib"]) / "infermesh.pth").exists()


@pytest.mark.service
def test_services_and_stubs_import_from_any_folder(tmp_path):
    code = (
        "import inference.grpc_predict_v2_pb2, infermesh.batcher.v1.batcher_pb2, services.router.__main__; "
        "print(services.router.__main__.__file__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert pathlib.Path(done.stdout.strip()).is_relative_to(ROOT)  # editable: this checkout's code


@pytest.mark.service
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_console_script_answers_help(script, tmp_path):
    executable = pathlib.Path(sys.executable).parent / script
    done = subprocess.run([executable, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
