"""Entry point of every paved py_test: runs pytest on the target's test files.

Bazel sets XML_OUTPUT_FILE so results land in bazel-testlogs as JUnit XML; the cache
provider is off because the runfiles tree is read-only under the sandbox.

The exit after the tests is bounded. A worker thread or exit hook that never returns, or a
finalizer that waits on a lock a frozen daemon thread holds, would otherwise hold the process
until Bazel kills it at the target's timeout and reports only TIMEOUT, with nothing in the log
that says what was stuck.
"""

import atexit
import faulthandler
import os
import sys
import threading

# Until pytest has returned, a failure: an exception escaping before that (a broken import, an
# error out of pytest itself) must not exit 0.
_status = 1

# The tests have ended by then; joining threads and running the exit hooks takes well under
# a second.
EXIT_GRACE_S = 60.0


def _exit_with_status() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status)


def _arm_exit_watchdog() -> None:
    def fire() -> None:
        sys.stderr.write(
            f"\npytest_main: WARNING: the process had not exited {EXIT_GRACE_S:.0f} s after its "
            f"tests ended (exit status {_status}); the stack of every thread follows, then it "
            f"exits with that status.\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _exit_with_status()

    # A daemon thread still runs while the interpreter joins the others and runs the hooks.
    timer = threading.Timer(EXIT_GRACE_S, fire)
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    # Only in the test process itself (multiprocessing's spawn re-runs this file as
    # __mp_main__ in each child, whose exit status must stay its own). Registered before pytest
    # and the tests import anything, so it runs after every other exit hook (they run
    # last-registered first): the interpreter has joined its threads and run the hooks; what is
    # skipped is only the teardown of objects and modules, where nothing of a test's is left.
    atexit.register(_exit_with_status)
    import pytest

    args = [*sys.argv[1:], "-p", "no:cacheprovider", "-q", "-ra"]
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    _status = int(pytest.main(args))
    _arm_exit_watchdog()
    sys.exit(_status)
