"""The package I/O fingerprint, on the tiny package (//services/launcher:tiny_package) and on
modified copies of it.

Covers: the same fingerprint from the tarball, its unpacked directory, a re-packed tarball and
both over (fake) S3, where the S3 tarball is streamed only up to model.json and
tokenizer_config.json (not the weights); a weights-only change leaving the fingerprint alone;
a tokenizer change, a chat template change (in tokenizer_config.json or as a
chat_template.jinja file), max_model_len, kind and declared KServe tensors each named by
fingerprint_diff; a missing chat template; unreadable and invalid packages as 400s.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

from paved.control_plane.errors import ControlError
from paved.control_plane.fingerprint import FIELDS, fingerprint_diff, fingerprint_package
from paved.launcher.storage import Downloader
from paved.runfiles import runfile


def tiny_tarball() -> str:
    try:
        return runfile("services/launcher/tiny_package.tar")
    except FileNotFoundError:
        pytest.skip("build //services/launcher:tiny_package first (or run under Bazel)")


@pytest.fixture
def package_dir(tmp_path: Path) -> Path:
    out = tmp_path / "pkg"
    with tarfile.open(tiny_tarball()) as tar:
        tar.extractall(out, filter="data")
    return out


def manifest(pkg: Path) -> dict[str, Any]:
    return json.loads((pkg / "model.json").read_text())


def write_manifest(pkg: Path, m: dict[str, Any]) -> None:
    (pkg / "model.json").write_text(json.dumps(m, indent=2, sort_keys=True))


def replace_file(pkg: Path, role: str, name: str, data: bytes) -> None:
    """Rewrite (or add) a file of the package and its manifest entry, as a rebuild would."""
    (pkg / role / name).write_bytes(data)
    m = manifest(pkg)
    files = [f for f in m[role]["files"] if f["path"] != name]
    files.append({"path": name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    m[role]["files"] = sorted(files, key=lambda f: f["path"])
    write_manifest(pkg, m)


def copy(pkg: Path, tmp_path: Path, name: str) -> Path:
    dest = tmp_path / name
    shutil.copytree(pkg, dest)
    return dest


def pack(pkg: Path, out: Path) -> str:
    """A tarball laid out like paved's builder: model.json first, then the files sorted."""
    with tarfile.open(out, "w") as tar:
        tar.add(pkg / "model.json", arcname="model.json")
        for path in sorted(p for p in pkg.rglob("*") if p.is_file() and p.name != "model.json"):
            tar.add(path, arcname=path.relative_to(pkg).as_posix())
    return str(out)


