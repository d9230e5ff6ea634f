"""The header of a GGUF file, read in well under a second: metadata scalars and where the tensor data ends.

``gguf.GGUFReader`` parses every metadata array element by element (a 262,144-token
vocabulary takes it more than a minute on a busy CPU). Checking a file only
needs a few scalars (``general.architecture``, ``general.name``,
``general.alignment``) and the tensor table, so :func:`read_header` steps over
arrays without decoding them and computes each tensor's byte size from its
shape and quantization type (``gguf.constants.GGML_QUANT_SIZES``). The layout
followed is GGUF versions 2 and 3: magic ``GGUF``, version (u32), tensor count
(u64), metadata count (u64), the metadata, the tensor infos, then the tensor
data, aligned.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GgufHeader", "HeaderError", "read_header"]

#: Bytes of each fixed-size metadata value type (GGUFValueType numbering); 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: The metadata read as values; everything else is stepped over.
_WANTED = ("general.architecture", "general.name", "general.alignment")


class HeaderError(ValueError):
    """The file is not a GGUF file this reader understands, or it ends inside its header."""


@dataclass(frozen=True)
class GgufHeader:
    """What :func:`read_header` found.

    Attributes
    ----------
    version : int
        The GGUF version.
    metadata : dict
        The scalar metadata of :data:`_WANTED` that the file holds.
    tensors : int
        The number of tensors.
    data_end : int
        The byte offset where the last tensor's data ends: the file must be
        at least this long.
    """

    version: int
    metadata: dict
    tensors: int
    data_end: int


class _Cursor:
    def __init__(self, view: memoryview) -> None:
        self.view, self.at = view, 0

    def take(self, size: int) -> memoryview:
        if self.at + size > len(self.view):
            raise HeaderError(f"the file ends at byte {len(self.view)} inside its header (truncated)")
        piece = self.view[self.at : self.at + size]
        self.at += size
        return piece

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[kind])
        elif kind == _STRING:
            self.take(self.unpack("<Q"))
        elif kind == _ARRAY:
            inner, count = self.unpack("<I"), self.unpack("<Q")
            if inner in _SCALAR_SIZES:
                self.take(_SCALAR_SIZES[inner] * count)
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            raise HeaderError(f"unknown metadata value type {kind} at byte {self.at}")

    def value(self, kind: int):
        if kind in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[kind])
        if kind == _STRING:
            return self.string()
        self.skip_value(kind)
        return None


def read_header(path: Path) -> GgufHeader:
    """Read a GGUF file's header (see the module docstring).

    Parameters
    ----------
    path : Path
        The file.

    Raises
    ------
    HeaderError
        If the file does not start with ``GGUF``, has a version other than 2
        or 3, uses a tensor type this ``gguf`` package does not know, or ends
        inside its header.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise HeaderError("it does not start with the bytes 'GGUF'")
        handle.seek(0)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            with memoryview(mapped) as view:
                cursor = _Cursor(view)
                cursor.take(4)
                version = cursor.unpack("<I")
                if version not in (2, 3):
                    raise HeaderError(f"GGUF version {version} is not one this reader knows (2 or 3)")
                tensors, entries = cursor.unpack("<Q"), cursor.unpack("<Q")
                metadata = {}
                for _ in range(entries):
                    key, kind = cursor.string(), cursor.unpack("<I")
                    if key in _WANTED:
                        metadata[key] = cursor.value(kind)
                    else:
                        cursor.skip_value(kind)
                extent = 0
                for _ in range(tensors):
                    cursor.string()
                    dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
                    kind, offset = cursor.unpack("<I"), cursor.unpack("<Q")
                    try:
                        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                    except (ValueError, KeyError):
                        raise HeaderError(f"tensor type {kind} is unknown to the installed gguf package") from None
                    elements = 1
                    for dim in dims:
                        elements *= dim
                    extent = max(extent, offset + elements // block * block_bytes)
                alignment = int(metadata.get("general.alignment") or 32)
                start = -(-cursor.at // alignment) * alignment
                del cursor
    return GgufHeader(version, metadata, tensors, start + extent)
