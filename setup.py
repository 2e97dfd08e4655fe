"""The one thing pyproject.toml cannot say on every setuptools version: the C checksum loop (lazyckpt/format/checksum.py
says why it is C). Everything else about the package lives in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("lazyckpt.format._native.lzc64", ["lazyckpt/format/_native/lzc64.c"], extra_compile_args=["-O3"])])
