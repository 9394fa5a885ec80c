"""Plugin wheels: installed into an isolated directory, discovered and checked before the start.

A wheel is a zip archive; a pure-Python wheel "installs" by unpacking it (its
`*.data/purelib|platlib` folders go to the top level), which needs neither pip nor network.
The directory is put first on the engine's PYTHONPATH, so vLLM (in every process it spawns)
finds the wheels' `vllm.general_plugins` / `vllm.logits_processors` entry points through
`importlib.metadata`. Wheel dependencies are not resolved: a plugin's imports must be satisfied
by the platform image or by other wheels of the same package.

`check()` runs `python -m paved.launcher.plugins DIR` in a child process with that path: it
lists every entry point of the two groups (the platform's own, such as paved's constraint
processor, and the package's), imports each of the package's, and calls its general plugins as
vLLM would. A plugin that fails to import or register fails the start with its traceback's last
line, instead of vLLM logging the failure and starting without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import subprocess
import sys
import traceback
import zipfile
from dataclasses import dataclass

GROUPS = ("vllm.general_plugins", "vllm.logits_processors")


class PluginError(RuntimeError):
    """A plugin wheel cannot be installed, imported or registered."""


def install_wheels(wheels: list[tuple[str, str]], target: str) -> None:
    """Unpack `(wheel_filename, path)` pairs into `target` (created)."""
    os.makedirs(target, exist_ok=True)
    for filename, path in wheels:
        try:
            _unpack(path, target)
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise PluginError(f"plugin wheel {filename}: cannot install: {e}") from e


def _unpack(path: str, target: str) -> None:
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        if not any(n.endswith(".dist-info/METADATA") for n in names):
            raise ValueError("not a wheel (no *.dist-info/METADATA)")
        for info in zf.infolist():
            name = info.filename
            if info.is_dir():
                continue
            norm = posixpath.normpath(name)
            if name.startswith("/") or norm.split("/")[0] == ".." or "\\" in name:
                raise ValueError(f"unsafe member {name!r}")
            parts = norm.split("/")
            if parts[0].endswith(".data"):
                if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                    norm = "/".join(parts[2:])
                else:
                    continue  # scripts, headers, data: not part of an importable plugin
            dest = os.path.join(target, *norm.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)


@dataclass(frozen=True)
class EntryPointInfo:
    group: str
    name: str
    value: str
    dist: str
    from_package: bool


def check(plugin_dir: str | None, env: dict[str, str], timeout_s: float = 300.0) -> list[EntryPointInfo]:
    """Discover the entry points visible to the engine and load the package's; raise PluginError."""
    cmd = [sys.executable, "-m", "paved.launcher.plugins"]
    if plugin_dir:
        cmd.append(plugin_dir)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)  # noqa: S603 - our own interpreter on our own script
    except subprocess.TimeoutExpired as e:
        raise PluginError(f"plugin check did not finish in {timeout_s:.0f}s") from e
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise PluginError(f"plugin check crashed (exit {proc.returncode}): {' | '.join(tail)}")
    report = json.loads(lines[-1])
    if report["errors"]:
        raise PluginError("; ".join(report["errors"]))
    return [EntryPointInfo(**ep) for ep in report["entry_points"]]


def _child_main(argv: list[str]) -> int:
    import importlib.metadata as md

    plugin_dir = os.path.realpath(argv[0]) if argv else None
    package_dists = set()
    if plugin_dir:
        package_dists = {d.metadata["Name"] for d in md.distributions(path=[plugin_dir])}
    eps, errors = [], []
    for group in GROUPS:
        for ep in md.entry_points(group=group):
            dist = ep.dist.metadata["Name"] if ep.dist else "?"
            from_package = dist in package_dists
            eps.append(
                {
                    "group": group,
                    "name": ep.name,
                    "value": ep.value,
                    "dist": dist,
                    "from_package": from_package,
                }
            )
            if not from_package:
                continue
            try:
                obj = ep.load()
                if group == "vllm.general_plugins":
                    obj()
            except BaseException as e:  # noqa: BLE001 - a plugin may raise anything, SystemExit included
                last = traceback.format_exception_only(type(e), e)[-1].strip()
                errors.append(
                    f"plugin {ep.name!r} ({group} = {ep.value}, wheel {dist}) failed to load: {last}"
                )
    allow = os.environ.get("VLLM_PLUGINS")
    if allow is not None:
        allowed = {n.strip() for n in allow.split(",") if n.strip()}
        for info in eps:
            if (
                info["from_package"]
                and info["group"] == "vllm.general_plugins"
                and info["name"] not in allowed
            ):
                errors.append(f"plugin {info['name']!r} is not in VLLM_PLUGINS={allow!r}; vLLM would skip it")
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps({"entry_points": eps, "errors": errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
