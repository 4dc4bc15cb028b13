"""Hatchling build hook: builds the shared library with cargo and puts it in the wheel.

Runs ``cargo build --release --lib --locked`` in the project root (``$CARGO`` or ``cargo`` on
PATH; ``$CARGO_TARGET_DIR`` is honoured), adds ``target/release/libkvoffload.so`` to the wheel as
``kvoffload/libkvoffload.so`` (where the loader looks first after ``KVOFFLOAD_LIB``) and tags
the wheel ``py3-none-<platform>``: the bindings are ctypes, so any Python 3 of that platform.
An editable install bundles nothing: the package then loads the checkout's development build.
"""

import os
import subprocess
import sys
import sysconfig

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

if sys.platform == "darwin":
    LIB_NAME = "libkvoffload.dylib"
elif sys.platform == "win32":
    LIB_NAME = "kvoffload.dll"
else:
    LIB_NAME = "libkvoffload.so"


class CargoBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        cargo = os.environ.get("CARGO", "cargo")
        cmd = [cargo, "build", "--release", "--lib", "--locked"]
        self.app.display_info(f"kvoffload: {' '.join(cmd)}")
        try:
            subprocess.run(cmd, cwd=self.root, check=True)
        except FileNotFoundError:
            raise RuntimeError(
                f"kvoffload: `{cargo}` not found; building the package needs a Rust toolchain "
                "(https://rustup.rs) or CARGO pointing at cargo"
            ) from None
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(
            ".", "_"
        )
        if version == "editable":
            return
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(self.root, "target")
        lib = os.path.join(target, "release", LIB_NAME)
        if not os.path.isfile(lib):
            raise RuntimeError(f"kvoffload: cargo built no {lib}")
        build_data["force_include"][lib] = f"kvoffload/{LIB_NAME}"
