"""Kernel micro-benchmark (gather / laned / grouped / pallas); see jlora/kernels/bench.py."""

import sys

from jlora.kernels.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
