"""Model runner: owns the weights and the paged KV cache of one rank, turns a SchedulerOutput
into model inputs and returns the logits of the rows that sample.

``prepare_inputs`` is the one place step inputs are built; with several ranks each of them
calls it on the same SchedulerOutput (``disagg.parallel.worker``)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.config import (
    DEFAULT_CPU_KV_FRACTION,
    DEFAULT_CPU_KV_SEQUENCES,
    DEFAULT_GPU_MEMORY_FRACTION,
    EngineConfig,
)
from disagg.cuda_graph import DecodeGraphs, graph_batch_sizes
from disagg.layout import ParallelLayout
from disagg.model.attention import AttentionMetadata
from disagg.model.cpu_decoder import cpu_decoder
from disagg.model.cpu_ops import elementwise_kernel
from disagg.model.kernels import paged_decode_kernel, small_linear_kernel
from disagg.model.llama import GatedMLP, LlamaForCausalLM
from disagg.model.loader import allocate_kv_cache, kv_cache_bytes_per_block, load_model
from disagg.model.moe import MoeExperts, use_experts_kernel
from disagg.model.static_decode import DecodeFn, triton_paged_decode
from disagg.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("disagg.runner")

# A CPU step with at least this many new tokens (a prefill chunk) hands the heap pages its
# activations freed back to the OS (``malloc_trim``): glibc keeps them resident otherwise, and
# steps of other sizes (the next chunk attends a longer context) then grow the heap further.
# Decode steps (fewer tokens) never trim: they would fault their few pages back every step.
TRIM_AFTER_TOKENS = 64


# torch's bfloat16 GEMMs on CPU (the quantized models' prefill tiles) go through ideep and
# oneDNN, which keep up to 1024 matmuls each (ideep's LRU of computations, oneDNN's primitives
# with their JIT code), one per (rows, out, in) shape: a server's mixed steps come in every row
# count up to max_num_tokens, so they kept hundreds (SmolLM2 Q4_1, 16 streams through disagg
# serve: peak RSS 733 MiB; 690 with oneDNN's held to 16, 625 with ideep's too, the same
# tokens/s). Both read their variable once, at first use; a value the user set wins.
ONEDNN_PRIMITIVE_CACHE = 16


def _limit_onednn_cache() -> None:
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(ONEDNN_PRIMITIVE_CACHE))


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


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
class MemoryProfile:
    """What sized the KV cache on CUDA (bytes; logged at start-up)."""

    total: int  # the GPU's memory
    weights: int  # allocated by this process after loading the model
    activation_peak: int  # peak above that of a forward at max_num_tokens + its sampling
    free_after: int  # driver's free memory after the profiling run (cache emptied)
    profiled_tokens: int  # tokens of the profiling forward (0: not profiled)
    kv_bytes: int  # what the KV cache was given
    per_block: int  # bytes of one KV block

    def describe(self) -> str:
        gib = 1024**3
        return (f"total {self.total / gib:.2f} GiB, weights {self.weights / gib:.2f} GiB, "
                f"activation peak {self.activation_peak / gib:.3f} GiB at "
                f"{self.profiled_tokens} tokens, free after profiling "
                f"{self.free_after / gib:.2f} GiB -> KV cache {self.kv_bytes / gib:.2f} GiB "
                f"({self.kv_bytes // self.per_block} blocks)")


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Rows of the hidden states that get logits: the sampled ones (1 + num_spec per request
    # in sample_request_ids, in order), then each request's prompt-logprob positions
    # (ScheduledRequest.prompt_logit_positions, in schedule order).
    logits_indices: torch.Tensor
    sample_request_ids: list[str]  # request id of each sampled row, in order


class ModelRunner:
    """The model shard and KV cache of one rank; executes whole steps when it is the only one.

    With several ranks (``disagg.parallel``) every rank builds one of these for its
    ``layout``; ``agree_num_blocks`` then turns this rank's block count into the one all ranks
    use (block tables are global, so every rank must have the same number of blocks).

    On CUDA (one rank, ``enforce_eager`` off, Triton present) pure-decode steps replay CUDA
    graphs (``disagg.cuda_graph``); the cache then holds one scratch block past
    ``num_blocks`` for their padding rows. ``padded_decode`` forces that padded static path
    with the given attention function (run eagerly off CUDA: the CPU tests of the buckets).
    """

    def __init__(self, config: EngineConfig, layout: ParallelLayout | None = None,
                 agree_num_blocks: Callable[[int], int] | None = None,
                 device: torch.device | str | None = None,
                 padded_decode: DecodeFn | None = None) -> None:
        self.config = config
        self.layout = layout or ParallelLayout.for_rank(config.model, 1, 1, 0)
        self.device = torch.device(device if device is not None else config.device)
        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = getattr(torch, config.kv_dtype)  # kv_cache_dtype (auto: dtype)
        self.block_size = config.cache.tokens_per_block
        lay = self.layout
        # Pinned staging of the step inputs (CUDA), grown on demand; see _to_device.
        self._staging: torch.Tensor | None = None
        self._staged: torch.cuda.Event | None = None
        self.model = load_model(config.model_dir, config.model, self.dtype, self.device,
                                layer_range=lay.layer_range, tp_rank=lay.tp_rank,
                                tp_size=lay.tp_size,
                                expert_parallel=config.parallel.enable_expert_parallel)
        if self.device.type == "cpu":
            # Decode attention straight from the paged cache (built once, cached on disk);
            # None keeps the PyTorch gather path.
            self.model.workspace.decode_kernel = paged_decode_kernel()
            # Linear layers on few rows (decode batches) through the small-M GEMM; None: torch.
            self.model.use_linear_kernel(small_linear_kernel())
            # Residual add + RMSNorm, and RoPE + the K/V write, one compiled call each (float32;
            # the norm PyTorch's but for the last bits, RoPE bit for bit); None: PyTorch ops.
            ops = elementwise_kernel() if self.dtype == torch.float32 else None
            if ops is not None:
                self.model.use_norm_kernel(ops.add_rms_norm)
                self.model.workspace.rope_store = ops
        elif self.device.type == "cuda":
            # Residual add + RMSNorm in one launch (checked on this device first); None: torch.
            from disagg.model.triton_norm import triton_norm_kernel

            self.model.use_norm_kernel(triton_norm_kernel(
                self.device, self.dtype, config.model.hidden_size))
            if any(isinstance(m, GatedMLP) for m in self.model.modules()):
                # SwiGLU's silu(gate) * up in one launch (PyTorch's bits on this device,
                # checked first); None: F.silu and the multiply.
                from disagg.model.triton_silu_mul import triton_silu_mul_kernel

                self.model.use_silu_mul_kernel(triton_silu_mul_kernel(
                    self.device, self.dtype,
                    max(1, config.model.intermediate_size // lay.tp_size)))
            if any(isinstance(m, MoeExperts) for m in self.model.modules()):
                # Grouped experts in two launches, no host sync (checked on this device
                # first); None: the PyTorch paths of moe.experts_forward.
                from disagg.model.triton_moe import triton_experts_kernel

                use_experts_kernel(self.model, triton_experts_kernel(
                    self.device, self.dtype, config.model.hidden_size, 64))
        decode = padded_decode
        # MLA (DeepSeek-V3) decodes eagerly: the padded graph path is MHA's.
        if (decode is None and self.device.type == "cuda" and lay.world_size == 1
                and not config.cuda_graph.enforce_eager and config.model.cache_kind == "mha"):
            decode = triton_paged_decode()
            if decode is None:
                logger.warning("CUDA graphs off: disagg.model.triton_attention.paged_decode "
                               "is not available (no triton?); decode steps run eagerly")
        self.memory_profile: MemoryProfile | None = None
        num_blocks = self._decide_num_blocks()
        self.num_blocks = agree_num_blocks(num_blocks) if agree_num_blocks else num_blocks
        # Block num_blocks (past every block the pool hands out) is the padding rows' scratch.
        extra = 1 if decode is not None else 0
        self.kv_cache = allocate_kv_cache(
            config.model, self.num_blocks + extra, self.block_size, self.kv_dtype, self.device,
            num_layers=lay.num_local_layers, num_kv_heads=lay.num_local_kv_heads,
        )
        # Its layer views made once (a decode step would slice the cache per layer).
        self.model.use_kv_cache(self.kv_cache)
        if self.device.type == "cpu" and isinstance(self.model, LlamaForCausalLM):
            # Pure decode steps of a GGUF-blocks model in one compiled call; None: layer loop.
            self.model.cpu_decoder = cpu_decoder(self.model, self.kv_cache)
        self.graphs: DecodeGraphs | None = None
        if decode is not None:
            self.graphs = self._make_graphs(decode)
        self._trim = _malloc_trim() if self.device.type == "cpu" else None
        if self.device.type == "cpu":
            _limit_onednn_cache()
        if self._trim is not None:
            # What loading freed (the tokenizer's JSON, the GGUF reader's buffers) back to the
            # OS: glibc keeps it resident otherwise (SmolLM2 Q4_1: about 12 MiB).
            self._trim(0)

    def _make_graphs(self, decode: DecodeFn) -> DecodeGraphs | None:
        sched = self.config.scheduler
        limit = min(self.config.cuda_graph.cuda_graph_max_batch_size, sched.max_batch_size,
                    sched.max_num_tokens)
        capture = self.device.type == "cuda"
        rope_store = None
        m = self.config.model
        if capture and m.cache_kind == "mha":
            # RoPE + the K/V cache write in one launch (bit-identical to PyTorch on this
            # device, checked first); None: apply_rope and index_put.
            from disagg.model.triton_rope import triton_rope_store_kernel

            rope_store = triton_rope_store_kernel(
                self.device, self.dtype, m.num_attention_heads // self.layout.tp_size,
                self.layout.num_local_kv_heads, m.head_dim, self.block_size)
        try:
            with torch.inference_mode():
                return DecodeGraphs(
                    self.model, self.kv_cache, self.block_size,
                    max_blocks_per_seq=-(-self.config.max_model_len // self.block_size),
                    scratch_block=self.num_blocks, sizes=graph_batch_sizes(limit),
                    decode=decode, capture=capture, rope_store=rope_store)
        except Exception:
            if not capture:
                raise
            # The worker still serves, eagerly (e.g. no memory left for the graph pool).
            logger.exception("CUDA graph capture failed: decode steps run eagerly")
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            return None

    # The executor interface the engine uses (see disagg.parallel.executor for world > 1).
    error: str | None = None  # a single process has no rank that can die on its own

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid()]

    def shutdown(self) -> None:
        pass

    # -- KV cache sizing ---------------------------------------------------------------------

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        lay = self.layout
        sched = self.config.scheduler
        per_block = kv_cache_bytes_per_block(
            self.config.model, self.block_size, self.kv_dtype, lay.num_local_layers,
            lay.num_local_kv_heads,
        )
        # Each bound on the number of blocks, by what it is; the smallest is the size.
        bounds: dict[str, int] = {}
        if cache.kv_cache_tokens is not None:
            bounds["kv_cache_tokens"] = cache.kv_cache_tokens // self.block_size
        fraction = cache.kv_cache_fraction
        if self.device.type == "cuda":
            gpu_fraction = cache.gpu_memory_fraction
            if gpu_fraction is None and fraction is None and cache.kv_cache_tokens is None:
                gpu_fraction = DEFAULT_GPU_MEMORY_FRACTION
            if gpu_fraction is not None or fraction is not None:
                prof = self._profile_cuda(per_block, fraction, gpu_fraction)
                self.memory_profile = prof
                logger.info("KV cache sizing: %s", prof.describe())
                bounds["memory profile"] = prof.kv_bytes // per_block
        else:
            if fraction is None and cache.kv_cache_tokens is None:
                # The default: what the model and the load can use, capped by a share of RAM.
                fraction = DEFAULT_CPU_KV_FRACTION
                seqs = min(sched.max_batch_size, DEFAULT_CPU_KV_SEQUENCES)
                bounds[f"the default, {seqs} sequence(s) of max_model_len "
                       f"{self.config.max_model_len} and at least max_num_tokens "
                       f"{sched.max_num_tokens}"] = self._cpu_default_blocks()
            if fraction is not None:
                # The ranks of one worker share the host's memory: each takes its part.
                share = fraction * free_memory_bytes(self.device) / lay.world_size
                what = ("kv_cache_fraction " if cache.kv_cache_fraction is not None
                        else "the default cap, ")
                bounds[f"{what}{fraction} of free RAM"
                       + (f" / {lay.world_size} ranks" if lay.world_size > 1 else "")
                       ] = int(share) // per_block
        # Never more than every batch slot filled to the model length could use.
        bounds["max_batch_size x max_model_len"] = math.ceil(
            sched.max_batch_size * self.config.max_model_len / self.block_size)
        num_blocks = min(bounds.values())
        if num_blocks < 1:
            raise MemoryError(
                f"KV cache: not enough memory for a single block of {per_block} bytes "
                f"(kv_cache_tokens={cache.kv_cache_tokens}, kv_cache_fraction={fraction}, "
                f"gpu_memory_fraction={cache.gpu_memory_fraction}"
                + (f"; {self.memory_profile.describe()}" if self.memory_profile else "") + ")"
            )
        if self.device.type != "cuda":
            logger.info("KV cache sizing: %s",
                        self._describe_cpu_sizing(num_blocks, per_block, bounds))
        return num_blocks

    def _cpu_default_blocks(self) -> int:
        """A CPU worker's KV cache when no size is given: what the model and the load can
        use, not a share of RAM: ``DEFAULT_CPU_KV_SEQUENCES`` sequences of ``max_model_len``
        tokens (no more sequences than ``max_batch_size``), and no fewer tokens than one full
        step (``max_num_tokens``: a step's new tokens all need their KV). The caller caps it
        at ``DEFAULT_CPU_KV_FRACTION`` of free RAM."""
        sched = self.config.scheduler
        seqs = min(sched.max_batch_size, DEFAULT_CPU_KV_SEQUENCES)
        tokens = max(seqs * self.config.max_model_len, sched.max_num_tokens)
        return math.ceil(tokens / self.block_size)

    def _describe_cpu_sizing(self, num_blocks: int, per_block: int,
                             bounds: dict[str, int]) -> str:
        """The start-up log line of a CPU worker's KV cache: its size and what set it
        (``bounds``: each bound's name -> its blocks; the smallest is the size)."""
        gib = 1024**3
        setter = min(bounds, key=lambda k: bounds[k])
        others = ", ".join(f"{k}: {v * self.block_size} tokens" for k, v in bounds.items()
                           if k != setter)
        return (f"{num_blocks} blocks of {self.block_size} tokens = "
                f"{num_blocks * self.block_size} tokens, {num_blocks * per_block / gib:.2f} GiB;"
                f" set by {setter}" + (f" (other bounds: {others})" if others else ""))

    def _profile_batch(self) -> SchedulerOutput:
        """A step as large as the scheduler can make: ``R = min(max_batch_size,
        max_num_tokens)`` prompts, ``max_num_tokens`` tokens split evenly (each within
        ``max_model_len``), all sampling; they share blocks ``[0, nb)`` (KV values do not
        matter, the activations do)."""
        sched = self.config.scheduler
        rows = min(sched.max_batch_size, sched.max_num_tokens)
        per, extra = divmod(sched.max_num_tokens, rows)
        lens = [min(per + (i < extra), self.config.max_model_len) for i in range(rows)]
        vocab = self.config.model.vocab_size
        scheduled = [ScheduledRequest(f"profile-{i}", [(7 * i + j) % vocab for j in range(n)],
                                      0, list(range(-(-n // self.block_size))), True)
                     for i, n in enumerate(lens)]
        return SchedulerOutput(scheduled, 0, sum(lens), [], 0, 0)

    def _profile_cuda(self, per_block: int, kv_fraction: float | None,
                      gpu_fraction: float | None) -> MemoryProfile:
        """Peak activation memory of the largest step (a forward at ``max_num_tokens`` plus
        sampling its rows, as vLLM's profile_run), then the KV budget:

            gpu_memory_fraction:  fraction * total - weights - activation peak
            kv_cache_fraction:    fraction * (free after profiling - activation peak)
            never more than       free after profiling - activation peak
        """
        from disagg.request import SamplingParams
        from disagg.sampler import Sampler

        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        profiled = 0
        peak = 0
        if self.layout.world_size == 1:
            # Ranks of a parallel worker cannot run a forward alone (their collectives are not
            # up yet): they size from free memory without the activation term.
            sched = self._profile_batch()
            nb = max(len(r.block_ids) for r in sched.scheduled)
            lay = self.layout
            dummy = allocate_kv_cache(self.config.model, nb, self.block_size, self.kv_dtype, dev,
                                      num_layers=lay.num_local_layers,
                                      num_kv_heads=lay.num_local_kv_heads)
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            with torch.inference_mode():
                inputs = self.prepare_inputs(sched)
                hidden = self.model(inputs.input_ids, inputs.positions, dummy, inputs.meta)
                logits = self.model.compute_logits(hidden[inputs.logits_indices])
                del hidden
                # The heaviest sampling: temperature + top-k + top-p + logprobs on every row
                # (seeded: the global generator is not touched).
                n = logits.shape[0]
                Sampler().sample(logits, [SamplingParams(temperature=1.0, top_k=50, top_p=0.9,
                                                         logprobs=5, seed=0)] * n, [0] * n)
                del logits, inputs
            torch.cuda.synchronize(dev)
            peak = max(0, torch.cuda.max_memory_allocated(dev) - base)
            profiled = sched.num_scheduled_tokens
            del dummy
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        room = free - peak
        budgets = [room]
        if gpu_fraction is not None:
            budgets.append(int(gpu_fraction * total) - weights - peak)
        if kv_fraction is not None:
            budgets.append(int(kv_fraction * room))
        return MemoryProfile(total=int(total), weights=int(weights), activation_peak=int(peak),
                             free_after=int(free), profiled_tokens=profiled,
                             kv_bytes=max(0, min(budgets)), per_block=per_block)

    # -- step inputs -------------------------------------------------------------------------

    def _to_device(self, *parts: list[int]) -> list[torch.Tensor]:
        """int64 device tensors of ``parts``: on CUDA written into one pinned host buffer and
        moved by a single non-blocking copy (the returned tensors are views of one device
        buffer)."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if self.device.type != "cuda":
            flat = torch.tensor([x for p in parts for x in p], dtype=torch.long)
            return list(flat.split(sizes))
        if self._staged is not None and not self._staged.query():
            self._staged.synchronize()  # the last copy has read the staging buffer
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(max(total, 4096), dtype=torch.long, pin_memory=True)
        host = self._staging.numpy()
        at = 0
        for p in parts:
            host[at:at + len(p)] = p
            at += len(p)
        out = torch.empty(total, dtype=torch.long, device=self.device)
        out.copy_(self._staging[:total], non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return list(out.split(sizes))

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        B = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block: list[int] = []
        slot_offset: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        prompt_rows: list[int] = []
        sample_ids: list[str] = []
        max_blocks = max((len(r.block_ids) for r in sched.scheduled), default=0)
        width = max(max_blocks, 1)
        # Block tables [S, width], row-major, padded with 0.
        tables = [0] * (len(sched.scheduled) * width)
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
            tables[i * width: i * width + len(r.block_ids)] = r.block_ids
            if r.sample:
                # the last new token, or the last 1 + num_spec (the decoded token and each
                # draft: the target's choice after each of them): rows
                # [query_start_loc[i+1] - 1 - num_spec, query_start_loc[i+1])
                end = query_start_loc[-1]
                logits_rows.extend(range(end - 1 - r.num_spec, end))
                sample_ids.append(r.request_id)
            # position p is hidden row query_start_loc[i] + (p - start_pos)
            prompt_rows.extend(query_start_loc[-2] + p - r.start_pos
                               for p in r.prompt_logit_positions)
        ids_t, pos_t, sb_t, so_t, dsl_t, rows_t, tables_t, sl_t, qsl_t = self._to_device(
            input_ids, positions, slot_block, slot_offset, seq_lens[: sched.num_decodes],
            logits_rows + prompt_rows, tables, seq_lens, query_start_loc)
        meta = AttentionMetadata(
            num_decodes=sched.num_decodes,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=tables_t.view(len(sched.scheduled), width),
            slot_block=sb_t,
            slot_offset=so_t,
            decode_seq_lens=dsl_t,
            # int32 copies made on the device (no second host-to-device copy)
            seq_lens_t=sl_t.to(torch.int32),
            query_start_loc_t=qsl_t.to(torch.int32),
            max_query_len=max((len(r.token_ids) for r in sched.scheduled), default=0),
        )
        return StepInputs(ids_t, pos_t, meta, rows_t, sample_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor | None]:
        """Run one step; return the sampling request ids and their logits ([S, V] float32:
        1 + num_spec rows per request), followed by the prompt-logprob rows when the step has
        any ([S + P, V]).

        A pure-decode step replays the CUDA graph of its bucket when there is one; its logits
        are then a view of the graph's output, valid until the next step."""
        graphs = self.graphs
        if graphs is not None and graphs.applies(sched.scheduled, sched.num_decodes):
            logits = graphs.run(sched.scheduled)
            return [r.request_id for r in sched.scheduled], logits
        inputs = self.prepare_inputs(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        if self._trim is not None and sched.num_scheduled_tokens >= TRIM_AFTER_TOKENS:
            self._trim(0)  # the forward's activations are freed (TRIM_AFTER_TOKENS)
        if not inputs.logits_indices.numel():
            return [], None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return inputs.sample_request_ids, logits
