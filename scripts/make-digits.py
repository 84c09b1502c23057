#!/usr/bin/env python3
"""Write www/data/digits.bin from scikit-learn's copy of the UCI optical digits (test set).

Usage: scripts/make-digits.py [WHEEL_OR_CSV_GZ]   (default: downloads the scikit-learn wheel)

The 1,797 images of 8x8 pixels (integers 0..16) and their labels (0..9), in the order the source
lists them, as: the 8 bytes b"DGDIGIT1", the count as a little-endian u32, then per image its 64
pixels row by row (one byte each) and its label (one byte): 116,817 bytes. Source and licence:
www/data/README.md.
"""
import gzip
import hashlib
import io
import os
import struct
import subprocess
import sys
import tempfile
import zipfile

MEMBER = "sklearn/datasets/data/digits.csv.gz"


def csv_gz(source):
    if source.endswith(".csv.gz"):
        return open(source, "rb").read()
    return zipfile.ZipFile(source).read(MEMBER)


def main():
    if len(sys.argv) > 1:
        raw = csv_gz(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, "-m", "pip", "download", "scikit-learn==1.9.1",
                            "--no-deps", "--only-binary=:all:", "-d", d], check=True)
            wheel = [f for f in os.listdir(d) if f.endswith(".whl")][0]
            raw = csv_gz(os.path.join(d, wheel))
    rows = gzip.open(io.BytesIO(raw), "rt").read().strip().split("\n")
    out = bytearray(b"DGDIGIT1" + struct.pack("<I", len(rows)))
    for r in rows:
        v = [int(float(x)) for x in r.split(",")]
        assert len(v) == 65 and all(0 <= p <= 16 for p in v[:64]) and 0 <= v[64] <= 9, r
        out += bytes(v)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "www", "data", "digits.bin")
    open(path, "wb").write(out)
    print(f"{path}: {len(rows)} images, {len(out)} bytes, sha256 {hashlib.sha256(out).hexdigest()}")


if __name__ == "__main__":
    main()
