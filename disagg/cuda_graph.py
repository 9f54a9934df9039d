"""Pure-decode steps as CUDA graphs, one per batch-size bucket.

A step whose every scheduled request decodes one token runs through static buffers: its ``n``
rows are padded to the smallest captured bucket ``b >= n`` and the graph of that bucket is
replayed (one launch instead of ~46 per layer). Padding rows are harmless by construction:

    rows:        0 ......... n-1 | n ............ b-1
                 real decodes      padding: token 0 at position 0, K/V written to the
                                   scratch block (offset 0), seq_len 0 -> attention output 0

The scratch block is block ``num_blocks`` of the cache (allocated ``num_blocks + 1``); the
block pool only knows ``num_blocks`` blocks, so no request ever owns it.

Static inputs of bucket ``b`` live in one int64 device buffer, so a step is one host-to-device
copy of ``b * (5 + M)`` values from a pinned host buffer (``M`` = blocks of a sequence at
``max_model_len``)::

    [0, b)      input ids          [3b, 4b)    slot offsets
    [b, 2b)     positions          [4b, 5b)    seq lens (position + 1; 0 on padding rows)
    [2b, 3b)    slot blocks        [5b, 5b + b*M)   block tables, row-major [b, M], 0-padded

Buckets alias the same buffer (only one runs at a time). Attention inside the graph is
``paged_decode`` (``disagg.model.triton_attention``): grid and buffers depend on shapes only,
lengths are read on the device; with ``rope_store`` (``disagg.model.triton_rope``, when the
runner's device check accepted it) RoPE and the K/V cache write are one launch per layer.
``DecodeGraphs(capture=False)`` runs the same padded path eagerly (CPU tests, with
``paged_decode_reference``). The model's side of it (the static batch ``StaticDecodeMeta`` and
the decode kernels) is ``disagg.model.static_decode``.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from disagg.model.static_decode import DecodeFn, RopeStoreFn, StaticDecodeMeta

if TYPE_CHECKING:
    from disagg.scheduler import ScheduledRequest

logger = logging.getLogger("disagg.cuda_graph")

# Buckets up to 64 as vLLM / TensorRT-LLM capture them, then every 32.
_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
_BUCKET_STEP = 32


def graph_batch_sizes(limit: int) -> list[int]:
    """Captured batch sizes up to ``limit`` (``limit`` itself included, so every decode batch
    of at most ``limit`` rows has a bucket)."""
    if limit < 1:
        return []
    sizes = [b for b in _SMALL_BUCKETS if b <= limit]
    b = _SMALL_BUCKETS[-1] + _BUCKET_STEP
    while b <= limit:
        sizes.append(b)
        b += _BUCKET_STEP
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def is_pure_decode(scheduled: Sequence[ScheduledRequest], num_decodes: int) -> bool:
    """Every row decodes one token and samples it (what a decode graph computes)."""
    return (bool(scheduled) and num_decodes == len(scheduled)
            and all(len(r.token_ids) == 1 and r.sample for r in scheduled))


class DecodeGraphs:
    """Static buffers and (on CUDA) one captured graph per bucket; see the module docstring.

    ``model(input_ids, positions, kv_cache, meta)`` and ``model.compute_logits(hidden)`` are
    the runner's model; ``scratch_block`` a cache block no request owns.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 max_blocks_per_seq: int, scratch_block: int, sizes: Sequence[int],
                 decode: DecodeFn, capture: bool, rope_store: RopeStoreFn | None = None
                 ) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.sizes = sorted(set(sizes))
        self.decode = decode
        self.rope_store = rope_store  # None: the model's RoPE, then StaticDecodeMeta's write
        self.device = kv_cache.device
        cap = self.sizes[-1] * (5 + self.max_blocks)
        self._dev = torch.zeros(cap, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self._host = torch.zeros(cap, dtype=torch.long, pin_memory=pin)
        self._host_np = self._host.numpy()
        # load()'s record of what the host buffer holds: the bucket whose layout it has (None:
        # none yet) and each row's block table there.
        self._rows_bucket: int | None = None
        self._rows: list[list[int]] = []
        self._padding = np.array([[0], [0], [scratch_block], [0], [0]], dtype=np.int64)
        # Set after each copy: the host buffer is not rewritten before the copy has read it.
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served by a captured graph
        self.eager_runs = 0  # steps served by the padded eager path
        if capture:
            self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def applies(self, scheduled: Sequence[ScheduledRequest], num_decodes: int) -> bool:
        """``is_pure_decode``, a bucket holds the batch and every block table fits (one pass
        over the rows: this runs every step)."""
        m = self.max_blocks
        return (0 < len(scheduled) == num_decodes and len(scheduled) <= self.sizes[-1]
                and all(len(r.token_ids) == 1 and r.sample and len(r.block_ids) <= m
                        for r in scheduled))

    def bucket_for(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    # -- inputs ------------------------------------------------------------------------------

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        d, m = self._dev, self.max_blocks
        return (d[0:b], d[b:2 * b], d[2 * b:3 * b], d[3 * b:4 * b], d[4 * b:5 * b],
                d[5 * b:5 * b + b * m].view(b, m))

    def load(self, scheduled: Sequence[ScheduledRequest], b: int) -> None:
        """Write the rows of ``scheduled`` (padded to ``b``) into the static buffers: host
        layout in the pinned buffer, then one non-blocking copy.

        The head (``5b`` values: ids ... seq lens) is rewritten whole; a block-table row only
        where it differs from what the last load of the same bucket left in the host buffer
        (a decode's table grows by one block every ``block_size`` steps), so a step costs
        O(rows) host work, not O(rows x M). Another bucket's layout is zeroed first."""
        m, bs = self.max_blocks, self.block_size
        n = len(scheduled)
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        h = self._host_np
        k = b * (5 + m)
        rows = self._rows  # block table of each row as the host buffer holds it (bucket b)
        if self._rows_bucket != b:
            h[:k] = 0
            rows = self._rows = [[] for _ in range(b)]
            self._rows_bucket = b
        pos = [r.start_pos for r in scheduled]
        tables = [r.block_ids for r in scheduled]
        ids = [r.token_ids[0] for r in scheduled]
        slots = [t[p // bs] for t, p in zip(tables, pos, strict=True)]
        # padding rows: token 0, position 0, scratch block, offset 0, seq_len 0
        if n <= 8:  # few rows: one list converted beats a dozen numpy calls
            z = [0] * (b - n)
            h[:5 * b] = [*ids, *z, *pos, *z, *slots, *[self.scratch_block] * (b - n),
                         *[p % bs for p in pos], *z, *[p + 1 for p in pos], *z]
        else:
            head = h[:5 * b].reshape(5, b)
            head[:, n:] = self._padding
            head[0, :n] = ids
            head[1, :n] = pos
            head[2, :n] = slots
            np.remainder(head[1, :n], bs, out=head[3, :n])
            np.add(head[1, :n], 1, out=head[4, :n])
        base = 5 * b
        for i, t in enumerate(tables):
            prev = rows[i]
            if t != prev:  # (one C-level list comparison per row)
                if len(t) > m:
                    raise ValueError(f"{scheduled[i].request_id}: {len(t)} blocks, more than "
                                     f"the {m} of a decode graph's block table")
                row = base + i * m
                h[row:row + len(t)] = t
                if len(prev) > len(t):
                    h[row + len(t):row + len(prev)] = 0
                rows[i] = list(t)  # a copy: the caller may change its list
        for i in range(n, b):  # padding rows: 0-padded tables
            prev = rows[i]
            if prev:
                row = base + i * m
                h[row:row + len(prev)] = 0
                rows[i] = []
        self._dev[:k].copy_(self._host[:k], non_blocking=True)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()  # one event, recorded again every step
            self._copied.record()

    # -- forward -----------------------------------------------------------------------------

    def _forward(self, b: int) -> torch.Tensor:
        ids, pos, sblock, soff, seq_lens, tables = self._views(b)
        meta = StaticDecodeMeta(tables, seq_lens, sblock, soff, self.decode,
                                rope_store=self.rope_store)
        hidden = self.model(ids, pos, self.kv_cache, meta)
        return self.model.compute_logits(hidden)

    def run(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Logits ``[n, V]`` (float32) of a pure-decode batch of ``n`` rows. With a graph the
        tensor is a view of the bucket's static output: valid until the next ``run``."""
        n = len(scheduled)
        b = self.bucket_for(n)
        self.load(scheduled, b)
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return self._outputs[b][:n]
        self.eager_runs += 1
        return self._forward(b)[:n]

    def rerun(self, b: int, eager: bool = False) -> torch.Tensor:
        """Bucket ``b``'s forward again on the inputs its last ``run`` loaded (profiles and
        benchmarks: the device's time of a step without host work between steps); its graph
        replayed, or (``eager``, or no graph) the same forward run eagerly. Rewrites the KV
        slots of that step with the same values. Not counted in ``replays``."""
        graph = None if eager else self._graphs.get(b)
        if graph is not None:
            graph.replay()
            return self._outputs[b]
        return self._forward(b)

    def _capture_all(self) -> None:
        """Capture every bucket, largest first (its memory is reused by the smaller ones)."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self.load((), b)  # all rows padding: writes only the scratch block
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile / autotune the kernels outside the capture
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            self._graphs[b] = graph
            self._outputs[b] = out
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self._graphs),
                    self.sizes)
