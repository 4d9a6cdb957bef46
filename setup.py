"""Only the optional C accelerator of `ccld export` (ccld/export/_hotpath.c); everything else is in
pyproject.toml. `optional`: without a C compiler the install goes on and the export runs in Python.
The source's SHA-256 is built in (SOURCE_SHA256), so that accel.py can tell a module built from an
older _hotpath.c in this checkout (an edit without `make setup`) and not use it."""
import hashlib
import os

from setuptools import Extension, setup

SOURCE = "ccld/export/_hotpath.c"
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), SOURCE), "rb") as f:
    sha = hashlib.sha256(f.read()).hexdigest()

setup(ext_modules=[Extension("ccld.export._hotpath", [SOURCE], optional=True,
                             define_macros=[("HOTPATH_SOURCE_SHA256", f'"{sha}"')],
                             extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"])])
