"""Uninstall packages present in the venv but absent from the lock, so the venv equals the lock."""

import re
import subprocess
import sys
from importlib import metadata

# The venv's own tooling, never listed in a lock.
_KEEP = {"pip", "setuptools", "wheel"}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(lock_path: str) -> int:
    locked = set()
    with open(lock_path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                locked.add(_canon(re.split(r"[=<>!~\[ ;]", line, maxsplit=1)[0]))
    installed = {_canon(d.metadata["Name"]) for d in metadata.distributions()}
    extra = sorted(installed - locked - _KEEP)
    if extra:
        print("removing packages not in the lock:", " ".join(extra))
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *extra], check=True)  # noqa: S603 - the venv's own pip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
