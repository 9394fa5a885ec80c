"""Building an image twice gives the same digest.

The layer and the cpu image Bazel built for one service ($SERVICE: //images:<service>_layer,
//images:<service>_cpu) are rebuilt here from the same inputs, twice, from copies with other
mtimes, another umask and another entry order, in other directories: every digest must equal
Bazel's."""

import json
import os
import re
import shutil

import pytest

from paved.images import build, oci


def _short_path(exec_path: str) -> str:
    """Runfiles-relative path of an action input given by its exec path."""
    m = re.match(r"^bazel-out/[^/]+/bin/(.*)$", exec_path)
    path = m.group(1) if m else exec_path
    return "../" + path[len("external/") :] if path.startswith("external/") else path


@pytest.fixture(scope="module")
def bazel_layer(runfile):
    return json.loads(runfile("LAYER", ".layer.json").read_text())


def _rebuild_layer(runfile, tmp_path, mtime, umask, reverse):
    entries = runfile("LAYER", ".entries.json")
    manifest = json.loads(entries.read_text())
    root = entries.parents[1]  # <runfiles>/<workspace>
    stub = manifest["binary"]["stub"]
    old = os.umask(umask)
    try:
        for i, e in enumerate(manifest["entries"]):
            if "source" not in e:
                continue
            src = (root / _short_path(e["source"])).resolve()
            copy = tmp_path / "src" / str(i) / src.name
            copy.parent.mkdir(parents=True)
            shutil.copy(src, copy)
            os.utime(copy, (mtime, mtime))
            if e["source"] == stub:
                manifest["binary"]["stub"] = str(copy)
            e["source"] = str(copy)
    finally:
        os.umask(old)
    if reverse:
        manifest["entries"].reverse()
    (tmp_path / "entries.json").write_text(json.dumps(manifest))
    info = build.build_layer(
        str(tmp_path / "entries.json"), str(tmp_path / "layer.tgz"), str(tmp_path / "layer.json")
    )
    return info, tmp_path / "layer.tgz", tmp_path / "layer.json"


def test_layer_rebuilt_twice_matches_bazel(runfile, tmp_path, bazel_layer):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _, _ = _rebuild_layer(runfile, tmp_path / "a", 1_600_000_000, 0o022, False)
    b, _, _ = _rebuild_layer(runfile, tmp_path / "b", 7, 0o077, True)
    assert a == b
    assert (a.digest, a.diff_id, a.size) == (
        bazel_layer["digest"],
        bazel_layer["diff_id"],
        bazel_layer["size"],
    )


def test_image_rebuilt_matches_bazel_digest(runfile, tmp_path):
    bazel_digest = runfile("IMAGE", ".digest").read_text().strip()
    image = oci.Layout(runfile("IMAGE", ".digest").with_suffix("")).image()
    assert image.manifest_digest == bazel_digest
    revision = oci.image_labels(image)["org.opencontainers.image.revision"]
    (tmp_path / "status.txt").write_text(f"BUILD_HOST elsewhere\n{build.REVISION_KEY} {revision}\n")
    digests = set()
    for run in ("one", "two"):
        (tmp_path / run).mkdir()
        _, tar, info = _rebuild_layer(
            runfile, tmp_path / run, 42 if run == "one" else 4242, 0o022, run == "two"
        )
        digests.add(
            build.build_image_action(
                str(tmp_path / run / "layout"),
                str(runfile("IMAGE", ".spec.json")),
                [(str(tar), str(info))],
                str(runfile("BASE", ".digest").with_suffix("")),
                str(runfile("CPU_LOCK")),
                str(tmp_path / "status.txt"),
                None,
            )
        )
    assert digests == {bazel_digest}


def test_the_image_runs_the_binary_the_way_bazel_does(runfile):
    """Entrypoint = [the lock's interpreter, the binary's main]; PYTHONPATH as the stub sets it."""
    image = oci.Layout(runfile("IMAGE", ".digest").with_suffix("")).image()
    cfg = image.config["config"]
    package, _, name = os.environ["BINARY"].lstrip("/").partition(":")
    rf = f"/app/{os.environ['SERVICE']}/{name}.runfiles"
    assert cfg["Entrypoint"] == ["/opt/paved/venv/bin/python", f"{rf}/paved/{package}/{name}.py"]
    env = oci.image_env(image)
    path = env["PYTHONPATH"].split(":")
    assert path[0] == rf and rf + "/paved/libs" in path and env["RUNFILES_DIR"] == rf
    assert cfg["WorkingDir"] == rf + "/paved"
    labels = oci.image_labels(image)
    assert labels["org.paved.engine.version"] == "0.32.0" and labels["org.paved.flavour"] == "cpu"
    assert labels["org.opencontainers.image.revision"]


def test_a_vendored_metadata_only_base_gives_the_same_image(runfile):
    """A real base is checked in as manifest + config only (its layers stay in the registry);
    building on that layout must give exactly the image built on the full local base."""
    vendored = runfile("ON_VENDORED_BASE", ".digest")
    assert os.environ["SERVICE"] == "launcher"  # //images:launcher_cpu_on_vendored_base
    assert vendored.read_text() == runfile("IMAGE", ".digest").read_text()
