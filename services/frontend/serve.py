"""`tools/bazel run //services/frontend:serve [-- --help]`: paved's OpenAI-compatible server."""

import sys

from paved.frontend.server import main

if __name__ == "__main__":
    sys.exit(main())
