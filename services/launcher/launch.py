"""`tools/bazel run //services/launcher:launch -- PACKAGE_URI [-- --help]`: the model launcher."""

import sys

from paved.launcher.main import main

if __name__ == "__main__":
    sys.exit(main())
