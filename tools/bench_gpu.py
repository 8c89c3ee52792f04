#!/usr/bin/env python3
"""The GPU benchmark (nvckpt/tools/bench_gpu.py): python3 tools/bench_gpu.py --out DIR [--smoke] [--workdir DIR]."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nvckpt.tools.bench_gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
