"""examples/replay.py (the replay example, also written in C as examples/replay.c) runs with
this package and reports a consistent replay; tests/c_api.rs checks that both print the same."""

import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "examples", "replay.py")


class ReplayExampleTest(unittest.TestCase):
    def run_replay(self):
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        if not os.environ.get("KVOFFLOAD_TEST_INSTALLED"):  # the package under test
            env["PYTHONPATH"] = os.path.join(ROOT, "python")
        r = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout

    def test_replay_reports_hits_deferrals_and_clean_state(self):
        out = self.run_replay()
        figures = dict(line.split(": ", 1) for line in out.splitlines())
        self.assertEqual(
            list(figures),
            ["requests", "steps", "prompt tokens", "host hit tokens", "load jobs", "store jobs",
             "deferrals", "flushed jobs", "host evictions", "loaded blocks checked",
             "invariants"],
        )
        n = {k: int(v.split()[0]) for k, v in figures.items() if k != "invariants"}
        self.assertEqual(n["requests"], 200)
        self.assertGreater(n["host hit tokens"], 0)
        self.assertLess(n["host hit tokens"], n["prompt tokens"])
        pct = re.fullmatch(r"\d+ \((\d+)\.(\d) %\)", figures["host hit tokens"])
        self.assertIsNotNone(pct, figures["host hit tokens"])
        tenths = int(pct.group(1)) * 10 + int(pct.group(2))
        self.assertAlmostEqual(tenths / 1000, n["host hit tokens"] / n["prompt tokens"],
                               delta=0.0006)
        self.assertEqual(n["loaded blocks checked"] * 16, n["host hit tokens"])
        self.assertGreater(n["load jobs"], 0)
        self.assertGreater(n["store jobs"], 0)
        deferrals = re.fullmatch(
            r"(\d+) \(jobs in flight (\d+), store in flight (\d+), being loaded (\d+)\)",
            figures["deferrals"],
        )
        self.assertIsNotNone(deferrals, figures["deferrals"])
        total, *parts = map(int, deferrals.groups())
        self.assertGreater(total, 0)
        self.assertEqual(total, sum(parts))
        self.assertEqual(figures["invariants"], "ok")


if __name__ == "__main__":
    unittest.main()
