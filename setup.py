"""The one compiled part of nvckpt: the byte-plane kernel of the portable codec (nvckpt/codecs/_planes.c).

It is optional: where no C compiler is found the install goes on, and the codec uses its numpy
version of the same steps (the same bytes, 2.5-3.5x slower).  Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("nvckpt.codecs._planes", ["nvckpt/codecs/_planes.c"], optional=True,
                             extra_compile_args=["-O3"])])
