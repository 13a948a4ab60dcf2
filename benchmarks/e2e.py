"""End-to-end decode benchmark: ``kvbits bench`` without installing the package.

    PYTHONPATH=src python3 benchmarks/e2e.py --model llama-2-7b --contexts 1k,4k,16k,32k --out DIR

Every option of ``kvbits bench --help`` applies; the logic is in :mod:`kvbits.eval.speed`.
"""

import sys

from kvbits.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
