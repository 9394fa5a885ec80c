"""Plugin wheels (built here with zipfile) and PROMETHEUS_MULTIPROC_DIR hygiene."""

import os
import zipfile

import pytest

from paved.launcher import metrics_dir, plugins
from paved.launcher.build import build_package
from paved.launcher.cache import Cache
from paved.launcher.gate import free_port
from paved.launcher.main import child_env
from paved.launcher.materialize import Materializer
from paved.launcher.testing import LauncherProcess, make_wheel, minimal_hf_dir, subprocess_env

GOOD = {
    "good_plugin/__init__.py": (
        "import os\n"
        "def register():\n"
        "    with open(os.environ['GOOD_PLUGIN_MARKER'], 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "class Processor:\n"
        "    pass\n"
    )
}
BROKEN = {"broken_plugin/__init__.py": "raise ImportError('libfoo.so.1: cannot open shared object file')\n"}


@pytest.fixture()
def hf(tmp_path):
    return minimal_hf_dir(tmp_path / "hf")


def _wheels(tmp_path):
    out = tmp_path / "wheels"
    out.mkdir(exist_ok=True)
    good = make_wheel(
        str(out),
        "good-plugin",
        "0.1",
        GOOD,
        {
            "vllm.general_plugins": {"good": "good_plugin:register"},
            "vllm.logits_processors": {"good_lp": "good_plugin:Processor"},
        },
    )
    broken = make_wheel(
        str(out),
        "broken-plugin",
        "0.1",
        BROKEN,
        {"vllm.general_plugins": {"broken": "broken_plugin:register"}},
    )
    return good, broken


def test_wheels_are_installed_isolated_discovered_and_registered(tmp_path, hf):
    good, _ = _wheels(tmp_path)
    build_package(str(hf), str(tmp_path / "pkg"), "p", "1", plugin_wheels=(good,))
    m = Materializer(Cache(str(tmp_path / "cache")), progress_tty=False).materialize(str(tmp_path / "pkg"))
    assert m.plugin_dir and os.path.isfile(os.path.join(m.plugin_dir, "good_plugin", "__init__.py"))
    with pytest.raises(ImportError):
        __import__("good_plugin")  # not installed into this environment
    marker = tmp_path / "marker"
    env = child_env(m, None)
    env["GOOD_PLUGIN_MARKER"] = str(marker)
    eps = {(e.group, e.name): e for e in plugins.check(m.plugin_dir, env)}
    assert eps[("vllm.general_plugins", "good")].from_package
    assert eps[("vllm.logits_processors", "good_lp")].value == "good_plugin:Processor"
    # The platform's own plugins are reported too (paved's constraint processor).
    assert not eps[("vllm.logits_processors", "paved_constraints")].from_package
    assert len(marker.read_text().split()) == 1, "the general plugin was called once, as vLLM would"


def test_a_wheel_with_unsafe_paths_is_refused(tmp_path):
    bad = tmp_path / "evil-0.1-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("evil-0.1.dist-info/METADATA", "Name: evil\n")
        zf.writestr("../../outside.py", "x = 1\n")
    with pytest.raises(plugins.PluginError, match="unsafe member"):
        plugins.install_wheels([("evil-0.1-py3-none-any.whl", str(bad))], str(tmp_path / "target"))
    assert not (tmp_path / "outside.py").exists()


def test_broken_plugin_fails_the_start_before_the_engine(tmp_path, hf):
    good, broken = _wheels(tmp_path)
    build_package(str(hf), str(tmp_path / "pkg"), "p", "1", plugin_wheels=(good, broken))
    started = tmp_path / "engine-started"
    args = [
        str(tmp_path / "pkg"), "--cache-dir", str(tmp_path / "cache"), "--port", str(free_port()),
        "--child-cmd", f"{{python}} -c \"open('{started}', 'w')\"",
    ]  # fmt: skip
    proc = LauncherProcess(
        args, str(tmp_path / "l.log"), subprocess_env(GOOD_PLUGIN_MARKER=str(tmp_path / "m"))
    )
    assert proc.wait(60) == 1
    err = proc.stderr()
    assert (
        "start failed: plugin 'broken' (vllm.general_plugins = broken_plugin:register, wheel broken-plugin) "
        "failed to load: ImportError: libfoo.so.1: cannot open shared object file" in err
    ), err
    assert not started.exists(), "the engine was started despite the broken plugin"


# ---- PROMETHEUS_MULTIPROC_DIR -------------------------------------------------------------
def test_metrics_dir_is_wiped_of_stale_db_files_only(tmp_path):
    d = tmp_path / "prom"
    d.mkdir()
    for name in ("counter_12.db", "gauge_livesum_12.db", "gauge_all_7.db", "histogram_12.db"):
        (d / name).write_bytes(b"\0" * 16)
    fd = metrics_dir.prepare(str(d))
    try:
        assert sorted(os.listdir(d)) == [metrics_dir.MARKER, metrics_dir.LOCK]
        # A second launcher on the same directory is refused while this one runs.
        with pytest.raises(metrics_dir.MetricsDirError, match="in use by another running launcher"):
            metrics_dir.prepare(str(d))
    finally:
        os.close(fd)
    os.close(metrics_dir.prepare(str(d)))  # free again after the first one ended


@pytest.mark.parametrize("intruder", ["notes.txt", "counter_12.db.bak", "subdir"])
def test_metrics_dir_that_does_not_look_like_one_is_not_touched(tmp_path, intruder):
    d = tmp_path / "prom"
    d.mkdir()
    (d / "counter_1.db").write_bytes(b"x")
    if intruder == "subdir":
        (d / intruder).mkdir()
    else:
        (d / intruder).write_text("precious")
    with pytest.raises(metrics_dir.MetricsDirError, match="does not look like a metrics directory"):
        metrics_dir.prepare(str(d))
    assert sorted(os.listdir(d)) == sorted(["counter_1.db", intruder]), "something was deleted"


def test_root_and_home_are_refused():
    for path in ("/", os.path.expanduser("~")):
        with pytest.raises(metrics_dir.MetricsDirError, match="refusing"):
            metrics_dir.prepare(path)


def test_launcher_refuses_a_foreign_metrics_dir(tmp_path, hf):
    build_package(str(hf), str(tmp_path / "pkg"), "p", "1")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    args = [
        str(tmp_path / "pkg"),
        "--cache-dir",
        str(tmp_path / "c"),
        "--metrics-dir",
        str(tmp_path / "home"),
    ]
    proc = LauncherProcess(args, str(tmp_path / "l.log"))
    assert proc.wait(60) == 1
    assert "refusing to clean PROMETHEUS_MULTIPROC_DIR" in proc.stderr()
    assert (tmp_path / "home" / "thesis.tex").read_text() == "precious"
