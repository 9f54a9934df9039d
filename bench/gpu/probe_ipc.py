"""Device probe: can two processes on this GPU share memory through CUDA IPC, and at what speed?

    python3 -m bench.gpu.probe_ipc

A spawned child allocates 1 GiB on the device, fills it and hands it over a
``torch.multiprocessing`` queue (torch sends a CUDA IPC handle); this process opens it and
copies it into its own buffer with one ``copy_`` and with an ``index_select`` of 4 MiB rows in a
scattered order, each timed with CUDA events against a copy between two local buffers of the
same size. Prints one line per measurement and ``IPC: ok`` or ``IPC: failed`` with the error.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

NBYTES = 1 << 30
ROW = 4 << 20  # one 8B-shape KV block (32 layers x 2 x 8 heads x 32 tokens x 128 x bf16)


def _child(q: object, done: object) -> None:
    t = torch.arange(NBYTES // 2, dtype=torch.int16, device="cuda").view(torch.uint8)
    torch.cuda.synchronize()
    q.put(t)  # type: ignore[attr-defined]
    done.wait(120)  # type: ignore[attr-defined]


def _timed(fn: object, reps: int = 5) -> float:
    fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()  # type: ignore[operator]
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    if not torch.cuda.is_available():
        print("IPC: skipped (no CUDA)")
        return 0
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_child, args=(q, done), daemon=True)
    p.start()
    try:
        t0 = time.perf_counter()
        peer = q.get(timeout=60)
        opened = time.perf_counter() - t0
        local = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
        other = torch.empty_like(local)
        ok = torch.equal(peer[:1 << 20].view(torch.int16)[:10].cpu(),
                         torch.arange(10, dtype=torch.int16))
        d2d = _timed(lambda: local.copy_(other))
        ipc = _timed(lambda: local.copy_(peer))
        rows = NBYTES // ROW
        perm = torch.randperm(rows, device="cuda")
        pv, lv = peer.view(rows, ROW), local.view(rows, ROW)
        gather = _timed(lambda: torch.index_select(pv, 0, perm, out=lv))
        print(f"IPC handle received and opened in {opened * 1e3:.1f} ms; bytes right: {ok}")
        print(f"local D2D copy of 1 GiB: {d2d * 1e3:.3f} ms ({2 * NBYTES / d2d / 1e12:.2f} TB/s)")
        print(f"copy of 1 GiB from the peer's memory: {ipc * 1e3:.3f} ms ({ipc / d2d:.2f}x the "
              f"local copy)")
        print(f"index_select of {rows} rows of 4 MiB from the peer (scattered): "
              f"{gather * 1e3:.3f} ms ({gather / d2d:.2f}x the local copy)")
        print("IPC: ok" if ok else "IPC: failed (wrong bytes)")
        return 0 if ok else 1
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print("IPC: failed")
        return 1
    finally:
        done.set()
        p.join(30)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
