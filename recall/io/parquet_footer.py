"""Just enough of the Parquet footer to lay row groups that were encoded apart end to end in one file.

A Parquet file is ``PAR1``, the column chunks of its row groups, the footer (a Thrift ``FileMetaData`` in the compact
protocol), the footer's length (4 bytes, little-endian) and ``PAR1`` again. Pages hold no file positions; only the
footer does (where each column chunk starts), and the optional page index (its offset index), which is not supported
here. So row groups encoded on several threads, each into a small Parquet file in memory, make one valid file when
their bytes are copied one after the other and their footers merged with every position shifted by where the bytes
landed. pyarrow encodes in one thread per file and cannot write a footer, hence this module: a generic decoder and
encoder of the compact protocol (decoding then encoding gives the same bytes), and the few position fields of
``parquet.thrift`` that move.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

MAGIC = b"PAR1"

# Compact-protocol type codes.
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)

# Field ids in parquet.thrift.
_FILE_NUM_ROWS, _FILE_ROW_GROUPS = 3, 4
_GROUP_COLUMNS, _GROUP_FILE_OFFSET, _GROUP_ORDINAL = 1, 5, 7
_CHUNK_FILE_OFFSET, _CHUNK_META, _CHUNK_OFFSET_INDEX, _CHUNK_COLUMN_INDEX = 2, 3, 4, 6
# ColumnMetaData: data_page_offset, index_page_offset, dictionary_page_offset, bloom_filter_offset.
_META_POSITIONS = (9, 10, 11, 14)


class Field(NamedTuple):
    """One field of a Thrift struct: its id, its compact type code and its decoded value."""

    id: int
    type: int
    value: Any


@dataclass
class Collection:
    """A decoded list or set (``key_type`` None) or map (``items`` then holds (key, value) pairs)."""

    type: int
    elem_type: int
    items: list
    key_type: int | None = None


# --------------------------------------------------------------------------------------------------------------------
# Decoding


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def byte(self) -> int:
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def raw(self, n: int) -> bytes:
        out = bytes(self.buf[self.pos:self.pos + n])
        if len(out) != n:
            raise ValueError("truncated Thrift data")
        self.pos += n
        return out

    def value(self, t: int) -> Any:
        if t in (_TRUE, _FALSE, _BYTE):  # a bool inside a collection is one byte, as is a BYTE
            return self.byte()
        if t in (_I16, _I32, _I64):
            return self.zigzag()
        if t == _DOUBLE:
            return self.raw(8)
        if t == _BINARY:
            return self.raw(self.varint())
        if t in (_LIST, _SET):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            elem = head & 0x0F
            return Collection(t, elem, [self.value(elem) for _ in range(size)])
        if t == _MAP:
            size = self.varint()
            kinds = self.byte() if size else 0
            key, val = kinds >> 4, kinds & 0x0F
            return Collection(t, val, [(self.value(key), self.value(val)) for _ in range(size)], key)
        if t == _STRUCT:
            return self.struct()
        raise ValueError(f"unknown Thrift compact type {t} at byte {self.pos}")

    def struct(self) -> list[Field]:
        fields: list[Field] = []
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, t = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            last = fid
            fields.append(Field(fid, t, t == _TRUE if t in (_TRUE, _FALSE) else self.value(t)))


def decode_struct(buf: bytes) -> list[Field]:
    """A compact-protocol struct as a list of :class:`Field` (nested structs likewise), in encoding order."""
    return _Reader(buf).struct()


# --------------------------------------------------------------------------------------------------------------------
# Encoding


def _varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(out: bytearray, n: int) -> None:
    _varint(out, (n << 1) ^ (n >> 63))


def _value(out: bytearray, t: int, v: Any) -> None:
    if t in (_TRUE, _FALSE, _BYTE):
        out.append(v)
    elif t in (_I16, _I32, _I64):
        _zigzag(out, v)
    elif t == _DOUBLE:
        out += v
    elif t == _BINARY:
        _varint(out, len(v))
        out += v
    elif t in (_LIST, _SET):
        size = len(v.items)
        if size < 15:
            out.append(size << 4 | v.elem_type)
        else:
            out.append(0xF0 | v.elem_type)
            _varint(out, size)
        for item in v.items:
            _value(out, v.elem_type, item)
    elif t == _MAP:
        _varint(out, len(v.items))
        if v.items:
            out.append(v.key_type << 4 | v.elem_type)
        for key, val in v.items:
            _value(out, v.key_type, key)
            _value(out, v.elem_type, val)
    elif t == _STRUCT:
        _struct(out, v)
    else:
        raise ValueError(f"unknown Thrift compact type {t}")


def _struct(out: bytearray, fields: list[Field]) -> None:
    last = 0
    for f in fields:
        t = f.type if f.type not in (_TRUE, _FALSE) else (_TRUE if f.value else _FALSE)
        delta = f.id - last
        if 0 < delta <= 15:
            out.append(delta << 4 | t)
        else:
            out.append(t)
            _zigzag(out, f.id)
        if t not in (_TRUE, _FALSE):
            _value(out, t, f.value)
        last = f.id
    out.append(0)


def encode_struct(fields: list[Field]) -> bytes:
    """The compact-protocol bytes of a struct decoded by :func:`decode_struct`."""
    out = bytearray()
    _struct(out, fields)
    return bytes(out)


# --------------------------------------------------------------------------------------------------------------------
# Files


def split_file(buf: Any) -> tuple[memoryview, list[Field]]:
    """A whole Parquet file in memory as (its column-chunk bytes, its decoded ``FileMetaData``).

    The column-chunk bytes start at file position 4 (after the leading ``PAR1``).

    Raises
    ------
    ValueError
        Not a Parquet file.
    """
    view = memoryview(buf).cast("B")  # unsigned bytes whatever the exporter says (pyarrow's Buffer says signed)
    if len(view) < 12 or view[:4] != MAGIC or view[-4:] != MAGIC:
        raise ValueError("not a Parquet file")
    footer_len = struct.unpack("<I", view[-8:-4])[0]
    footer_start = len(view) - 8 - footer_len
    return view[4:footer_start], decode_struct(view[footer_start:-8])


def _field(fields: list[Field], fid: int) -> Field | None:
    return next((f for f in fields if f.id == fid), None)


def _shifted(fields: list[Field], ids: tuple[int, ...], delta: int) -> list[Field]:
    # 0 is no position (pyarrow writes the deprecated ColumnChunk.file_offset as 0): it stays 0.
    return [f._replace(value=f.value + delta) if f.id in ids and f.value else f for f in fields]


def row_groups(meta: list[Field]) -> list[list[Field]]:
    """The ``RowGroup`` structs of a decoded ``FileMetaData``."""
    f = _field(meta, _FILE_ROW_GROUPS)
    return f.value.items if f is not None else []


def num_rows(meta: list[Field]) -> int:
    """``FileMetaData.num_rows``."""
    return _field(meta, _FILE_NUM_ROWS).value


def move_row_group(group: list[Field], delta: int, ordinal: int) -> list[Field]:
    """A ``RowGroup`` whose column chunks moved ``delta`` bytes further into the file, now the ``ordinal``-th.

    Raises
    ------
    ValueError
        A column chunk has an offset index: its page positions are inside it, not in the footer.
    """
    out = []
    for f in group:
        if f.id == _GROUP_COLUMNS:
            chunks = []
            for chunk in f.value.items:
                if _field(chunk, _CHUNK_OFFSET_INDEX) is not None:
                    raise ValueError("cannot move a row group with a page index (write_page_index=False)")
                chunk = _shifted(chunk, (_CHUNK_FILE_OFFSET, _CHUNK_COLUMN_INDEX), delta)
                chunks.append([c._replace(value=_shifted(c.value, _META_POSITIONS, delta)) if c.id == _CHUNK_META
                               else c for c in chunk])
            f = f._replace(value=Collection(f.value.type, f.value.elem_type, chunks))
        elif f.id == _GROUP_FILE_OFFSET:
            f = f._replace(value=f.value + delta)
        elif f.id == _GROUP_ORDINAL:
            f = f._replace(value=ordinal)
        out.append(f)
    return out


def footer(template: list[Field], groups: list[list[Field]], n_rows: int) -> bytes:
    """The end of a file: ``template`` (a decoded ``FileMetaData`` of the same schema and writer options) with
    ``groups`` as its row groups and ``n_rows`` rows, then its length and ``PAR1``."""
    meta = []
    for f in template:
        if f.id == _FILE_NUM_ROWS:
            f = f._replace(value=n_rows)
        elif f.id == _FILE_ROW_GROUPS:
            f = f._replace(value=Collection(_LIST, _STRUCT, groups))
        meta.append(f)
    body = encode_struct(meta)
    return body + struct.pack("<I", len(body)) + MAGIC
