"""GGUF metadata read directly, without gguf-py: the engine's model reader (engine/gguf_model.py) and the
tokenizer's (common/tokenizer.py, which the gateway may use without the engine) share this walk.

One pass over the header and the metadata, with every count bounded by the bytes left before anything
is built from it (a corrupt count must not loop for ages or allocate the world). Numeric arrays are read
with numpy in one call and strings sliced straight from the mapping: gguf-py's reader builds several
numpy views per element, which took 5-10 s for a 49k-token vocabulary. Values are plain Python objects,
as gguf-py's ``contents()`` gives them (tests/engine/test_gguf_reader.py holds the two equal).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUF_MAGIC", "GGUFError", "Walker", "check_header", "read_header", "read_kv", "read_metadata"]

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the file and the problem named."""

    def __init__(self, path: str | os.PathLike[str], problem: str, code: int = 0) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem
        self.code = code  # the C status when the C engine refused the model, else 0


# GGUFValueType -> size in bytes, struct format, numpy dtype
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
_T_STRING, _T_ARRAY, _T_UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")


class Walker:
    """A bounds-checked cursor over a GGUF file's bytes: every read names what it reads, and any read past the
    end or any impossible count raises :class:`GGUFError` before anything is allocated from it."""

    def __init__(self, path: Path, buf: Any, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(self.path, f"corrupt GGUF: {what} (at byte {self.pos})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(self.path, f"truncated or corrupt GGUF: {what} needs {n} bytes at byte {self.pos}, "
                                       f"file has {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self, what: str) -> bytes:
        n = self.u64(f"{what} length")
        self.need(n, what)
        v = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return v

    def text(self, what: str) -> str:
        """A string that must be UTF-8 (keys, names, string values: gguf-py decodes them strictly too)."""
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e.reason} at byte {e.start} of it)") from None

    def unique(self, name: str, seen: set[str], what: str) -> str:
        if name in seen:
            raise self.fail(f"duplicate {what} {name[:80]!r}")
        seen.add(name)
        return name

    def count(self, n: int, min_item: int, what: str) -> int:
        if n * min_item > self.size - self.pos:
            raise self.fail(f"{what} {n} cannot fit in the {self.size - self.pos} bytes left")
        return n

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` length-prefixed UTF-8 strings (a vocabulary: one tight loop, no per-item objects but the str)."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(n):
                if pos + 8 > size:
                    self.pos = pos
                    self.need(8, f"{what} item length")
                (ln,) = unpack(buf, pos)
                pos += 8
                if ln > size - pos:
                    self.pos = pos
                    self.need(ln, f"{what} item")
                append(buf[pos:pos + ln].decode("utf-8"))
                pos += ln
        except UnicodeDecodeError as e:
            self.pos = pos
            raise self.fail(f"{what}: item {len(out)} is not UTF-8 ({e.reason})") from None
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """One metadata value, as a Python object (scalars, str, lists)."""
        if vtype in _SCALAR_SIZES:
            size = _SCALAR_SIZES[vtype]
            self.need(size, what)
            (v,) = struct.unpack_from(_SCALAR_FMT[vtype], self.buf, self.pos)
            self.pos += size
            return v
        if vtype == _T_STRING:
            return self.text(what)
        if vtype == _T_ARRAY:
            if depth >= 3:
                raise self.fail(f"{what}: arrays nested too deep")
            itype = self.u32(f"{what} item type")
            n = self.u64(f"{what} length")
            if itype in _SCALAR_SIZES:
                self.count(n, _SCALAR_SIZES[itype], f"{what} length")
                # tolist() copies: no view of the mapping outlives the walk
                items = np.frombuffer(self.buf, _SCALAR_DTYPE[itype], n, self.pos).tolist()
                self.pos += n * _SCALAR_SIZES[itype]
                return items
            if itype == _T_STRING:
                self.count(n, 8, f"{what} length")
                return self.strings(n, what)
            if itype == _T_ARRAY:
                self.count(n, 12, f"{what} length")
                return [self.value(itype, what, depth + 1) for _ in range(n)]
            raise self.fail(f"{what}: array of unknown type {itype}")
        raise self.fail(f"{what}: unknown value type {vtype}")


def check_header(path: Path) -> None:
    """The file exists, is a regular file and starts with the GGUF magic."""
    if not path.exists():
        raise GGUFError(path, "file not found")
    if not path.is_file():
        raise GGUFError(path, "not a regular file")
    with path.open("rb") as fh:
        head = fh.read(24)
    if len(head) < 8:
        raise GGUFError(path, f"file too short to be GGUF ({len(head)} bytes)")
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(path, f"bad magic {head[:4]!r}, expected {GGUF_MAGIC!r}: not a GGUF file")


def read_header(w: Walker, unsupported: type[GGUFError] = GGUFError) -> tuple[int, int, int]:
    """(version, tensor count, metadata count) from the bytes after the magic; ``unsupported`` is raised for
    a big-endian file (a valid GGUF that is not read here)."""
    w.pos = 4
    version = w.u32("version")
    if version not in (2, 3):
        if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise unsupported(w.path, "big-endian GGUF files are not supported")
        raise GGUFError(w.path, f"unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors = w.count(w.u64("tensor count"), 8 + 4 + 8 + 4 + 8, "tensor count")
    n_kv = w.count(w.u64("metadata count"), 8 + 4 + 1, "metadata count")
    return version, n_tensors, n_kv


def read_kv(w: Walker, version: int, n_tensors: int, n_kv: int) -> tuple[dict[str, Any], int]:
    """The metadata as ``{key: value}`` in file order, the header first as gguf-py lists it (``GGUF.version``,
    ``GGUF.tensor_count``, ``GGUF.kv_count``), and the data alignment (``general.alignment``, default 32)."""
    md: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    alignment = 32
    keys: set[str] = set()
    for i in range(n_kv):
        key = w.unique(w.text(f"metadata key {i}"), keys, "metadata key")
        vtype = w.u32(f"type of {key[:80]!r}")
        v = w.value(vtype, f"value of {key[:80]!r}")
        if key == "general.alignment":
            if vtype != _T_UINT32 or not isinstance(v, int) or v == 0 or v & (v - 1):
                raise w.fail("general.alignment must be a uint32 power of two")
            alignment = v
        md[key] = v
    return md, alignment


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata field of a GGUF file (no tensor is read); GGUFError or OSError when it cannot be read."""
    path = Path(path)
    check_header(path)
    size = path.stat().st_size
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        w = Walker(path, buf, size)
        md, _ = read_kv(w, *read_header(w))
    return md
