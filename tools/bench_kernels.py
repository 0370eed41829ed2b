"""The products alone: ft's kernels against ggml's (llama.cpp's CPU backend) at a model's shapes.

    python tools/bench_kernels.py [--dir DIR] [--types Q4_0,Q4_K_M,...] [--rows 1,16,512]

For each 1B file of `make-bench-models.sh` (`--dir`, default $DEST/bench-models) and each of its
ffn_gate (8192 x 2048) and ffn_down (2048 x 8192) shapes: ft's `gemm_into` on the file's own
weights (repacked as the engine loads them, the activations' quantization counted), and ggml's
`mul_mat` on random weights of the same type (repacked when ggml's CPU backend repacks that
type, as llama.cpp does when it loads a model; its activations' quantization counted too), at 1,
16 and 512 rows, two threads, the fastest of many runs. A weight of these shapes fits the L3
cache: this compares the kernels' arithmetic, not the memory's bandwidth. Needs the static ggml
libraries and headers of build-llama-server.sh (`DEST`, default /tmp/llama-anchor) and g++.
Prints one JSON line per product and a Markdown table. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ft.model import kernels
from ft.model.quant import QuantTensor

DEST = Path(os.environ.get("DEST", "/tmp/llama-anchor"))
SOURCE = Path(__file__).with_name("ggml_mul_mat.cpp")
# file suffix -> the GGUF type of its ffn_gate weights (the mix's main type)
FILES = {
    "Q4_0": "Q4_0",
    "Q8_0": "Q8_0",
    "Q4_K_M": "Q4_K",
    "Q5_K_M": "Q5_K",
    "Q6_K": "Q6_K",
    "IQ4_XS": "IQ4_XS",
}
SHAPES = ("ffn_gate", "ffn_down")


def build_ggml_tool() -> Path:
    src = next(DEST.glob("llama_cpp_python-*/vendor/llama.cpp"))
    libs = DEST / "build" / "ggml" / "src"
    out = DEST / "build" / "bin" / "ggml_mul_mat"
    if not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(
            ["g++", "-O2", "-std=c++17", str(SOURCE), f"-I{src / 'ggml' / 'include'}", "-o", str(out),
             str(libs / "libggml.a"), str(libs / "libggml-cpu.a"), str(libs / "libggml-base.a"),
             "-fopenmp", "-lpthread", "-ldl", "-lm"],
            check=True,
        )  # fmt: skip
    return out


def ours(path: Path, qtype: str, shape: str, rows: list[int], threads: int) -> list[dict[str, Any]]:
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if shape in t.name and t.tensor_type.name == qtype)
    n_out, k = int(t.shape[1]), int(t.shape[0])
    data = torch.from_numpy(np.array(t.data)).contiguous().view(n_out, -1)
    weight = kernels.repacked(QuantTensor(data, int(t.tensor_type), k))
    torch.set_num_threads(threads)
    results = []
    for n in rows:
        x, out = torch.randn(n, k), torch.empty(n, n_out)
        times = []
        for i in range(53 if n < 64 else 11):
            start = time.perf_counter()
            kernels.gemm_into(out, weight, kernels.QuantizedActivations(x))
            if i >= 3:  # (warm-up)
                times.append(time.perf_counter() - start)
        best = round(min(times) * 1e6, 1)
        results.append({"side": "ft", "type": qtype, "m": n_out, "k": k, "n": n, "us_min": best})
    return results


def ggml(tool: Path, qtype: str, m: int, k: int, rows: list[int], threads: int) -> list[dict[str, Any]]:
    results = []
    for n in rows:
        name = qtype.lower().replace("_k", "_K")  # ggml's type names: q4_K, iq4_xs
        cmd = [str(tool), name, str(m), str(k), str(n), str(threads), "50" if n < 64 else "8"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        line = json.loads(out.stdout.strip().splitlines()[-1])
        results.append({"side": "ggml", "type": qtype, "m": m, "k": k, "n": n, "us_min": line["us_min"],
                        "buffer": line["buffer"]})  # fmt: skip
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEST / "bench-models")
    ap.add_argument("--types", default=",".join(FILES), help="file suffixes (1B files)")
    ap.add_argument("--rows", default="1,16,512")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tool = build_ggml_tool()
    rows = [int(n) for n in args.rows.split(",")]
    table = []
    for suffix in args.types.split(","):
        qtype = FILES[suffix]
        for shape in SHAPES:
            mine = ours(args.dir / f"llama-1b-{suffix}.gguf", qtype, shape, rows, args.threads)
            theirs = ggml(tool, qtype, int(mine[0]["m"]), int(mine[0]["k"]), rows, args.threads)
            for a, b in zip(mine, theirs, strict=True):
                print(json.dumps(a), json.dumps(b), flush=True)
                table.append((qtype, f"{a['m']} x {a['k']}", a["n"], a["us_min"], b["us_min"], b["buffer"]))
    print("\n| type | weight | rows | ft us | ggml us | ggml's buffer | ggml / ft |")
    print("|---|---|---|---|---|---|---|")
    for qtype, shape, n, a, b, buffer in table:
        print(f"| {qtype} | {shape} | {n} | {a:.0f} | {b:.0f} | {buffer} | **{float(b) / float(a):.2f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
