"""`tools/bazel run //services/platform:up`: the whole platform on this machine (paved.platform.up)."""

import sys

from paved.platform.up import main

if __name__ == "__main__":
    sys.exit(main())
