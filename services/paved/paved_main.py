"""`tools/bazel run //services/paved:paved -- keys create --tenant T`: paved's CLI."""

import sys

from paved.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
