#!/usr/bin/python3
"""Writes tests/fixtures/io-python.safetensors, the file test-io reads to check that rtp
understands safetensors written by another implementation.

Regenerate with:  /usr/bin/python3 scripts/gen-io-fixture.py
(no third-party packages: the file is written by hand with struct + json, the way the
safetensors format is specified: 8-byte little-endian header length, JSON header padded
with spaces to an 8-byte boundary, raw little-endian data).

The header lists tensors in sorted order while the data section holds them in another
order, names use JSON escapes (quotes, non-ASCII as \\uXXXX, a surrogate pair), and there
are a 0-d tensor, a zero-size tensor, I32 extremes and metadata with escapes. test-io.cpp
checks the exact values below; keep them in sync.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "io-python.safetensors")

# name -> (dtype, shape, flat values); the data section is written in this order.
TENSORS = [
    ("d.4d", "F32", [2, 1, 3, 2], [float(i) for i in range(12)]),
    ("b.i32", "I32", [7], [-2147483648, -1, 0, 1, 2147483647, 42, 7]),
    ("a.f32", "F32", [3, 5], [i * 0.5 - 3.0 for i in range(15)]),
    ("c.scalar", "F32", [], [3.25]),
    ("e.empty", "F32", [0], []),
    ('name "quoted" \u00e9 \U0001F600', "F32", [2], [1.5, -2.5]),
]
METADATA = {"format": "pt", "note": "line1\nline2 \u00e9"}


def main():
    fmt = {"F32": "<f", "I32": "<i"}
    header = {"__metadata__": METADATA}
    data = b""
    for name, dtype, shape, vals in TENSORS:
        raw = b"".join(struct.pack(fmt[dtype], v) for v in vals)
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header = {k: header[k] for k in sorted(header)}  # header order != data order
    h = json.dumps(header, ensure_ascii=True).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    with open(OUT, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    print(f"wrote {os.path.normpath(OUT)}: {8 + len(h) + len(data)} bytes, "
          f"{len(TENSORS)} tensors, header {len(h)} bytes")


if __name__ == "__main__":
    main()
