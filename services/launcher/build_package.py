"""`tools/bazel run //services/launcher:build_package -- --hf-dir DIR --out OUT ...`: package a model."""

import sys

from paved.launcher.build import main

if __name__ == "__main__":
    sys.exit(main())
