"""The compiled parts of nvckpt: the byte-plane kernel of the portable codec (nvckpt/codecs/_planes.c),
the host checks of derived tensors (nvckpt/plan/_derived.c) and the column reader of large indexes
(nvckpt/format/_columns.c).

All are optional: where no C compiler is found the install goes on, and nvckpt uses its numpy and
torch versions of the same steps (the same bytes and decisions, slower).  Everything else is in
pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(name, [source], optional=True, extra_compile_args=["-O3"])
                   for name, source in (("nvckpt.codecs._planes", "nvckpt/codecs/_planes.c"),
                                        ("nvckpt.plan._derived", "nvckpt/plan/_derived.c"),
                                        ("nvckpt.format._columns", "nvckpt/format/_columns.c"))])
