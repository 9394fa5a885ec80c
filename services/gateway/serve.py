"""`tools/bazel run //services/gateway:serve -- --routes FILE`: the gateway (paved.gateway.server)."""

import sys

from paved.gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
