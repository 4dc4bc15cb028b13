#!/usr/bin/env python3
"""Runs every Python test of kvoffload (stdlib unittest) and ends with `N passed, M failed`.

Usage: python3 python/tests/run.py [-v] [-k PATTERN ...]
The library is found as kvoffload does (KVOFFLOAD_LIB, then target/{release,debug}).
Exit status 0 only when at least one test ran and none failed.
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)


def main(argv):
    verbosity = 2 if "-v" in argv else 1
    patterns = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-k"]
    sys.path.insert(0, PYTHON_DIR)
    loader = unittest.TestLoader()
    if patterns:
        loader.testNamePatterns = [p if "*" in p else f"*{p}*" for p in patterns]
    try:
        suite = loader.discover(start_dir=HERE, pattern="test_*.py", top_level_dir=HERE)
    except Exception as e:  # a broken test tree still ends with the summary line
        print(f"test discovery failed: {e!r}")
        print("0 passed, 1 failed", flush=True)
        return 1
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=verbosity).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped - len(result.expectedFailures)
    if skipped:
        print(f"{skipped} skipped")
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 and result.testsRun > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
