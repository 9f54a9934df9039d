"""Sparse mixture-of-experts feed-forward: Mixtral, Qwen3-MoE (and the expert execution
DeepSeek-V3 reuses).

Per layer, for the ``T`` flattened tokens ``x [T, H]``::

    router:  logits = x @ W_gate.T                  [T, E]   (E experts, replicated weights)
             probs  = softmax(logits) in float32    [T, E]
             weights, ids = top_k(probs)            [T, k]   (renormalised by their sum when
                                                              the checkpoint says so)
    experts: y_t = sum_j weights[t, j] * SwiGLU_{ids[t, j]}(x_t)
             SwiGLU_e(x) = down_e(silu(gate_e(x)) * up_e(x))

Execution (``grouped_experts``) groups the ``T * k`` (token, expert) pairs by expert with one
stable argsort instead of looping over tokens, runs one GEMM per active expert for gate and up
together (``w13[e] = [gate_e; up_e]``, ``[2I, H]``) and one for down, then puts the weighted
rows back in pair order with one copy and sums each token's ``k`` rows::

    pairs p = j * T + t      expert ids[t, j]            (flattened [k * T], choice-major)
    order = argsort(ids)     pairs of expert 0 | pairs of expert 1 | ... | other ranks' (EP)
    rows [a_e, a_e + n_e)    expert e's n_e pairs: x[order % T] -> SwiGLU_e -> * weight
    out = sum_j by_pair[j]   rows copied back to pair order [k, T, H], summed over choices

Within an expert the rows are transformers' (choice, then token), so each GEMM sees the rows
transformers' eager loop gives it; with top-2 the sum is then bit-identical to it.

``experts_forward`` is the entry point (router outputs -> expert outputs): on CUDA
``pick_experts_path`` chooses by shape between the Triton kernel (``triton_moe``, when the
runner installed it), the batched path (``batched_experts``: the pairs' weights gathered into
one ``bmm``, no host sync) and, outside a CUDA graph capture, the grouped one; elsewhere the
grouped one. All return this rank's *partial* sum: under tensor
parallelism each expert's intermediate dim is split like the dense MLP's (``w13`` rows and
``w2`` columns of ``I / tp``), under expert parallelism each rank holds whole experts
``[expert_start, expert_start + E_local)`` and skips the pairs of the others; either way the
caller all-reduces once.

Weights load under the checkpoint's own names (``MoeExperts``: ``experts.{e}.w1/w2/w3`` for
Mixtral, ``experts.{e}.gate_proj/up_proj/down_proj`` for Qwen3-MoE and DeepSeek); ``fuse``
stacks them into ``w13 [E_local, 2I, H]`` and ``w2 [E_local, H, I]`` and makes the per-expert
parameters views of those (no second copy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from disagg.model.kernels import LinearKernel, small_linear_applies

# Per-expert parameter names of each checkpoint family: (gate, up, down).
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mixtral / Qwen3-MoE router rule on ``logits [T, E]`` -> ``(weights, ids)``, each
    ``[T, top_k]``: softmax over the experts in float32, the ``top_k`` largest probabilities
    (descending), divided by their sum when ``renormalize`` (Mixtral always; Qwen3-MoE when
    ``norm_topk_prob``). Weights stay float32; ids are int64."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _linear(x: torch.Tensor, w: torch.Tensor, kernel: LinearKernel | None) -> torch.Tensor:
    if kernel is not None and small_linear_applies(x, w, None):
        return kernel(x, w, None)
    return nn.functional.linear(x, w)


def group_by_expert(ids: torch.Tensor, expert_start: int, num_local: int
                    ) -> tuple[torch.Tensor, list[int]]:
    """``(order, counts)``: the (token, expert) pairs of ``ids [T, k]``, flattened choice-major
    (pair ``p = j * T + t``: the token's ``j``-th choice), sorted by local expert (stable:
    within an expert by choice then token, the rows transformers gives each expert), and how
    many pairs each of the ``num_local`` experts ``[expert_start, expert_start + num_local)``
    has. Pairs of other experts (another rank's, under expert parallelism) sort after them
    and are not counted."""
    local = ids.t().reshape(-1) - expert_start
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local]
    return order, counts.tolist()  # the one host sync: the GEMM sizes


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, expert_start: int = 0,
                    kernel: LinearKernel | None = None) -> torch.Tensor:
    """This rank's share of ``sum_j weights[t, j] * SwiGLU_{ids[t, j]}(x_t)`` -> ``[T, H]``.

    ``x [T, H]``; ``ids`` / ``weights`` ``[T, k]`` from the router (global expert ids; the
    weights' dtype is the multiplication's, cast to x's dtype after it, as transformers
    does); ``w13 [E_local, 2I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``) and
    ``w2 [E_local, H, I]`` hold experts ``[expert_start, expert_start + E_local)``. Pairs
    routed elsewhere contribute nothing. ``kernel``: the CPU small-M GEMM for few rows.
    One GEMM pair per active expert; each token's ``k`` contributions summed in choice order.
    """
    t, k = ids.shape
    num_local, inter = w13.shape[0], w2.shape[-1]
    order, counts = group_by_expert(ids, expert_start, num_local)
    m = sum(counts)
    if m == 0:
        return torch.zeros_like(x)
    order = order[:m]
    token = order % t                          # pair j * T + t -> its token
    xs = x.index_select(0, token)              # [m, H], grouped by expert
    ys = torch.empty_like(xs)
    at = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up = _linear(xs[at:at + n], w13[e], kernel)          # [n, 2I]
        # silu(gate) * up in place, in gate's columns (no temporaries; rows stay strided)
        h = nn.functional.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
        if kernel is not None and small_linear_applies(h, w2[e], None):
            ys[at:at + n] = kernel(h, w2[e], None)                 # [n, H]
        else:
            torch.mm(h, w2[e].t(), out=ys[at:at + n])              # straight into ys
        at += n
    w = weights.t().reshape(-1).index_select(0, order)[:, None]
    # The weights' dtype for the product, then x's (transformers' rounding); float32: in place.
    scaled = ys.mul_(w) if w.dtype == ys.dtype else (ys * w).to(x.dtype)
    # Back to pair order j * T + t, then sum over the choices j: a copy and a reduction
    # (index_add_ into [T, H] measured 1.7-11x slower on a 2-core CPU, 2 to 1024 pairs of
    # 512 floats: it adds row by row). Pairs of other ranks' experts stay 0.
    by_pair = (x.new_empty if m == t * k else x.new_zeros)(k * t, x.shape[1])
    by_pair.index_copy_(0, order, scaled)
    return by_pair.view(k, t, -1).sum(dim=0)


def batched_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, expert_start: int = 0
                    ) -> torch.Tensor:
    """``grouped_experts`` without a host sync (the GPU path: capturable in a CUDA graph):
    each pair gathers its expert's weights and all pairs run as two ``bmm``. Moves
    ``T * k`` expert matrices, so it pays for decode-sized batches on a GPU (the weights are
    read once per pair instead of once per expert: ``experts_forward`` bounds the pairs)."""
    t, k = ids.shape
    num_local, inter = w13.shape[0], w2.shape[-1]
    local = ids.reshape(-1) - expert_start
    mine = (local >= 0) & (local < num_local)
    local = torch.where(mine, local, 0)
    xs = x[:, None, :].expand(t, k, x.shape[1]).reshape(t * k, -1, 1)  # [T k, H, 1]
    gate_up = torch.bmm(w13.index_select(0, local), xs)[..., 0]         # [T k, 2I]
    h = nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    ys = torch.bmm(w2.index_select(0, local), h[:, :, None])[..., 0]    # [T k, H]
    w = torch.where(mine, weights.reshape(-1), 0)
    scaled = (ys * w[:, None]).to(x.dtype).view(t, k, -1)
    # Sum over j in order j = 0, 1, ... (no atomics: deterministic).
    return scaled.sum(dim=1)


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      int], torch.Tensor]

# -- the path per shape on CUDA ---------------------------------------------------------------
# Fitted to bench/results/gpu_moe_check.txt (H200, torch 2.11, bf16, eager, CUDA events; a
# Qwen3-30B-A3B layer: H 2048, 128 experts x I 768, top-8; a Mixtral-8x7B layer: H 4096,
# 8 experts x I 14336, top-2; 1 to 4096 tokens). See pick_experts_path.
# The file's device-to-device copy, bytes/s: how fast the experts' weights are read.
COPY_BW = 4.17e12
# grouped at Mixtral x 4096 tokens (compute-bound): 2 * 8192 * 3 * 14336 * 4096 flop in 5.438 ms.
GEMM_RATE = 531e12
# grouped's host part (the count sync, then a GEMM pair per expert hit): least squares over
# Qwen3 at 1/8/64/512 tokens (8/49/124/128 experts hit in 0.794/3.112/7.565/7.628 ms) of the
# time less the hit experts' weight reads.
GROUPED_HOST_S = 0.31e-3
GROUPED_EXPERT_S = 0.055e-3
# batched: Mixtral at 1/8 tokens gathered 0.70/5.64 GB of expert weights in 1.585/11.826 ms.
# Qwen3's 0.08/0.60 GB took 0.275/0.561 ms (1.9 TB/s); the slower rate keeps large experts off.
BATCHED_HOST_S = 0.12e-3
BATCHED_BW = 0.48e12
# The kernel's launches (pair layout + 2 Triton): Qwen3 at 8 tokens took 0.742 ms where its
# weights need 0.111 ms (the roofline column).
KERNEL_HOST_S = 0.63e-3
# Not measured yet (the table's kernel had 16-row tiles): the re-tiled kernel's GEMM rate taken
# as half of cuBLAS's, so compute-bound shapes stay on grouped until a device run says more.
KERNEL_GEMM_RATE = GEMM_RATE / 2
# Outside a capture the batched path's gathered copy of the weights is bounded (memory).
BATCHED_MAX_BYTES = 2 << 30


def expected_experts_hit(num_tokens: int, top_k: int, num_local: int) -> float:
    """Distinct experts ``num_tokens`` tokens routed uniformly at random to ``top_k`` of
    ``num_local`` each are expected to reach: ``E (1 - (1 - k/E)^T)`` (Qwen3 at 8 tokens:
    51.6, measured 49; Mixtral at 8 tokens: 7.2, measured 7)."""
    if num_local <= 0 or num_tokens <= 0:
        return 0.0
    miss = max(0.0, 1.0 - top_k / num_local)
    return num_local * (1.0 - miss ** num_tokens)


def estimate_experts_seconds(num_tokens: int, top_k: int, num_local: int, hidden: int,
                             inter: int, itemsize: int) -> dict[str, float]:
    """Estimated seconds of one eager call of each path on CUDA (``"kernel"``,
    ``"batched"``, ``"grouped"``) for these shapes, from the constants above:

    - grouped: its host part (count sync + a GEMM pair per expert hit) plus the device's
      time, the larger of reading the hit experts' weights and the GEMMs' flops;
    - kernel: its launches plus the same reads (it reads each hit expert's weights once per
      block of ``triton_moe.pick_block_m`` rows: about once) or its flops at
      ``KERNEL_GEMM_RATE``;
    - batched: its launches plus every pair's gathered weights (``T k x 3 I H`` elements).
    """
    pairs = num_tokens * top_k
    expert_bytes = 3 * inter * hidden * itemsize
    hit = expected_experts_hit(num_tokens, top_k, num_local)
    reads = hit * expert_bytes / COPY_BW
    flops = 2.0 * pairs * 3 * inter * hidden
    return {
        "kernel": KERNEL_HOST_S + max(reads, flops / KERNEL_GEMM_RATE),
        "batched": BATCHED_HOST_S + pairs * expert_bytes / BATCHED_BW,
        "grouped": GROUPED_HOST_S + hit * GROUPED_EXPERT_S + max(reads, flops / GEMM_RATE),
    }


@functools.lru_cache(maxsize=4096)
def pick_experts_path(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int,
                      itemsize: int, capturing: bool, has_kernel: bool) -> str:
    """The path ``experts_forward`` takes on CUDA: ``"kernel"`` (the Triton kernel; only
    with ``has_kernel``), ``"batched"`` or ``"grouped"``. A pure function of the shapes
    (``num_local`` experts of ``3 x inter x hidden`` elements of ``itemsize`` bytes).

    - Inside a CUDA graph capture (decode) no host sync is allowed, so never grouped: the
      kernel when there is one, else batched. By bytes the kernel never moves more: it
      reads each hit expert's weights once per block of rows (at most once per pair) where
      batched copies every pair's expert (``T k x 3 I H x itemsize`` bytes) before its
      ``bmm``; its extra launches are the pair layout's small ops, which a graph replays
      without host cost.
    - Outside, the cheapest of ``estimate_experts_seconds`` (batched only while its gathered
      copy stays under ``BATCHED_MAX_BYTES``). On the shapes it was fitted to, with the
      kernel: Qwen3 at 1-2 tokens batched (measured at 1: 0.275 ms; grouped 0.794, the old
      kernel 0.760); 4+ tokens the kernel (at 8 the table's best was batched, 0.561 ms
      against the old kernel's 0.742: batched's estimate, 1.38 ms, uses Mixtral's slower
      gather rate; grouped pays 55 us of host work per expert hit, 7.6 ms at 124+ experts);
      Mixtral at 1-4 tokens grouped (measured 0.468 ms at 1), at 8-256 the kernel (the same
      weight reads, its 0.63 ms of launches against grouped's 0.31 + 0.055 per expert: the
      estimates are within 10%), at 512+ grouped (compute-bound: cuBLAS's 531 TFLOP/s
      against the kernel's assumed half; measured 1.456 / 5.438 ms at 512 / 4096 tokens).
      Without the kernel: batched for Qwen3 up to 16 tokens, grouped beyond and for Mixtral
      (the table's fastest of the two on every row it timed both).
    The kernel's host constant comes from the 16-row tiles' launches and its GEMM rate is an
    assumption; the device run of ``bench.gpu.check_moe`` prints each pick and its time next
    to every path's, eager and in a CUDA graph.
    """
    if capturing:
        return "kernel" if has_kernel else "batched"
    est = estimate_experts_seconds(num_tokens, top_k, num_local, hidden, inter, itemsize)
    allowed = ["grouped"]
    if has_kernel:
        allowed.append("kernel")
    if num_tokens * top_k * 3 * inter * hidden * itemsize <= BATCHED_MAX_BYTES:
        allowed.append("batched")
    return min(allowed, key=est.__getitem__)


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, expert_start: int = 0,
                    kernel: LinearKernel | None = None,
                    fused: ExpertsFn | None = None) -> torch.Tensor:
    """Router outputs -> this rank's partial expert output ``[T, H]`` (see the module doc).

    The one interface every path shares. On CUDA ``pick_experts_path`` chooses from the
    shapes between ``fused`` (a device kernel, e.g. the Triton one, same arguments; when
    given), ``batched_experts`` and (not while a CUDA graph is being captured: it reads the
    row counts on the host) ``grouped_experts``. Elsewhere ``fused`` when given, else
    ``grouped_experts``. Callers add shared experts and all-reduce across the
    tensor/expert-parallel ranks themselves.
    """
    if x.device.type != "cuda":
        if fused is not None:
            return fused(x, ids, weights, w13, w2, expert_start)
        return grouped_experts(x, ids, weights, w13, w2, expert_start, kernel)
    t, k = ids.shape
    path = pick_experts_path(t, k, w13.shape[0], x.shape[1], w2.shape[-1], x.element_size(),
                             torch.cuda.is_current_stream_capturing(), fused is not None)
    if path == "kernel" and fused is not None:
        return fused(x, ids, weights, w13, w2, expert_start)
    if path == "batched":
        return batched_experts(x, ids, weights, w13, w2, expert_start)
    return grouped_experts(x, ids, weights, w13, w2, expert_start, kernel)


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Experts ``[lo, hi)`` of expert-parallel rank ``ep_rank``: an even, contiguous split
    (``num_experts`` must be a multiple of ``ep_size``; ``check_parallel_split`` says so)."""
    per = num_experts // ep_size
    return ep_rank * per, (ep_rank + 1) * per


class ExpertMLP(nn.Module):
    """One expert's SwiGLU weights under the checkpoint's names (``names``: gate, up, down).
    Only holds them: ``MoeExperts`` runs all experts at once."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False))
        setattr(self, up, nn.Linear(hidden, inter, bias=False))
        setattr(self, down, nn.Linear(inter, hidden, bias=False))
        self.names = names

    def parts(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        gate, up, down = (getattr(self, n) for n in self.names)
        return gate, up, down


class MoeExperts(nn.ModuleDict):
    """This rank's experts ``[expert_start, expert_start + num_local)``, each with ``inter``
    intermediate rows (the TP rank's share), keyed by *global* expert id so parameter names
    match the checkpoint (``experts.5.w1.weight`` on the rank holding expert 5)."""

    small_m_kernel: LinearKernel | None = None
    fused_kernel: ExpertsFn | None = None

    def __init__(self, hidden: int, inter: int, expert_start: int, num_local: int,
                 names: tuple[str, str, str] = QWEN_EXPERT_NAMES) -> None:
        super().__init__({str(e): ExpertMLP(hidden, inter, names)
                          for e in range(expert_start, expert_start + num_local)})
        self.expert_start = expert_start
        self.num_local = num_local
        self.inter = inter
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def fuse(self) -> None:
        """Stack the loaded weights into ``w13 [E_local, 2I, H]`` / ``w2 [E_local, H, I]``;
        the per-expert parameters become views of them. Call once the weights are loaded (on
        their device; moving the model afterwards is not supported)."""
        if self.w13 is not None:
            return
        mlps = [m.parts() for m in self.values()]  # type: ignore[operator]
        w13 = torch.stack([torch.cat([g.weight.detach(), u.weight.detach()])
                           for g, u, _ in mlps])
        w2 = torch.stack([d.weight.detach() for _, _, d in mlps])
        i = self.inter
        for e, (g, u, d) in enumerate(mlps):
            g.weight = nn.Parameter(w13[e, :i], requires_grad=False)
            u.weight = nn.Parameter(w13[e, i:], requires_grad=False)
            d.weight = nn.Parameter(w2[e], requires_grad=False)
        self.w13, self.w2 = w13, w2

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """This rank's partial output ``[T, H]`` for router outputs ``ids`` / ``weights``."""
        if self.w13 is None:
            self.fuse()
        assert self.w13 is not None and self.w2 is not None
        return experts_forward(x, ids, weights, self.w13, self.w2, self.expert_start,
                               self.small_m_kernel, self.fused_kernel)


def use_experts_kernel(model: nn.Module, kernel: ExpertsFn | None) -> int:
    """Let every ``MoeExperts`` of ``model`` run ``kernel`` (None: the PyTorch paths); the
    runner sets the Triton one on CUDA once ``triton_moe.triton_experts_kernel`` checked it on
    the device. Returns how many expert groups it set (0: a dense model)."""
    groups = [m for m in model.modules() if isinstance(m, MoeExperts)]
    for m in groups:
        m.fused_kernel = kernel
    return len(groups)


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated) + ``MoeExperts``, then one all-reduce (``reduce``) of the
    ranks' partial sums: Mixtral's ``block_sparse_moe`` and Qwen3-MoE's ``mlp``.

    ``renormalize``: divide the top-k weights by their sum. ``weights_in_act_dtype``: cast
    them to the activations' dtype before use (Qwen3-MoE); else they stay float32 (Mixtral).
    """

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 renormalize: bool, reduce: Callable[[torch.Tensor], torch.Tensor],
                 expert_start: int = 0, num_local: int | None = None,
                 names: tuple[str, str, str] = QWEN_EXPERT_NAMES,
                 weights_in_act_dtype: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_act_dtype = weights_in_act_dtype
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = MoeExperts(hidden, inter, expert_start,
                                  num_experts if num_local is None else num_local, names)
        self._reduce = reduce

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, ids)`` ``[T, k]`` for ``x [T, H]``."""
        weights, ids = softmax_topk(nn.functional.linear(x, self.gate.weight), self.top_k,
                                    self.renormalize)
        if self.weights_in_act_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return self._reduce(self.experts(x, ids, weights))
