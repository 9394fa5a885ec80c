"""A Triton model repository as a launcher package: the models the package names (which the
control plane and the gateway route) are the models paved.kserve serves from it.

paved.kserve serves a model folder without a config when a version folder holds a model file
its config is completed from (model.onnx, model.py: Triton's auto-complete), and skips hidden
folders. The package listed only folders with a config: such a model was served but never
routed, and could not be the package's model_id.
"""

from __future__ import annotations

import os

from paved.kserve import model_config
from paved.kserve.repository import ModelRepository
from paved.launcher import package as package_module
from paved.launcher.build import build_package
from paved.launcher.package import ModelPackage


def _write(path, text: str = "x\n") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_the_packages_models_are_the_ones_the_kserve_server_serves(tmp_path):
    source = tmp_path / "repository"
    _write(source / "with_config" / "config.pbtxt", 'backend: "python"\n')
    _write(source / "with_config" / "1" / "model.py")
    _write(source / "onnx_only" / "2" / "model.onnx")
    _write(source / "python_only" / "1" / "model.py")
    _write(source / "onnx_in_01" / "01" / "model.onnx")  # not a version folder: nothing to serve
    _write(source / "notes" / "README.md")

    served = ModelRepository()
    served.load_repository_dir(str(source))
    # The models with something to serve (a config, or a model file to complete one from).
    servable = sorted(n for n, v in served.classic.items() if "" not in v)
    assert servable == ["onnx_only", "python_only", "with_config"]

    package = build_package(str(source), str(tmp_path / "package"), "onnx_only", "1", mode="kserve")
    assert package.kserve_layout() == "repository"
    assert package.kserve_models() == servable


def test_hidden_model_folders_are_not_the_packages_models():
    files = [
        {"path": p, "sha256": "0" * 64, "size": 1}
        for p in ("scorer/config.pbtxt", ".old/config.pbtxt", ".old/1/model.py")
    ]
    weights = {"uri": "weights", "files": files}
    package = ModelPackage.model_validate(
        {"model_id": "scorer", "version": "1", "mode": "kserve", "weights": weights}
    )
    assert package.kserve_models() == ["scorer"]


def test_the_auto_complete_files_are_the_kserve_servers():
    assert set(package_module.KSERVE_AUTO_COMPLETE_FILES) == set(model_config.AUTO_COMPLETE_FILES)
