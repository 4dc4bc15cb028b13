"""The Python classes take their defaults from the library (``kvo_*_config_default``), not from
copies of them."""

import ctypes
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import kvoffload  # noqa: E402
from kvoffload import _ffi  # noqa: E402


class DefaultsTest(unittest.TestCase):
    def test_scheduler_defaults_are_the_librarys(self):
        want = _ffi.kvo_scheduler_config()
        _ffi.lib.kvo_scheduler_config_default(ctypes.byref(want))
        with kvoffload.Scheduler(num_slots=8) as s:
            self.assertEqual(
                (s.key_len, s.gpu_block_size), (want.key_len, want.gpu_block_size)
            )

    def test_manager_defaults_are_the_librarys(self):
        want = _ffi.kvo_manager_config()
        _ffi.lib.kvo_manager_config_default(ctypes.byref(want))
        with kvoffload.Manager(num_slots=8) as m:
            self.assertEqual(m.key_len, want.key_len)


if __name__ == "__main__":
    unittest.main()
