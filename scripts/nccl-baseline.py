#!/usr/bin/env python3
"""The baseline that `distgrad bench --transport nccl` is compared with: PyTorch's
torch.distributed with the NCCL backend on the same GPU(s), measured the way distgrad's NCCL bench
measures (all_reduce SUM of float32, sizes 1 KiB .. 1 GiB times 4, one warm-up call, then
`iters = clamp(2^30 / bytes, 5, 200)` calls between two stream synchronizations; algbw =
bytes / time). torch's all_reduce works in place; distgrad's "device" column is NCCL out of place
(send and receive buffers apart), its "staged" and "shared" columns go through distgrad's API.

    python3 scripts/nccl-baseline.py [--world N] [--min-bytes 1024] [--max-bytes 1073741824]
        [--distgrad FILE]

With --distgrad, FILE holds the output of `distgrad bench --transport nccl` from the same run:
each of its columns is then printed as a ratio to torch's out-of-place time at the same size
(torch time / distgrad time: above 1 means distgrad is faster).
"""

import argparse
import os
import re
import socket
import sys
import time

# The helpers shared by the baseline scripts live in scripts/lib/ (importable module names).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from bench_sizes import fmt, sizes  # noqa: E402


def rank_main(rank, world, port, lo, hi, q):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows = []
    for b in sizes(lo, hi):
        n = max(b // 4, 1)
        x = torch.ones(n, dtype=torch.float32, device="cuda")
        iters = min(max((1 << 30) // (n * 4), 5), 200)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t = (time.perf_counter() - t0) / iters
        # Out of place, as distgrad's API returns a new tensor: a copy, then the in-place call.
        y = torch.empty_like(x)
        y.copy_(x)
        dist.all_reduce(y)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            y.copy_(x)
            dist.all_reduce(y)
        torch.cuda.synchronize()
        to = (time.perf_counter() - t0) / iters
        rows.append((n * 4, t, to))
    if rank == 0:
        q.put((torch.__version__, torch.cuda.nccl.version(), torch.cuda.get_device_name(0), rows))
    dist.destroy_process_group()


def parse_distgrad(path):
    """size label -> {column: seconds} from a `distgrad bench --transport nccl` table."""
    out = {}
    unit = r"(\d+ (?:B|KiB|MiB))"
    num = r"([0-9.]+|-)"
    pat = re.compile(
        rf"^\s*{unit}\s+{num}\s+{num}\s+{num}\s+{num}\s+{num}\s+{num}\s+{num}\s+{num}\s*$"
    )
    with open(path) as f:
        for line in f:
            m = pat.match(line)
            if not m:
                continue
            g = m.groups()
            cols = {"device": g[1], "staged": g[5], "shared": g[7]}
            out[g[0]] = {k: float(v) * 1e-6 for k, v in cols.items() if v != "-"}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--min-bytes", type=int, default=1024)
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--distgrad", help="output of `distgrad bench --transport nccl`, same run")
    a = ap.parse_args()

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, a.world, port, a.min_bytes, a.max_bytes, q))
        for r in range(a.world)
    ]
    for p in procs:
        p.start()
    version, nccl, gpu, rows = q.get(timeout=600)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a torch rank failed (exit code {p.exitcode})")

    print(f"# torch.distributed NCCL baseline: torch {version}, NCCL {nccl}, {gpu}, world {a.world}")
    print("# torch: all_reduce in place (torch's API); copy+ar: a copy into a fresh buffer, then")
    print("# all_reduce on it (an out-of-place result, as distgrad's API gives); algbw = bytes / time")
    dg = parse_distgrad(a.distgrad) if a.distgrad else {}
    head = f"{'size':>10} {'torch(us)':>12} {'algbw':>10} {'copy+ar(us)':>12} {'algbw':>10}"
    if dg:
        head += f" {'device x':>9} {'staged x':>9} {'shared x':>9}"
        print("# x: torch's copy+ar time / distgrad's time at the same size (above 1: distgrad faster)")
    print(head)
    for b, t, to in rows:
        line = f"{fmt(b):>10} {t * 1e6:>12.1f} {b / t / 1e9:>10.2f} {to * 1e6:>12.1f} {b / to / 1e9:>10.2f}"
        if dg:
            d = dg.get(fmt(b), {})
            for col in ("device", "staged", "shared"):
                v = d.get(col)
                line += f" {to / v:>9.3f}" if v else f" {'-':>9}"
        print(line)
    if a.distgrad and not dg:
        print(f"# no distgrad rows could be read from {a.distgrad}")


if __name__ == "__main__":
    main()
