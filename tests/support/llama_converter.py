"""llama.cpp's own `convert_hf_to_gguf.py`, found or fetched once, run on tiny checkpoints.

The converter is the one vendored in llama-cpp-python's sdist (`LLAMA_CPP_PYTHON`, the version
the benchmarks' llama-server is built from): `$FT_LLAMA_CONVERTER` when set (a
`convert_hf_to_gguf.py` beside its `conversion/` and `gguf-py/`), else the copy extracted into
`CONVERTER_CACHE` (`$FT_CONVERTER_CACHE`, default `~/.cache/ft-converter`) from the sdist that
`pip download` fetches from PyPI (about 75 MB and a minute, once). `find_converter` returns None
when neither works, and `HOW_TO_GET` says how to get it.

`convert` runs it with this interpreter (its requirements are ft's test extra: torch,
transformers, numpy, safetensors) on several checkpoints in one process. Two things differ from
running it by hand, both in its vocabulary step: the BPE pre-tokenizer is named instead of
recognized by the hash of a sample's tokens (a tiny vocabulary hashes to none it knows), and a
directory without `tokenizer.model` goes on to its `tokenizer.json` without importing
sentencepiece (what the converter does when sentencepiece is installed).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass

LLAMA_CPP_PYTHON = "0.3.36"
CONVERTER_CACHE = pathlib.Path(
    os.environ.get("FT_CONVERTER_CACHE", pathlib.Path.home() / ".cache" / "ft-converter")
).expanduser()
HOW_TO_GET = (
    "llama.cpp's convert_hf_to_gguf.py is not available: set FT_LLAMA_CONVERTER to one (beside its "
    f"conversion/ and gguf-py/), or let `pip download llama-cpp-python=={LLAMA_CPP_PYTHON} --no-deps "
    f"--no-binary :all:` reach PyPI (extracted into {CONVERTER_CACHE})"
)
DOWNLOAD_TIMEOUT_S = 600
_VENDORED = "vendor/llama.cpp/"
_NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Runs in the child: argv[1] the converter, argv[2] a JSON list of [checkpoint, outfile, pre, outtype,
# extra arguments].
_DRIVER = """
import json, runpy, sys, pathlib
converter = pathlib.Path(sys.argv[1])
sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
from conversion import base
sentencepiece_vocab = base.TextModel._create_vocab_sentencepiece
def _sentencepiece_or_none(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return sentencepiece_vocab(self)
base.TextModel._create_vocab_sentencepiece = _sentencepiece_or_none
main = runpy.run_path(str(converter))["main"]
for checkpoint, outfile, pre, outtype, extra in json.loads(sys.argv[2]):
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=pre: pre
    sys.argv = [str(converter), *extra, "--outtype", outtype, "--outfile", outfile, checkpoint]
    main()
"""


@dataclass(frozen=True)
class Conversion:
    """One checkpoint directory to convert to `outfile`, its BPE pre-tokenizer named `pre`
    (llama.cpp's names: "qwen2", "smollm", "llama-bpe"), its weights as `outtype` ("f32",
    "q8_0", ...), with the converter's other `args` ("--no-mtp")."""

    checkpoint: pathlib.Path
    outfile: pathlib.Path
    pre: str
    outtype: str = "f32"
    args: tuple[str, ...] = ()


def find_converter() -> pathlib.Path | None:
    """The converter script: `$FT_LLAMA_CONVERTER`, the cached copy, or one extracted now from
    the sdist `pip download` fetches; None when none can be had."""
    given = os.environ.get("FT_LLAMA_CONVERTER")
    if given:
        path = pathlib.Path(given).expanduser()
        return path if path.is_file() else None
    cached = CONVERTER_CACHE / LLAMA_CPP_PYTHON / "convert_hf_to_gguf.py"
    if cached.is_file():
        return cached
    CONVERTER_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CONVERTER_CACHE) as scratch:
        try:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", scratch],
                check=True, capture_output=True, timeout=DOWNLOAD_TIMEOUT_S,
            )  # fmt: skip
        except (subprocess.SubprocessError, OSError):
            return None
        (sdist,) = pathlib.Path(scratch).glob("llama_cpp_python-*.tar.gz")
        tree = pathlib.Path(scratch) / "tree"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.partition("/")[2].removeprefix(_VENDORED)
                if member.name.partition("/")[2].startswith(_VENDORED) and inner.startswith(_NEEDED):
                    member.name = inner
                    tar.extract(member, tree, filter="data")
        try:
            tree.rename(CONVERTER_CACHE / LLAMA_CPP_PYTHON)
        except OSError:  # another process extracted it first
            shutil.rmtree(tree, ignore_errors=True)
    return cached if cached.is_file() else None


def convert(converter: pathlib.Path, conversions: list[Conversion]) -> None:
    """Each checkpoint written by llama.cpp's converter as a GGUF (of its `outtype`), in one
    child process.

    Raises:
        RuntimeError: the converter failed (the message ends with its last output).
    """
    jobs = json.dumps(
        [[str(c.checkpoint), str(c.outfile), c.pre, c.outtype, list(c.args)] for c in conversions]
    )
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(converter), jobs], capture_output=True, text=True, timeout=600
    )
    if done.returncode:
        raise RuntimeError(f"{converter} failed ({done.returncode}):\n{done.stderr[-3000:]}")
