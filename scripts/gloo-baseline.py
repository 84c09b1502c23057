#!/usr/bin/env python3
"""The baseline that `distgrad bench --transport relay|direct` is compared with: PyTorch's gloo
backend, one process per rank, TCP on 127.0.0.1, measured the same way as distgrad's bench
(nccl-tests bus bandwidth, time per call between two barriers after one warm-up call, p50/p99 of
a 16-byte all_reduce over 2000 calls).

Needs PyTorch (any build: gloo runs on the CPU), e.g. `python3 -m venv /opt/gloo-venv &&
/opt/gloo-venv/bin/pip install torch`, then:

    /opt/gloo-venv/bin/python scripts/gloo-baseline.py --world 4 [--min-bytes 1048576]

Run it beside `distgrad bench` on the same machine, back to back: absolute figures drift
from run to run on a shared 2-core VM; the ratio is what the targets are about.
"""

import argparse
import os
import statistics
import sys
import time

# The helpers shared by the baseline scripts live in scripts/lib/ (importable module names).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from bench_sizes import fmt, sizes  # noqa: E402


def rank_main(rank, world, port, lo, hi, ops, q):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "all_gather": (world - 1) / world,
        "broadcast": 1.0,
    }
    for op in ops:
        for b in sizes(lo, hi):
            n = max(b // 4, 1)
            x = torch.full((n,), float(rank + 1))
            outs = [torch.empty(n) for _ in range(world)]

            def call():
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "all_gather":
                    dist.all_gather(outs, x)
                else:
                    dist.broadcast(x, 0)

            iters = min(max((256 << 20) // (n * 4), 5), 500)
            call()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            dist.barrier()
            t = (time.perf_counter() - t0) / iters
            size = n * 4 * (world if op == "all_gather" else 1)
            algbw = size / t / 1e9
            rows.append((op, size, t, algbw, algbw * factor[op]))
    lat = []
    x = torch.zeros(4)
    for _ in range(2000):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    if rank == 0:
        q.put((rows, lat[len(lat) // 2], lat[int(len(lat) * 0.99)]))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--min-bytes", type=int, default=4)
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--ops", default="all_reduce")
    a = ap.parse_args()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ops = a.ops.split(",")
    procs = [
        ctx.Process(target=rank_main, args=(r, a.world, port, a.min_bytes, a.max_bytes, ops, q))
        for r in range(a.world)
    ]
    for p in procs:
        p.start()
    rows, p50, p99 = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"# gloo (PyTorch), world={a.world}, processes on 127.0.0.1")
    print(f"{'op':>12} {'size':>12} {'time(us)':>12} {'algbw':>10} {'busbw':>10}")
    for op, size, t, algbw, busbw in rows:
        print(f"{op:>12} {fmt(size):>12} {t * 1e6:>12.1f} {algbw:>10.3f} {busbw:>10.3f}")
    print(f"# 16-byte all_reduce latency on rank 0: p50 {p50 * 1e6:.1f} us, p99 {p99 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
