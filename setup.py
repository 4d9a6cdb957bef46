"""Only the optional C accelerator of `ccld export` (ccld/export/_hotpath.c); everything else is in
pyproject.toml. `optional`: without a C compiler the install goes on and the export runs in Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ccld.export._hotpath", ["ccld/export/_hotpath.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"])])
