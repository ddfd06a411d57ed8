"""Build glue: setuptools needs ``cffi_modules`` passed to ``setup()``.

Everything else lives in pyproject.toml. The C core is compiled by the cffi build
script ``layerfs/_build_native.py`` into the private extension ``layerfs._native``.
"""

from setuptools import setup

setup(cffi_modules=["layerfs/_build_native.py:ffibuilder"])
