"""model.json validation and the package builder, on the tiny model fixture."""

import hashlib
import json
import os
import tarfile

import pytest

from paved.launcher.build import build_package, main
from paved.launcher.package import PackageError, parse_model_json
from paved.launcher.testing import minimal_hf_dir
from paved.testing.fixtures import TINY_MODEL_FILES, tiny_model_dir

SHA = "0" * 64


def _files(path, size=1, sha=SHA):
    return [{"path": path, "sha256": sha, "size": size}]


def _raw(**over):
    raw = {
        "model_id": "m",
        "version": "1",
        "weights": {"uri": "weights", "files": [{"path": "config.json", "sha256": SHA, "size": 2}]},
        "tokenizer": {"uri": "tokenizer", "files": [{"path": "tokenizer.json", "sha256": SHA, "size": 2}]},
    }
    raw.update(over)
    return json.dumps(raw)


def test_minimal_package_validates_with_defaults():
    p = parse_model_json(_raw())
    assert p.mode == "embedded" and p.plugins == () and p.engine_args == {}
    assert p.digest() == parse_model_json(_raw()).digest()
    assert p.digest() != parse_model_json(_raw(version="2")).digest()


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        (
            {"weights": {"uri": "w", "files": [{"path": "../config.json", "sha256": SHA, "size": 1}]}},
            "relative",
        ),
        ({"weights": {"uri": "w", "files": [{"path": "/etc/passwd", "sha256": SHA, "size": 1}]}}, "relative"),
        ({"weights": {"uri": "w", "files": [{"path": "config.json", "sha256": "abc", "size": 1}]}}, "sha256"),
        ({"weights": {"uri": "w", "files": [{"path": "config.json", "sha256": SHA, "size": -1}]}}, "size"),
        # 2**60 bytes: the download's part list was allocated from it before any check (OOM).
        ({"weights": {"uri": "w", "files": [{"path": "config.json", "sha256": SHA, "size": 2**60}]}}, "size"),
        ({"weights": {"uri": "w", "files": [{"path": "x.bin", "sha256": SHA, "size": 1}]}}, "config.json"),
        (
            {"tokenizer": {"uri": "t", "files": [{"path": "config.json", "sha256": SHA, "size": 1}]}},
            "both weights and tokenizer",
        ),
        ({"mode": "sidecar"}, "mode"),
        ({"surprise": 1}, "surprise"),
        ({"plugins": [{"uri": "plugins/x.zip", "sha256": SHA, "size": 1}]}, ".whl"),
        ({"model_id": "a b"}, "model_id"),
        # A package may add plugins, never pin its own engine (images/<flavour>.lock.toml does).
        (
            {"plugins": [{"uri": "plugins/vllm-0.10.0-py3-none-any.whl", "sha256": SHA, "size": 1}]},
            "cannot override",
        ),
        # Where the engine listens and what it serves are the launcher's (a package's came last
        # and won: 0.0.0.0 exposed the engine past the gate).
        ({"engine_args": {"host": "0.0.0.0"}}, "set by paved itself"),  # noqa: S104 - refused
        ({"engine_args": {"served-model-name": "x", "max_model_len": 512}}, "served-model-name"),
    ],
)
def test_invalid_packages_are_rejected_with_the_field_named(over, needle):
    with pytest.raises(PackageError) as e:
        parse_model_json(_raw(**over), "s3://b/p/model.json")
    assert needle in str(e.value)
    assert "s3://b/p/model.json" in str(e.value)


def test_absolute_artifact_uris_are_allowed():
    p = parse_model_json(
        _raw(
            weights={
                "uri": "s3://other/weights/",
                "files": [{"path": "config.json", "sha256": SHA, "size": 2}],
            }
        )
    )
    assert p.weights.uri == "s3://other/weights"


