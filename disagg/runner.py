"""Model runner: owns the weights and the paged KV cache of one rank, turns a SchedulerOutput
into model inputs and returns the logits of the rows that sample.

``prepare_inputs`` is the one place step inputs are built; with several ranks each of them
calls it on the same SchedulerOutput (``disagg.parallel.worker``)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.config import EngineConfig
from disagg.model.attention import AttentionMetadata
from disagg.model.kernels import paged_decode_kernel, small_linear_kernel
from disagg.model.loader import allocate_kv_cache, kv_cache_bytes_per_block, load_model
from disagg.parallel.layout import ParallelLayout
from disagg.scheduler import SchedulerOutput

# Share of free memory given to the KV cache when the user sets neither a token count nor a
# fraction. On a GPU this is TensorRT-LLM's default; on a CPU the same memory also holds the
# process, the OS and often other workers, so the default is much smaller.
DEFAULT_KV_FRACTION = {"cuda": 0.9, "cpu": 0.1}


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (CUDA: driver's free; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are sampled
    sample_request_ids: list[str]  # request id of each of those rows, in order


class ModelRunner:
    """The model shard and KV cache of one rank; executes whole steps when it is the only one.

    With several ranks (``disagg.parallel``) every rank builds one of these for its
    ``layout``; ``agree_num_blocks`` then turns this rank's block count into the one all ranks
    use (block tables are global, so every rank must have the same number of blocks).
    """

    def __init__(self, config: EngineConfig, layout: ParallelLayout | None = None,
                 agree_num_blocks: Callable[[int], int] | None = None,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.layout = layout or ParallelLayout.for_rank(config.model, 1, 1, 0)
        self.device = torch.device(device if device is not None else config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.cache.tokens_per_block
        lay = self.layout
        self.model = load_model(config.model_dir, config.model, self.dtype, self.device,
                                layer_range=lay.layer_range, tp_rank=lay.tp_rank,
                                tp_size=lay.tp_size)
        if self.device.type == "cpu":
            # Decode attention straight from the paged cache (built once, cached on disk);
            # None keeps the PyTorch gather path.
            self.model.workspace.decode_kernel = paged_decode_kernel()
            # Linear layers on few rows (decode batches) through the small-M GEMM; None: torch.
            self.model.use_linear_kernel(small_linear_kernel())
        num_blocks = self._decide_num_blocks()
        self.num_blocks = agree_num_blocks(num_blocks) if agree_num_blocks else num_blocks
        self.kv_cache = allocate_kv_cache(
            config.model, self.num_blocks, self.block_size, self.dtype, self.device,
            num_layers=lay.num_local_layers, num_kv_heads=lay.num_local_kv_heads,
        )

    # The executor interface the engine uses (see disagg.parallel.executor for world > 1).
    error: str | None = None  # a single process has no rank that can die on its own

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid()]

    def shutdown(self) -> None:
        pass

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        lay = self.layout
        per_block = kv_cache_bytes_per_block(
            self.config.model, self.block_size, self.dtype, lay.num_local_layers,
            lay.num_local_kv_heads,
        )
        candidates = []
        if cache.kv_cache_tokens is not None:
            candidates.append(cache.kv_cache_tokens // self.block_size)
        fraction = cache.kv_cache_fraction
        if fraction is None and cache.kv_cache_tokens is None:
            fraction = DEFAULT_KV_FRACTION["cuda" if self.device.type == "cuda" else "cpu"]
        if fraction is not None:
            share = fraction * free_memory_bytes(self.device)
            if self.device.type == "cpu":
                # The ranks of one worker share the host's memory: each takes its part.
                share /= lay.world_size
            candidates.append(int(share) // per_block)
        # Never more than every batch slot filled to the model length could use.
        sched = self.config.scheduler
        candidates.append(
            math.ceil(sched.max_batch_size * self.config.max_model_len / self.block_size)
        )
        num_blocks = min(candidates)
        if num_blocks < 1:
            raise MemoryError(
                f"KV cache: not enough memory for a single block of {per_block} bytes "
                f"(kv_cache_tokens={cache.kv_cache_tokens}, kv_cache_fraction={fraction})"
            )
        return num_blocks

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        B = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block: list[int] = []
        slot_offset: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_ids: list[str] = []
        max_blocks = max((len(r.block_ids) for r in sched.scheduled), default=0)
        tables = torch.zeros(len(sched.scheduled), max(max_blocks, 1), dtype=torch.long)
        for i, r in enumerate(sched.scheduled):
            n = len(r.token_ids)
            # New tokens occupy positions [start_pos, start_pos + n); position p goes to block
            # block_ids[p // B] at offset p % B.
            pos = range(r.start_pos, r.start_pos + n)
            input_ids.extend(r.token_ids)
            positions.extend(pos)
            slot_block.extend(r.block_ids[p // B] for p in pos)
            slot_offset.extend(p % B for p in pos)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(r.start_pos + n)
            if r.block_ids:
                tables[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.long)
            if r.sample:
                logits_rows.append(query_start_loc[-1] - 1)  # last new token of the sequence
                sample_ids.append(r.request_id)
        dev = self.device

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        meta = AttentionMetadata(
            num_decodes=sched.num_decodes,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=tables.to(dev),
            slot_block=t(slot_block),
            slot_offset=t(slot_offset),
            decode_seq_lens=t(seq_lens[: sched.num_decodes]),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_t=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            max_query_len=max((len(r.token_ids) for r in sched.scheduled), default=0),
        )
        return StepInputs(t(input_ids), t(positions), meta, t(logits_rows), sample_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor | None]:
        """Run one step; return the sampling request ids and their logits ([S, V] float32)."""
        inputs = self.prepare_inputs(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        if not inputs.sample_request_ids:
            return [], None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return inputs.sample_request_ids, logits
