"""//images:bad_pin_fixture_check (manual): the raw compatibility check of the bad-pin fixture.
It FAILS by design; `tools/bazel test //images:bad_pin_fixture_check` shows the message."""

import os
import sys

from paved.images import compat

if __name__ == "__main__":
    root = os.path.join(os.environ["TEST_SRCDIR"], os.environ.get("TEST_WORKSPACE", "paved"))
    lock, wheel = (os.path.normpath(os.path.join(root, p)) for p in sys.argv[1:3])
    sys.exit(compat.main(["--lock", lock, "--wheel", wheel, "--strict"]))
