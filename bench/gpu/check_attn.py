"""Device check of the Triton paged attention (``disagg/model/triton_attention.py``).

    python3 -m bench.gpu.check_attn --out $OUT/attn.txt

1. Correctness on CUDA against a float64 PyTorch reference: decode (block sizes 8/16/32/64,
   head_dim 64/128, GQA/MQA/MHA, several split counts, seq_len 0 rows, int32/int64 tables)
   and varlen prefill (chunks after a cached prefix, whole prompts, 1-token chunks) in
   float32, bfloat16 and float16; a mixed batch through ``paged_attention`` against its
   PyTorch path; a CUDA-graph capture of ``paged_decode`` replayed with new lengths/tables.
2. Timing, Llama-3-8B attention shape (32 q heads, 8 kv heads, head_dim 128, bf16), block
   size 16 and 32: decode at batch 1 and 64 with 1k context over all 32 layers of a cache
   (so the bytes come from HBM, not L2), eager and CUDA-graph replayed, achieved GB/s of KV
   bytes read, against a device-to-device copy measured here and the PyTorch gather path;
   a small sweep of split counts / tiles; prefill of 8k tokens (causal) in TFLOP/s against
   ``F.scaled_dot_product_attention`` on the same shape (contiguous, not paged).

Every sub-check is guarded: a failure prints its traceback and the rest goes on. Exit code 1
when any correctness check failed or raised. Aims at < 90 s on an H100.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
LINES: list[str] = []
FAILURES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def guarded(name: str, fn: Callable[[], None], correctness: bool = True) -> None:
    t = time.perf_counter()
    log(f"== {name}")
    try:
        fn()
    except Exception:  # noqa: BLE001 - one shot on the device: report and go on
        tb = traceback.format_exc()
        log(tb)
        if correctness:
            FAILURES.append(name)
        else:
            log(f"(timing section {name} failed; see traceback)")
    log(f"   ({time.perf_counter() - t:.1f} s)")


def make_case(lens: list[int], qlens: list[int], b: int, hq: int, hkv: int, d: int,
              dtype: torch.dtype, table_dtype: torch.dtype = torch.int32, seed: int = 0):
    """q [T, H_q, D], a layer view of a 2-layer cache, random tables (distinct blocks)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = max(1, max(-(-x // b) for x in lens))
    n = width * len(lens) + 3
    full = torch.randn(n, 2, 2, hkv, b, d, device="cuda", generator=g).to(dtype)
    kv = full[:, 1]
    perm = torch.randperm(n, device="cuda", generator=g)
    bt = perm[: width * len(lens)].view(len(lens), width).to(table_dtype).contiguous()
    qsl = [0]
    for x in qlens:
        qsl.append(qsl[-1] + x)
    q = torch.randn(qsl[-1], hq, d, device="cuda", generator=g).to(dtype)
    return q, kv, bt, qsl


@contextlib.contextmanager
def pytorch_path() -> Iterator[None]:
    """While active, ``paged_attention`` on CUDA takes its PyTorch path (gather + SDPA): the
    documented switch ``DISAGG_CUDA_ATTENTION=torch``. ``triton_available`` reads it once and
    keeps the answer, so that answer is dropped on the way in and on the way out."""
    from disagg.model.attention import triton_available

    name, old = "DISAGG_CUDA_ATTENTION", os.environ.get("DISAGG_CUDA_ATTENTION")
    os.environ[name] = "torch"
    triton_available.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
        triton_available.cache_clear()


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, t: float) -> None:
    err = (got.double() - ref).abs().max().item()
    ok = err <= t * (1.0 + ref.abs().max().item())
    log(f"   {name}: max abs err {err:.3e} (tol {t:.0e}) {'ok' if ok else 'MISMATCH'}")
    if not ok:
        raise AssertionError(f"{name}: max abs err {err:.3e}")


def correctness_decode() -> None:
    from disagg.model import triton_attention as ta

    f32, bf16, f16, i32, i64 = (torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                torch.int64)
    cases = [  # (block, head_dim, hq, hkv, dtype, table dtype): one compile each
        (16, 128, 32, 8, f32, i32), (16, 128, 32, 8, bf16, i32), (16, 128, 32, 8, f16, i32),
        (16, 128, 32, 8, bf16, i64), (8, 128, 32, 8, bf16, i32), (32, 128, 32, 8, bf16, i32),
        (64, 128, 32, 8, bf16, i32), (16, 64, 9, 3, f32, i32), (16, 64, 9, 3, bf16, i32),
        (32, 64, 8, 1, bf16, i32), (16, 128, 4, 4, f16, i32), (12, 80, 4, 2, f32, i32),
    ]
    lens = [1, 0, 17, 100, 1024, 333, 64, 2049]
    for b, d, hq, hkv, dtype, table_dtype in cases:
        q, kv, bt, _ = make_case(lens, [1] * len(lens), b, hq, hkv, d, dtype,
                                 table_dtype)
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        ref = ta.reference_attention(q, kv, bt, lens, list(range(len(lens) + 1)),
                                     1 / math.sqrt(d))
        for splits in (1, 3, None):
            out = ta.paged_decode(q, kv, bt, sl, 1 / math.sqrt(d), num_splits=splits)
            torch.cuda.synchronize()
            check_close(f"decode B={b} D={d} {hq}/{hkv} {dtype} {table_dtype} "
                        f"splits={splits}", out, ref, tol(dtype))
            if not torch.all(out[1] == 0):
                raise AssertionError("seq_len 0 row is not zero")


def correctness_prefill() -> None:
    from disagg.model import triton_attention as ta

    chunks = [(0, 5), (37, 3), (0, 1), (20, 300), (16, 33), (1000, 129), (0, 777)]
    lens = [c + n for c, n in chunks]
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for b, d, hq, hkv, dtype in [
        (16, 128, 32, 8, f32), (16, 128, 32, 8, bf16), (16, 128, 32, 8, f16),
        (32, 128, 32, 8, bf16), (8, 64, 9, 3, f32), (8, 64, 9, 3, bf16), (64, 128, 8, 8, bf16),
    ]:
        q, kv, bt, qsl = make_case(lens, [n for _, n in chunks], b, hq, hkv, d, dtype)
        ref = ta.reference_attention(q, kv, bt, lens, qsl, 1 / math.sqrt(d))
        out = ta.paged_prefill(q, kv, bt, torch.tensor(lens, dtype=torch.int32,
                                                       device="cuda"),
                               torch.tensor(qsl, dtype=torch.int32, device="cuda"),
                               qsl[-1], 1 / math.sqrt(d))
        torch.cuda.synchronize()
        check_close(f"prefill B={b} D={d} {hq}/{hkv} {dtype}", out, ref, tol(dtype))


def correctness_mixed() -> None:
    """paged_attention on CUDA (Triton) vs its PyTorch path, decodes + prefill chunks."""
    from disagg.model.attention import AttentionMetadata, paged_attention, triton_available

    if not triton_available():  # (CUDA tensors of one dtype, no autograd: Triton's)
        raise AssertionError("paged_attention would not use Triton on CUDA")
    b, hq, hkv, d = 16, 32, 8, 128
    seqs = [(9, 1), (0, 1), (400, 1), (0, 130), (210, 60), (0, 3)]  # (cached, new)
    nd = 3
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(5)
        n_blocks = 128
        kv = torch.randn(n_blocks, 2, hkv, b, d, device="cuda", generator=g).to(dtype)
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(5)).tolist()
        tables, qsl, lens, sb, so = [], [0], [], [], []
        for ctx, n in seqs:
            tables.append([perm.pop() for _ in range(-(-(ctx + n) // b))])
            for p in range(ctx, ctx + n):
                sb.append(tables[-1][p // b])
                so.append(p % b)
            qsl.append(qsl[-1] + n)
            lens.append(ctx + n)
        width = max(len(x) for x in tables)
        dev = "cuda"
        bt = torch.tensor([x + [0] * (width - len(x)) for x in tables], device=dev)
        meta = AttentionMetadata(
            num_decodes=nd, query_start_loc=qsl, seq_lens=lens, block_tables=bt,
            slot_block=torch.tensor(sb, device=dev), slot_offset=torch.tensor(so, device=dev),
            decode_seq_lens=torch.tensor(lens[:nd], device=dev),
            seq_lens_t=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(n for _, n in seqs))
        t = qsl[-1]
        q = torch.randn(t, hq, d, device=dev, generator=g).to(dtype)
        k = torch.randn(t, hkv, d, device=dev, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, device=dev, generator=g).to(dtype)
        kv2 = kv.clone()
        out = paged_attention(q, k, v, kv, meta, 1 / math.sqrt(d))
        with pytorch_path():
            ref = paged_attention(q.double(), k.double(), v.double(), kv2.double(), meta,
                                  1 / math.sqrt(d))
        torch.cuda.synchronize()
        check_close(f"paged_attention mixed {dtype}", out, ref, tol(dtype))


def correctness_graph() -> None:
    """Capture paged_decode once, replay with other lengths (incl. 0) and tables."""
    from disagg.model import triton_attention as ta

    b, hq, hkv, d, s, width = 16, 32, 8, 128, 8, 64
    n = s * width + 1
    kv = torch.randn(n, 2, hkv, b, d, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(s, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(s, width, dtype=torch.int32, device="cuda")
    sl = torch.zeros(s, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    splits = ta.choose_num_splits(s, hkv, width, b, q.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            ta.paged_decode(q, kv, bt, sl, 0.1, num_splits=splits, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_decode(q, kv, bt, sl, 0.1, num_splits=splits, out=out)
    for trial, lens in enumerate([[5, 0, 1000, 17, 1, 64, 0, 300], [1024] * 8,
                                  [0] * 7 + [33]]):
        g = torch.Generator(device="cuda").manual_seed(trial)
        q.copy_(torch.randn(s, hq, d, device="cuda", generator=g).to(q.dtype))
        bt.copy_(torch.randperm(n - 1, device="cuda", generator=g)[: s * width]
                 .view(s, width).int())
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        eager = ta.paged_decode(q, kv, bt, sl, 0.1, num_splits=splits)
        ref = ta.reference_attention(q, kv, bt, lens, list(range(s + 1)), 0.1)
        torch.cuda.synchronize()
        check_close(f"graph replay {trial} vs reference", out, ref, tol(torch.bfloat16))
        if not torch.equal(out, eager):
            raise AssertionError("graph replay differs from the eager launch")


def bench(fn: Callable[[], object], iters: int = 50) -> float:
    """Median seconds of one call (CUDA events, after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        z = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) / 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes moved (read + write) per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * (1 << 30) / bench(lambda: dst.copy_(src), iters=10)


LAYERS, HQ, HKV, HEAD_DIM, CTX = 32, 32, 8, 128, 1024  # Llama-3-8B attention, 1k context


def timing_decode(copy_bw: float) -> None:
    log(f"   D2D copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    for b in (16, 32):
        for batch in (1, 64):
            _decode_case(b, batch, copy_bw)
            torch.cuda.empty_cache()


def _decode_case(b: int, batch: int, copy_bw: float) -> None:
    from disagg.model import triton_attention as ta
    from disagg.model.attention import AttentionMetadata, paged_attention

    layers, hq, hkv, d, ctx = LAYERS, HQ, HKV, HEAD_DIM, CTX
    dtype = torch.bfloat16
    scale = 1 / math.sqrt(d)
    width = ctx // b
    n = batch * width + 1
    # kv_cache[N, L, 2, H_kv, B, D]: each layer's view is strided like the model's.
    cache = torch.randn(n, layers, 2, hkv, b, d, device="cuda", dtype=dtype)
    bt = torch.randperm(n - 1, device="cuda")[: batch * width].view(batch, width)
    bt = bt.int().contiguous()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    kv_bytes = layers * batch * ctx * hkv * d * 2 * cache.element_size()
    views = [cache[:, i] for i in range(layers)]
    auto = ta.choose_num_splits(batch, hkv, width, b, q.device)

    def step(splits: int = auto, tile: int = 64, warps: int = 4) -> None:
        for kv in views:
            ta.paged_decode(q, kv, bt, sl, scale, num_splits=splits, out=out,
                            tile_n=tile, num_warps=warps)

    def report(label: str, t: float) -> None:
        bw = kv_bytes / t
        log(f"   B={b} batch={batch} ctx={ctx} {label}: {t * 1e6 / layers:.1f} us/layer, "
            f"{bw / 1e9:.0f} GB/s of KV read = {100 * bw / copy_bw:.0f}% of D2D copy")

    report(f"triton eager splits={auto}", bench(step, iters=20))
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        step()
    report(f"triton graph splits={auto}", bench(graph.replay, iters=30))
    if time.perf_counter() - T0 < 45:
        for splits, tile, warps in [(1, 64, 4), (max(1, auto // 2), 64, 4),
                                    (auto, 32, 4), (auto, 128, 8), (auto, 64, 8)]:
            try:
                t = bench(functools.partial(step, splits, tile, warps), iters=10)
                report(f"sweep splits={splits} tile={tile} warps={warps}", t)
            except Exception as e:  # noqa: BLE001 - a config may not fit
                log(f"   sweep splits={splits} tile={tile} warps={warps}: {e!r}")
    # paged_attention's PyTorch path (gather + SDPA, what CUDA ran before) on the same batch:
    # each sequence's last position written (one K/V row a sequence), then attended.
    bt64 = bt.long()
    rows = torch.arange(batch, device="cuda")
    meta = AttentionMetadata(
        num_decodes=batch, query_start_loc=list(range(batch + 1)), seq_lens=[ctx] * batch,
        block_tables=bt64, slot_block=bt64[rows, (ctx - 1) // b],
        slot_offset=torch.full((batch,), (ctx - 1) % b, device="cuda"),
        decode_seq_lens=sl.long(), seq_lens_t=sl,
        query_start_loc_t=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        max_query_len=1)
    new_k = torch.randn(batch, hkv, d, device="cuda", dtype=dtype)
    new_v = torch.randn(batch, hkv, d, device="cuda", dtype=dtype)

    def torch_step() -> None:
        for kv in views:
            paged_attention(q, new_k, new_v, kv, meta, scale)

    if time.perf_counter() - T0 < 60:
        with pytorch_path():
            report("pytorch paged_attention (write + gather + SDPA)",
                   bench(torch_step, iters=5))


def timing_prefill() -> None:

    hq, hkv, d, n = 32, 8, 128, 8192
    dtype = torch.bfloat16
    scale = 1 / math.sqrt(d)
    flops = 4 * hq * d * n * (n + 1) / 2  # QK^T and PV over the causal half
    q = torch.randn(n, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(n, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(n, hkv, d, device="cuda", dtype=dtype)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    t = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                     enable_gqa=True), iters=10)
    log(f"   SDPA (contiguous, causal, GQA) {n} tokens: {t * 1e3:.2f} ms, "
        f"{flops / t / 1e12:.0f} TFLOP/s")
    for b in (16, 32):
        _prefill_case(b, q, k, v, qh, kh, vh, flops)
        torch.cuda.empty_cache()


def _prefill_case(b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, flops: float) -> None:
    from disagg.model import triton_attention as ta

    n, hq, d = q.shape
    hkv = k.shape[1]
    scale = 1 / math.sqrt(d)
    nblk = n // b
    kv = torch.empty(nblk, 2, hkv, b, d, device="cuda", dtype=q.dtype)
    perm = torch.randperm(nblk, device="cuda")
    # Token p of the sequence -> block perm[p // b], offset p % b.
    kv[perm, 0] = k.view(nblk, b, hkv, d).transpose(1, 2)
    kv[perm, 1] = v.view(nblk, b, hkv, d).transpose(1, 2)
    bt = perm.view(1, nblk).int()
    sl = torch.tensor([n], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = ta.paged_prefill(q, kv, bt, sl, qsl, n, scale)
    ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                         enable_gqa=True)[0].transpose(0, 1)
    err = (out.float() - ref.float()).abs().max().item()
    log(f"   B={b}: paged_prefill vs SDPA max abs err {err:.3e}")
    for cfg in [None, (128, 64, 8, 3), (128, 32, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2)]:
        if cfg is not None and time.perf_counter() - T0 > 70:
            break
        try:
            t = bench(functools.partial(ta.paged_prefill, q, kv, bt, sl, qsl, n, scale,
                                        config=cfg), iters=10)
            label = cfg or ta.prefill_config(q.dtype, hq // hkv)
            log(f"   B={b} paged_prefill config={label}: {t * 1e3:.2f} ms, "
                f"{flops / t / 1e12:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001 - a config may not fit
            log(f"   B={b} config={cfg}: {e!r}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.check_attn",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args()
    try:
        import triton
        log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
            f"triton {triton.__version__}")
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
        FAILURES.append("setup")
    if not FAILURES:
        guarded("correctness: decode", correctness_decode)
        guarded("correctness: varlen prefill", correctness_prefill)
        guarded("correctness: mixed batch through paged_attention", correctness_mixed)
        guarded("correctness: CUDA graph capture of paged_decode", correctness_graph)
        bw = [0.0]

        def _bw() -> None:
            bw[0] = copy_bandwidth()
        guarded("timing: D2D copy bandwidth", _bw, correctness=False)
        guarded("timing: decode (Llama-3-8B attention, 32 layers)",
                lambda: timing_decode(bw[0] or float("nan")), correctness=False)
        guarded("timing: prefill 8k tokens", timing_prefill, correctness=False)
    log(f"total {time.perf_counter() - T0:.1f} s; "
        f"{'FAILED: ' + ', '.join(FAILURES) if FAILURES else 'all correctness checks passed'}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
