"""The Python example of README.md runs as written (keeps the README true)."""

import os
import re
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, os.pardir, os.pardir, "README.md")


class ReadmeTest(unittest.TestCase):
    def test_python_example_runs(self):
        with open(README, encoding="utf-8") as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
        self.assertTrue(blocks, "README.md has no Python example")
        for code in blocks:
            exec(compile(code, "README.md", "exec"), {})


if __name__ == "__main__":
    unittest.main()
