"""`tools/bazel run //services/control_plane:serve`: the control plane (paved.control_plane.server)."""

import sys

from paved.control_plane.server import main

if __name__ == "__main__":
    sys.exit(main())
