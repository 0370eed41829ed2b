"""Output tokens/s at 1, 4 and 16 concurrent requests: `ft bench` as a script.

python tools/bench_engine.py [--concurrency 1 4 16] [--max-tokens 128] [--model PATH]
"""

from __future__ import annotations

import argparse
import sys

from ft.bench import add_bench_arguments, run_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_bench_arguments(parser)
    sys.exit(run_bench(parser.parse_args()))
