"""The one thing pyproject.toml cannot say on every setuptools version: the C checksum loop (lazyckpt/checksum.py
says why it is C). Everything else about the package lives in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("lazyckpt._native.lzc64", ["lazyckpt/_native/lzc64.c"], extra_compile_args=["-O3"])])
