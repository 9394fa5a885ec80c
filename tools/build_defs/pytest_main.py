"""Entry point of every paved py_test: runs pytest on the target's test files.

Bazel sets XML_OUTPUT_FILE so results land in bazel-testlogs as JUnit XML; the cache
provider is off because the runfiles tree is read-only under the sandbox.
"""

import os
import sys

import pytest

if __name__ == "__main__":
    args = [*sys.argv[1:], "-p", "no:cacheprovider", "-q", "-ra"]
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    sys.exit(pytest.main(args))
