"""The size ladder and size labels of `distgrad bench`, for the baseline scripts of scripts/
(gloo-baseline.py and nccl-baseline.py put this folder on sys.path and import it): sizes from
`lo` to `hi` bytes, times 4 each step (nccl-tests' -f 4), labelled as distgrad labels them, so
rows of both match by their label."""


def sizes(lo, hi):
    s, out = max(lo, 4), []
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def fmt(b):
    if b >= 1 << 20:
        return f"{b >> 20} MiB"
    if b >= 1 << 10:
        return f"{b >> 10} KiB"
    return f"{b} B"