def test_tiny_package_fingerprint(package_dir):
    fp = fingerprint_package(tiny_tarball())
    assert set(fp) == {*FIELDS, "resources"}
    assert fp["resources"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "gpus": 1}
    assert fp["kind"] == "generate"
    assert fp["max_model_len"] == 512  # the genrule's engine args
    assert fp["kserve"] is None
    assert len(fp["tokenizer_sha256"]) == 64
    # The tiny tokenizer declares a chat template in tokenizer_config.json: hashed by content.
    template = json.loads((package_dir / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"]
    expected = hashlib.sha256(
        json.dumps(template, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert fp["chat_template_sha256"] == expected
    assert fingerprint_package(str(package_dir)) == fp
    assert fingerprint_package("file://" + str(package_dir)) == fp


def test_weights_only_change_keeps_the_fingerprint(package_dir, tmp_path):
    base = fingerprint_package(str(package_dir))
    retrained = copy(package_dir, tmp_path, "retrained")
    blob = (retrained / "weights" / "model.safetensors").read_bytes()
    replace_file(retrained, "weights", "model.safetensors", blob[:-1] + bytes([blob[-1] ^ 1]))
    m = manifest(retrained)
    m["version"] = "2"
    write_manifest(retrained, m)
    assert fingerprint_diff(base, fingerprint_package(str(retrained))) == []


def test_each_io_change_is_named(package_dir, tmp_path):
    base = fingerprint_package(str(package_dir))

    tok = copy(package_dir, tmp_path, "tok")
    raw = json.loads((tok / "tokenizer" / "tokenizer.json").read_text())
    raw["added_tokens"] = [*raw.get("added_tokens", []), {"id": 99999, "content": "<new>", "special": True}]
    replace_file(tok, "tokenizer", "tokenizer.json", json.dumps(raw).encode())
    assert fingerprint_diff(base, fingerprint_package(str(tok))) == ["tokenizer_sha256"]

    chat = copy(package_dir, tmp_path, "chat")
    config = json.loads((chat / "tokenizer" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    replace_file(chat, "tokenizer", "tokenizer_config.json", json.dumps(config).encode())
    # tokenizer_config.json is a tokenizer file too, so both fields move.
    assert fingerprint_diff(base, fingerprint_package(str(chat))) == [
        "tokenizer_sha256",
        "chat_template_sha256",
    ]

    none = copy(package_dir, tmp_path, "none")
    config.pop("chat_template")
    replace_file(none, "tokenizer", "tokenizer_config.json", json.dumps(config).encode())
    assert fingerprint_package(str(none))["chat_template_sha256"] is None

    jinja = copy(none, tmp_path, "jinja")
    replace_file(jinja, "tokenizer", "chat_template.jinja", b"{{ messages }}")
    fp_jinja = fingerprint_package(str(jinja))
    assert (
        fp_jinja["chat_template_sha256"]
        == hashlib.sha256(
            json.dumps(
                [["chat_template.jinja", hashlib.sha256(b"{{ messages }}").hexdigest()]],
                separators=(",", ":"),
            ).encode()
        ).hexdigest()
    )

    for key, value, field in (
        ("max_model_len", 1024, "max_model_len"),
        ("kind", "embed", "kind"),
        ("kserve", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]}, "kserve"),
    ):
        changed = copy(package_dir, tmp_path, f"ea-{key}")
        m = manifest(changed)
        m["engine_args"][key] = value
        write_manifest(changed, m)
        fp = fingerprint_package(str(changed))
        assert fingerprint_diff(base, fp) == [field]
        assert fp[field] == value


def test_repacked_tarball_matches_its_directory(package_dir, tmp_path):
    chat = copy(package_dir, tmp_path, "chat")
    config = json.loads((chat / "tokenizer" / "tokenizer_config.json").read_text())
    config["chat_template"] = "changed"
    replace_file(chat, "tokenizer", "tokenizer_config.json", json.dumps(config).encode())
    tarball = pack(chat, tmp_path / "chat.tar")
    assert fingerprint_package(tarball) == fingerprint_package(str(chat))
    assert fingerprint_package(tarball) != fingerprint_package(tiny_tarball())


class _Body(io.BytesIO):
    def __init__(self, data: bytes, log: list[int]):
        super().__init__(data)
        self._log = log

    def read(self, n: int | None = -1) -> bytes:
        chunk = super().read(n)
        self._log.append(len(chunk))
        return chunk


class _FakeS3:
    """get_object over a dict: what Downloader.read_small and the tarball stream use."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects
        self.reads: list[int] = []

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        try:
            return {"Body": _Body(self.objects[f"{Bucket}/{Key}"], self.reads)}
        except KeyError:
            raise FileNotFoundError(f"NoSuchKey: {Bucket}/{Key}") from None


def test_s3_directory_and_streamed_tarball(package_dir):
    tar_bytes = Path(tiny_tarball()).read_bytes()
    objects = {"b/pkgs/tiny.tar": tar_bytes}
    for path in package_dir.rglob("*"):
        if path.is_file():
            objects[f"b/pkgs/tiny/{path.relative_to(package_dir).as_posix()}"] = path.read_bytes()
    s3 = _FakeS3(objects)
    dl = Downloader(s3_client_factory=lambda: s3)
    expected = fingerprint_package(str(package_dir))
    assert fingerprint_package("s3://b/pkgs/tiny", downloader=dl) == expected
    s3.reads.clear()
    assert fingerprint_package("s3://b/pkgs/tiny.tar", downloader=dl) == expected
    weights = os.path.getsize(package_dir / "weights" / "model.safetensors")
    # Stopped after the tokenizer members: the weights (the bulk of the tarball) were never read.
    assert sum(s3.reads) < len(tar_bytes) - weights
    with pytest.raises(ControlError) as err:
        fingerprint_package("s3://b/missing.tar", downloader=dl)
    assert err.value.status == 400


def test_unreadable_and_invalid_packages_are_400(package_dir, tmp_path):
    for uri in (str(tmp_path / "nowhere"), str(tmp_path / "nowhere.tar"), ""):
        with pytest.raises(ControlError) as err:
            fingerprint_package(uri)
        assert err.value.status == 400
    broken = copy(package_dir, tmp_path, "broken")
    m = manifest(broken)
    del m["weights"]
    write_manifest(broken, m)
    with pytest.raises(ControlError) as err:
        fingerprint_package(str(broken))
    assert err.value.status == 400 and err.value.code == "invalid_package"
    bad_kind = copy(package_dir, tmp_path, "bad_kind")
    m = manifest(bad_kind)
    m["engine_args"]["kind"] = "rerank"
    write_manifest(bad_kind, m)
    with pytest.raises(ControlError) as err:
        fingerprint_package(str(bad_kind))
    assert err.value.status == 400
    not_tar = tmp_path / "junk.tar"
    not_tar.write_bytes(b"not a tarball")
    with pytest.raises(ControlError):
        fingerprint_package(str(not_tar))


def test_fingerprint_diff():
    a = {"kind": "generate", "max_model_len": 512, "tokenizer_sha256": "x"}
    assert fingerprint_diff(a, dict(a)) == []
    assert fingerprint_diff(a, a | {"max_model_len": 1024, "kind": "embed"}) == ["kind", "max_model_len"]
    assert fingerprint_diff(None, a) == ["kind", "tokenizer_sha256", "max_model_len"]
    assert fingerprint_diff(a, a | {"zz_extra": 1}) == ["zz_extra"]


def xgb_tarball() -> str:
    try:
        return runfile("services/launcher/xgb_package.tar")
    except FileNotFoundError:
        pytest.skip("build //services/launcher:xgb_package first (or run under Bazel)")


def test_a_kserve_package_fingerprints_its_triton_config(tmp_path: Path) -> None:
    fp = fingerprint_package(xgb_tarball())
    assert fp["kind"] == "kserve"
    assert fp["tokenizer_sha256"] is None and fp["chat_template_sha256"] is None
    assert fp["max_model_len"] is None
    out = tmp_path / "xgb"
    with tarfile.open(xgb_tarball()) as tar:
        tar.extractall(out, filter="data")
    config = hashlib.sha256((out / "weights" / "config.json").read_bytes()).hexdigest()
    assert fp["kserve"] == {"config_json_sha256": config}
    assert fingerprint_package(str(out)) == fp
    # A retrained booster keeps the interface; a changed config.json may not.
    retrained = manifest(out)
    for f in retrained["weights"]["files"]:
        if f["path"] == "model.ubj":
            f["sha256"] = "0" * 64
    write_manifest(out, retrained)
    assert fingerprint_diff(fp, fingerprint_package(str(out))) == []
    for f in retrained["weights"]["files"]:
        if f["path"] == "config.json":
            f["sha256"] = "1" * 64
    write_manifest(out, retrained)
    assert fingerprint_diff(fp, fingerprint_package(str(out))) == ["kserve"]
    # The LLM and the classic model never pass for one another.
    assert "kind" in fingerprint_diff(fp, fingerprint_package(tiny_tarball()))


def test_parallel_sizes_are_resources_not_a_breaking_change(package_dir, tmp_path):
    """tensor x pipeline parallel sizes become the replica's GPU count; a version that only
    changes them rolls out like any compatible one (fingerprint_diff ignores resources), and a
    size that is not a positive integer is refused at registration."""
    base = fingerprint_package(str(package_dir))
    wide = copy(package_dir, tmp_path, "wide")
    manifest = json.loads((wide / "model.json").read_text())
    manifest["engine_args"] = {
        **manifest.get("engine_args", {}),
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 3,
    }
    (wide / "model.json").write_text(json.dumps(manifest))
    fp = fingerprint_package(str(wide))
    assert fp["resources"] == {"tensor_parallel_size": 2, "pipeline_parallel_size": 3, "gpus": 6}
    assert fingerprint_diff(base, fp) == []
    for bad in (0, -1, True, "2", 1.5):
        manifest["engine_args"]["tensor_parallel_size"] = bad
        (wide / "model.json").write_text(json.dumps(manifest))
        with pytest.raises(ControlError, match="tensor_parallel_size"):
            fingerprint_package(str(wide))


def test_a_repository_model_without_a_config_fingerprints_the_file_its_config_comes_from():
    """A repository model with no config has its tensors read from model.onnx (or declared by
    model.py's auto_complete_config): a change there is a change of its I/O, as a config's
    would be; a configured model's model.py (its code, not its tensors) is not."""
    from paved.control_plane.fingerprint import fingerprint_of
    from paved.launcher.package import parse_model_json

    def package(onnx: str, code: str) -> dict[str, Any]:
        files = [
            {"path": "scorer/config.pbtxt", "sha256": "a" * 64, "size": 10},
            {"path": "scorer/1/model.py", "sha256": code * 64, "size": 10},
            {"path": "ranker/1/model.onnx", "sha256": onnx * 64, "size": 10},
        ]
        doc = {
            "schema_version": 1, "mode": "kserve", "model_id": "scorer", "version": "1",
            "engine_args": {}, "plugins": [], "tokenizer": None,
            "weights": {"uri": "weights", "files": files},
        }  # fmt: skip
        return fingerprint_of(parse_model_json(json.dumps(doc)))

    before = package("b", "c")
    assert before["models"] == ["ranker", "scorer"]
    assert fingerprint_diff(before, package("d", "c")) == ["kserve"]
    assert fingerprint_diff(before, package("b", "e")) == []
