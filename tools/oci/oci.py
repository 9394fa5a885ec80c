"""Entry point of //tools/oci:oci (paved-images); the logic is paved.images."""

import sys

from paved.images.cli import main

if __name__ == "__main__":
    sys.exit(main())
