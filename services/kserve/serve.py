"""`tools/bazel run //services/kserve:serve [-- --help]`: paved's standalone KServe v2 server."""

import sys

from paved.kserve.main import main

if __name__ == "__main__":
    sys.exit(main())
