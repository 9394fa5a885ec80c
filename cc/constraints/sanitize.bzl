"""Compiler flags of the sanitized (ASan + UBSan, gcc) test variants in //cc/constraints/..."""

# Any report aborts the test (-fno-sanitize-recover): a sanitizer finding is a failure, not a
# line in a log.
SANITIZE = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
]
