#!/usr/bin/env python3
"""Runs every Python test of kvoffload (stdlib unittest) and ends with `N passed, M failed`.

Usage: python3 python/tests/run.py [-v] [--installed] [-k PATTERN ...]
Tests the package of this checkout (`python/kvoffload`, put first on sys.path), or with
`--installed` the one the interpreter has installed (`pip install .`; then it must come from
outside this tree and load the library bundled in it, unless KVOFFLOAD_LIB says otherwise).
The library is found as kvoffload does (`kvoffload.library_path` is printed).
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
    installed = "--installed" in argv
    if installed:
        os.environ["KVOFFLOAD_TEST_INSTALLED"] = "1"
    else:
        sys.path.insert(0, PYTHON_DIR)
    import kvoffload

    print(f"kvoffload {kvoffload.__version__} from {os.path.dirname(kvoffload.__file__)}, "
          f"library {kvoffload.library_path}", flush=True)
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
