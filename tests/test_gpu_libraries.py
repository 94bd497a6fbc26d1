"""The CUDA path's packaging, checked where no GPU is: ONNX Runtime's CUDA
provider must find every library it links against in the wheels that setup
installs, all but the driver (libcuda.so.1, which comes with a GPU). A missing
one would not fail loudly on a GPU machine: ORT would log it and every session
would quietly run on the CPU."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.service

PROBE = """
import ctypes, pathlib, onnxruntime as ort
{preload}
provider = pathlib.Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
try:
    ctypes.CDLL(str(provider))
except OSError as exc:
    print(exc)
else:
    print("loaded")
# What the provider opens later rather than links: cuDNN, cuFFT, NVRTC.
maps = pathlib.Path("/proc/self/maps").read_text()
print(" ".join(sorted({{name for name in ("libcudnn.so.9", "libcufft.so", "libnvrtc.so") if name in maps}})))
"""


def probe(preload: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(preload=preload)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


def test_the_cuda_provider_finds_all_its_libraries_but_the_driver():
    found, opened = probe("from services.model_server.execution import load_cuda_libraries; load_cuda_libraries()")
    # On a GPU machine the driver is there too and the provider loads.
    assert found == "loaded" or found.startswith("libcuda.so.1:"), found
    assert opened == "libcudnn.so.9 libcufft.so libnvrtc.so"
