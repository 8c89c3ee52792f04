"""Tools behind the ``nvckpt`` command line: info, verify, convert, recover, demo, bench.

Each tool is a plain function that returns a report object, so it can be used
from Python as well as from ``nvckpt.cli``.
"""
