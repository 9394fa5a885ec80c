"""`tools/bazel run //services/metrics_proxy:serve [-- --help]`: one merged /metrics."""

import sys

from paved.metrics.server import main

if __name__ == "__main__":
    sys.exit(main())
