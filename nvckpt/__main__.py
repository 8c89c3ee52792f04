"""``python -m nvckpt``: the nvckpt command line."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m nvckpt"))
