"""A copy of a GGUF file with another chat template, the tensor bytes copied verbatim."""

from __future__ import annotations

import pathlib
import shutil
import struct

from gguf import GGUFReader, GGUFValueType

KEY = "tokenizer.chat_template"


def _string_kv(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", GGUFValueType.STRING, len(v)) + v


def with_chat_template(source: pathlib.Path, dest: pathlib.Path, template: str) -> pathlib.Path:
    """Write `source` to `dest` with its `tokenizer.chat_template` replaced by `template`.

    Only the metadata region moves: the tensor infos (whose offsets count from the aligned
    start of the data) follow it unchanged, padded to the file's alignment.
    """
    reader = GGUFReader(source)
    field = reader.fields[KEY]
    field_end = field.offset + sum(part.nbytes for part in field.parts)
    infos_end = max(t.field.offset + sum(part.nbytes for part in t.field.parts) for t in reader.tensors)
    with open(source, "rb") as f:
        head = f.read(reader.data_offset)
    meta = head[: field.offset] + _string_kv(KEY, template) + head[field_end:infos_end]
    padding = -len(meta) % reader.alignment
    with open(source, "rb") as src, open(dest, "wb") as out:
        out.write(meta + b"\0" * padding)
        src.seek(reader.data_offset)
        shutil.copyfileobj(src, out, 16 << 20)
    return dest