def test_build_from_the_tiny_fixture_dir_and_tarball(tmp_path):
    src = tiny_model_dir()
    pkg = build_package(src, str(tmp_path / "pkg"), "tiny", "1", {"max_model_len": 512})
    roles = {f.path: a.uri for a, f in pkg.model_files()}
    assert set(roles) == set(TINY_MODEL_FILES)
    assert roles["tokenizer.json"] == "tokenizer" and roles["model.safetensors"] == "weights"
    for artifact, f in pkg.model_files():
        data = (tmp_path / "pkg" / artifact.uri / f.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256 and len(data) == f.size
        with open(os.path.join(src, f.path), "rb") as fh:
            assert data == fh.read()
    on_disk = parse_model_json((tmp_path / "pkg" / "model.json").read_bytes())
    assert on_disk.digest() == pkg.digest()

    build_package(src, str(tmp_path / "a.tar"), "tiny", "1")
    build_package(src, str(tmp_path / "b.tar"), "tiny", "1")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes(), "not reproducible"
    with tarfile.open(tmp_path / "a.tar") as tar:
        names = tar.getnames()
    assert names[0] == "model.json" and "weights/model.safetensors" in names


def test_cli_rejects_a_folder_without_config(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert (
        main(
            [
                "--hf-dir",
                str(tmp_path / "hf"),
                "--out",
                str(tmp_path / "o"),
                "--model-id",
                "x",
                "--version",
                "1",
            ]
        )
        == 2
    )
    assert "config.json" in capsys.readouterr().err


def _linked_dir(link, target):
    target.mkdir()
    (target / "extra.bin").write_bytes(b"x")
    link.symlink_to(target)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda hf, tmp: (hf / "weights.bin").symlink_to(tmp / "gone"), "weights.bin is not a regular file"),
        (lambda hf, tmp: os.mkfifo(hf / "pipe"), "pipe is not a regular file"),
        (lambda hf, tmp: _linked_dir(hf / "sub", tmp / "shared"), "sub is a symbolic link"),
    ],
    ids=["broken-link", "fifo", "linked-dir"],
)
def test_cli_refuses_files_it_would_drop_or_hang_on(tmp_path, capsys, make, needle):
    hf = tmp_path / "hf"
    minimal_hf_dir(hf)
    make(hf, tmp_path)
    argv = ["--hf-dir", str(hf), "--out", str(tmp_path / "o"), "--model-id", "x", "--version", "1"]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_rejects_a_missing_plugin_wheel_and_an_unwritable_output(tmp_path, capsys):
    hf = minimal_hf_dir(tmp_path / "hf")
    base = ["--hf-dir", str(hf), "--model-id", "x", "--version", "1"]
    assert main([*base, "--out", str(tmp_path / "o"), "--plugin", str(tmp_path / "none.whl")]) == 2
    assert "none.whl is not a file" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main([*base, "--out", str(tmp_path / "file" / "pkg")]) == 2
    assert "build_package:" in capsys.readouterr().err


def test_the_launchers_own_vllm_flags_come_after_the_packages(tmp_path):
    """argparse keeps the last of a flag: the launcher's --host, --port, --model and
    --served-model-name come after a package's engine args, so no spelling a package finds
    for them (an abbreviation such as --hos) can move where the engine listens."""
    from paved.launcher.main import child_spec, parser
    from paved.launcher.materialize import Materialized

    package = parse_model_json(_raw(mode="standalone", engine_args={"max_model_len": 512, "hos": "0.0.0.0"}))  # noqa: S104
    m = Materialized(
        uri="x", digest="d", package=package, package_dir=str(tmp_path), model_dir=str(tmp_path / "model"),
        plugin_dir=None, warm=True, seconds=0.0,
    )  # fmt: skip
    argv = child_spec(parser().parse_args(["x"]), m, str(tmp_path)).argv
    assert argv.index("--max-model-len") < argv.index("--host") and argv.index("--hos") < argv.index("--host")
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv.index("--host") > argv.index("--model")
