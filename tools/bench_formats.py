"""Engine-level speed of GGUF files against llama.cpp's own benchmarks, one file at a time.

    python tools/bench_formats.py F.gguf [F2.gguf ...] [--tokens 64] [--streams 16] [--prefill 512]

For each file, on the same machine in the same command (ft first, then llama.cpp, then the next
file): `ft bench` at 1 and `--streams` concurrent requests and one `--prefill`-token prompt,
`llama-bench` (tg at one stream, pp of the same prompt length) and `llama-batched-bench` at
`--streams` parallel sequences. Prints one JSON line per file and a Markdown table of the ratios
ft / llama.cpp (higher is better). Generation rates on both sides count the tokens after every
sequence's first (ft bench's `decode_tokens_per_s`, llama.cpp's tg and S_TG): prefill excluded.
The llama.cpp tools come from build-llama-server.sh (`DEST`, default /tmp/llama-anchor). Run on
a quiet machine: a busy core changes a step by up to 7x.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

BIN = Path(os.environ.get("DEST", "/tmp/llama-anchor")) / "build" / "bin"


def run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{cmd[0]} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return out.stdout


def ft_side(model: str, tokens: int, streams: int, prefill: int, threads: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "ft", "bench", "--model", model, "--concurrency", "1", str(streams)]
    cmd += ["--max-tokens", str(tokens), "--prefill", str(prefill), "--compute-threads", str(threads)]
    result = json.loads(run(cmd).strip().splitlines()[-1])
    levels = {level["concurrency"]: level for level in result["levels"]}
    return {
        "tg1": levels[1]["decode_tokens_per_s"],
        "tgN": levels[streams]["decode_tokens_per_s"],  # as llama-batched-bench S_TG: prefill excluded
        "pp": result["prefill"]["prompt_tokens_per_s"],
    }


def llama_side(model: str, tokens: int, streams: int, prefill: int, threads: int) -> dict[str, float]:
    bench = json.loads(run([str(BIN / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(prefill),
                            "-n", str(tokens), "-o", "json"]))  # fmt: skip
    tg = next(r["avg_ts"] for r in bench if r["n_gen"] > 0)
    pp = next(r["avg_ts"] for r in bench if r["n_prompt"] > 0)
    batched = run([str(BIN / "llama-batched-bench"), "-m", model, "-t", str(threads), "-c", "8192",
                   "-npp", "32", "-ntg", str(tokens), "-npl", str(streams),
                   "--output-format", "jsonl"])  # fmt: skip
    rows = [json.loads(line) for line in batched.splitlines() if line.startswith("{")]
    tgn = rows[-1]["speed_tg"] if rows else float("nan")
    return {"tg1": tg, "tgN": tgn, "pp": pp}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    table = [f"| file | ft tg1 | llama tg1 | ratio | ft tg{args.streams} | llama tg{args.streams} | ratio "
             f"| ft pp{args.prefill} | llama pp{args.prefill} | ratio |", "|---" * 10 + "|"]  # fmt: skip
    for model in args.models:
        ft = ft_side(model, args.tokens, args.streams, args.prefill, args.threads)
        peer = llama_side(model, args.tokens, args.streams, args.prefill, args.threads)
        print(json.dumps({"model": model, "ft": ft, "llama.cpp": peer}), flush=True)
        cells = [f"{ft[k]:.1f} | {peer[k]:.1f} | **{ft[k] / peer[k]:.2f}x**" for k in ("tg1", "tgN", "pp")]
        table.append(f"| {re.sub(r'.*/', '', model)} | " + " | ".join(cells) + " |")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
