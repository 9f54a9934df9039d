"""Mixture of experts: the router rules, grouped expert execution against a per-token
reference and against transformers' experts, and Mixtral / Qwen3-MoE against transformers
(float32, CPU) alone, as tensor-parallel and expert-parallel ranks (threads) and as pipeline
stages; the engine's greedy tokens against transformers' generate()."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model import Seq, hf_logits, make_batch, run  # noqa: E402

from disagg import LLM, SamplingParams  # noqa: E402
from disagg.config import (  # noqa: E402
    ConfigError,
    EngineConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    build_engine_config,
    check_parallel_split,
)
from disagg.model.loader import allocate_kv_cache, load_model  # noqa: E402
from disagg.model.moe import (  # noqa: E402
    batched_experts,
    expert_range,
    experts_forward,
    grouped_experts,
    softmax_topk,
)

ATOL = 1e-4
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# name -> (transformers config class, extra config kwargs)
VARIANTS: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      sliding_window=None)),
    # top-k weights not renormalised; layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3,
                                         moe_intermediate_size=32, norm_topk_prob=False,
                                         mlp_only_layers=[1], head_dim=32)),
    # renormalised; only layer 1 sparse (decoder_sparse_step 2)
    "qwen3_moe_step2": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=48, norm_topk_prob=True,
                                               decoder_sparse_step=2)),
}


def _make_checkpoint(out_dir: str, variant: str) -> str:
    cls_name, extra = VARIANTS[variant]
    cfg = getattr(transformers, cls_name)(**{**SIZES, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # weights large enough that every part shows in the output
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {v: _make_checkpoint(str(root / v), v) for v in VARIANTS}


@pytest.fixture(scope="module")
def hf_models(checkpoints: dict[str, str]) -> dict[str, torch.nn.Module]:
    return {v: transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
        for v, d in checkpoints.items()}


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SIZES["vocab_size"], (n,), generator=g).tolist()


# -- the router and the expert execution -------------------------------------------------------


def test_softmax_topk_rules() -> None:
    # softmax(log p) = p: probabilities 0.1, 0.2, 0.3, 0.4 and 0.4, 0.3, 0.2, 0.1
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]).log()
    w, ids = softmax_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2], [0, 1]] and ids.dtype == torch.int64
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.3], [0.4, 0.3]]))
    w, ids = softmax_topk(logits, 2, renormalize=True)  # divided by 0.7
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 3 / 7], [4 / 7, 3 / 7]]))
    # float32 routing from bfloat16 logits
    w, ids = softmax_topk(logits.to(torch.bfloat16), 3, renormalize=True)
    assert w.dtype == torch.float32 and ids.tolist() == [[3, 2, 1], [0, 1, 2]]
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


def _random_experts(e: int, h: int, i: int, t: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    w, ids = softmax_topk(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, w, ids


def _per_token(x, w13, w2, w, ids) -> torch.Tensor:
    """The definition, one token and one chosen expert at a time."""
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            out[t] += w[t, j] * (w2[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize("t", [1, 5, 40])
def test_grouped_and_batched_equal_the_per_token_definition(t: int) -> None:
    x, w13, w2, w, ids = _random_experts(e=6, h=16, i=12, t=t, k=2)
    ref = _per_token(x, w13, w2, w, ids)
    torch.testing.assert_close(grouped_experts(x, ids, w, w13, w2), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched_experts(x, ids, w, w13, w2), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(experts_forward(x, ids, w, w13, w2), ref, atol=1e-5, rtol=0)
    # Expert parallel: 3 ranks of 2 experts each; their partial sums add up to the whole.
    parts = [grouped_experts(x, ids, w, w13[lo:hi], w2[lo:hi], expert_start=lo)
             for lo, hi in (expert_range(6, 3, r) for r in range(3))]
    torch.testing.assert_close(sum(parts[1:], parts[0]), ref, atol=1e-5, rtol=0)
    parts = [batched_experts(x, ids, w, w13[lo:hi], w2[lo:hi], expert_start=lo)
             for lo, hi in (expert_range(6, 3, r) for r in range(3))]
    torch.testing.assert_close(sum(parts[1:], parts[0]), ref, atol=1e-5, rtol=0)
    # Tensor parallel: each expert's intermediate rows split in two, partials summed.
    i = 12
    halves = [grouped_experts(x, ids, w,
                              torch.cat([w13[:, s:s + 6], w13[:, i + s:i + s + 6]], dim=1),
                              w2[:, :, s:s + 6]) for s in (0, 6)]
    torch.testing.assert_close(halves[0] + halves[1], ref, atol=1e-5, rtol=0)


def test_grouped_is_transformers_mixtral_experts_bit_for_bit() -> None:
    """Same GEMMs on the same rows, added in the same (ascending expert) order."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=6,
                                     num_experts_per_tok=2)
    x, w13, w2, w, ids = _random_experts(e=6, h=16, i=12, t=33, k=2, seed=4)
    ref_mod = MixtralExperts(cfg)
    with torch.no_grad():
        ref_mod.gate_up_proj.copy_(w13)
        ref_mod.down_proj.copy_(w2)
        ref = ref_mod(x, ids, w)
    assert torch.equal(grouped_experts(x, ids, w, w13, w2), ref)


def test_no_pair_for_this_rank_gives_zeros() -> None:
    x, w13, w2, w, ids = _random_experts(e=4, h=8, i=6, t=3, k=1)
    ids = torch.zeros_like(ids)  # every token to expert 0, which rank [2, 4) does not hold
    assert not grouped_experts(x, ids, w, w13[2:], w2[2:], expert_start=2).any()
    assert not batched_experts(x, ids, w, w13[2:], w2[2:], expert_start=2).any()


# -- the models against transformers ------------------------------------------------------------


def test_config_reads_the_moe_fields(checkpoints) -> None:
    mix = ModelConfig.from_dir(checkpoints["mixtral"])
    assert mix.architecture == "mixtral" and mix.moe is not None
    assert (mix.moe.num_experts, mix.moe.num_experts_per_tok, mix.moe.moe_intermediate_size,
            mix.moe.norm_topk_prob) == (8, 2, 96, True)
    assert all(mix.is_moe_layer(i) for i in range(3))
    qwen = ModelConfig.from_dir(checkpoints["qwen3_moe"])
    assert qwen.qk_norm and qwen.moe is not None and not qwen.moe.norm_topk_prob
    assert [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]
    step2 = ModelConfig.from_dir(checkpoints["qwen3_moe_step2"])
    assert [step2.is_moe_layer(i) for i in range(3)] == [False, True, False]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode_matches_transformers(variant, checkpoints, hf_models) -> None:
    model = load_model(checkpoints[variant], dtype=torch.float32, device="cpu")
    b = 4
    kv = allocate_kv_cache(model.config, num_blocks=12, block_size=b, dtype=torch.float32,
                           device="cpu")
    table = [9, 2, 11, 4, 7, 0]
    toks = prompt(13, seed=2)
    outs, start = [], 0
    for n in (6, 3, 4):  # chunks of different lengths, not block aligned
        outs.append(run(model, kv, [Seq(table, start, toks[start:start + n])], 0, b))
        start += n
    for _ in range(5):
        nxt = int(outs[-1][-1].argmax())
        toks.append(nxt)
        outs.append(run(model, kv, [Seq(table, len(toks) - 1, [nxt])], 1, b))
    ours = torch.cat(outs)
    torch.testing.assert_close(ours, hf_logits(hf_models[variant], toks), atol=ATOL, rtol=0)


def _run_ranks(ranks: list, toks: list[int]) -> list[torch.Tensor]:
    """The TP ranks as threads, summing their partial outputs through a barrier."""
    n = len(ranks)
    slots: list[torch.Tensor | None] = [None] * n
    barrier = threading.Barrier(n)
    results: list[torch.Tensor | None] = [None] * n

    def reducer(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x
            barrier.wait()
            total = sum(slots[1:], slots[0])
            barrier.wait()  # nobody overwrites a slot before all have read
            return total
        return reduce

    def work(rank: int) -> None:
        m = ranks[rank]
        m.tp_all_reduce = reducer(rank)
        kv = allocate_kv_cache(m.config, 4, 4, torch.float32, "cpu",
                               num_kv_heads=m.num_local_kv_heads)
        results[rank] = run(m, kv, [Seq([1, 3, 0], 0, toks)], 0, 4)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results), "a rank thread failed"
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("variant,ep", [("mixtral", False), ("mixtral", True),
                                        ("qwen3_moe", False), ("qwen3_moe", True)])
def test_tensor_and_expert_parallel_ranks_match_transformers(variant, ep, checkpoints,
                                                             hf_models) -> None:
    """tp=2: each rank holds half of every expert's rows, or (expert parallel) half of the
    experts whole, reading only those from the checkpoint; the partial sums give
    transformers' logits."""
    path = checkpoints[variant]
    ranks = [load_model(path, tp_rank=r, tp_size=2, expert_parallel=ep) for r in range(2)]
    full = load_model(path)
    layer = "model.layers.0." + ("block_sparse_moe" if variant == "mixtral" else "mlp")
    gate_name = ".w1.weight" if variant == "mixtral" else ".gate_proj.weight"
    full_p = dict(full.named_parameters())
    for r, m in enumerate(ranks):
        params = dict(m.named_parameters())
        held = sorted(int(n.split(".experts.")[1].split(".")[0]) for n in params
                      if n.startswith(layer + ".experts.") and n.endswith(gate_name))
        if ep:
            assert held == list(range(4 * r, 4 * r + 4))  # 8 experts over 2 ranks
            name = f"{layer}.experts.{4 * r + 1}{gate_name}"
            torch.testing.assert_close(params[name], full_p[name])
        else:
            assert held == list(range(8))
            name = f"{layer}.experts.5{gate_name}"
            rows = full_p[name].shape[0] // 2
            torch.testing.assert_close(params[name], full_p[name][r * rows:(r + 1) * rows])
        # the router is whole on every rank
        torch.testing.assert_close(params[f"{layer}.gate.weight"],
                                   full_p[f"{layer}.gate.weight"])
    toks = prompt(9)
    ref = hf_logits(hf_models[variant], toks)
    for out in _run_ranks(ranks, toks):
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_pipeline_stages_chain_to_transformers(checkpoints, hf_models) -> None:
    path = checkpoints["qwen3_moe"]  # stage 0: layers [0, 2) (sparse, dense), stage 1: [2, 3)
    cfg = ModelConfig.from_dir(path)
    first = load_model(path, cfg, layer_range=(0, 2))
    last = load_model(path, cfg, layer_range=(2, 3))
    kv0 = allocate_kv_cache(cfg, 4, 4, torch.float32, "cpu", num_layers=2)
    kv1 = allocate_kv_cache(cfg, 4, 4, torch.float32, "cpu", num_layers=1)
    toks = prompt(10)
    ids, pos, meta = make_batch([Seq([2, 0, 3], 0, toks)], 0, 4)
    with torch.inference_mode():
        h = first(ids, pos, kv0, meta)
        logits = last.compute_logits(last(None, pos, kv1, meta, hidden_states=h))
    torch.testing.assert_close(logits, hf_logits(hf_models["qwen3_moe"], toks), atol=ATOL,
                               rtol=0)


def test_experts_are_views_of_the_stacked_weights(checkpoints) -> None:
    model = load_model(checkpoints["mixtral"])
    experts = model.model.layers["0"].block_sparse_moe.experts
    assert experts.w13 is not None and experts.w13.shape == (8, 2 * 96, 64)
    e3 = experts["3"]
    assert e3.w1.weight.data_ptr() == experts.w13[3].data_ptr()
    assert e3.w3.weight.data_ptr() == experts.w13[3, 96:].data_ptr()
    assert e3.w2.weight.data_ptr() == experts.w2[3].data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    assert sum(storages.values()) == sum(p.nbytes for p in model.parameters())


def test_decode_with_the_small_gemm_kernel_matches(checkpoints, hf_models) -> None:
    """The CPU small-M kernel (the runner's choice for decode rows) gives the same logits."""
    from disagg.model.kernels import small_linear_kernel

    kernel = small_linear_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler / kernels disabled")
    model = load_model(checkpoints["mixtral"])
    model.use_linear_kernel(kernel)
    assert model.model.layers["1"].block_sparse_moe.experts.small_m_kernel is kernel
    toks = prompt(7, seed=5)
    kv = allocate_kv_cache(model.config, 4, 4, torch.float32, "cpu")
    outs = [run(model, kv, [Seq([0, 1], 0, toks[:1])], 0, 4)]
    outs += [run(model, kv, [Seq([0, 1], p, [toks[p]])], 1, 4) for p in range(1, len(toks))]
    torch.testing.assert_close(torch.cat(outs), hf_logits(hf_models["mixtral"], toks),
                               atol=ATOL, rtol=0)


# -- configuration ------------------------------------------------------------------------------


def test_expert_parallel_config_errors(checkpoints, tiny_llama) -> None:
    # 8 experts over 3 ranks
    with pytest.raises(ConfigError, match="num_experts=8 is not divisible by "
                                          "tensor_parallel_size=3"):
        EngineConfig(model_dir="m", model=ModelConfig.from_dir(checkpoints["mixtral"]),
                     parallel=ParallelConfig(3, 1, enable_expert_parallel=True))
    with pytest.raises(ConfigError, match="enable_expert_parallel: llama has no experts"):
        build_engine_config(tiny_llama, enable_expert_parallel=True)
    assert build_engine_config(checkpoints["mixtral"], tensor_parallel_size=2,
                               enable_expert_parallel=True).parallel.enable_expert_parallel
    # Qwen3-MoE's experts split over TP need moe_intermediate_size divisible (32 over 3: no)
    with pytest.raises(ConfigError, match="moe_intermediate_size=32"):
        check_parallel_split(ModelConfig.from_dir(checkpoints["qwen3_moe"]),
                             ParallelConfig(3, 1))
    # A Mixtral has no dense MLP: under expert parallelism no intermediate size is split.
    odd = ModelConfig(architecture="mixtral", vocab_size=64, hidden_size=64,
                      intermediate_size=98, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, moe=MoEConfig(8, 2, 98))
    check_parallel_split(odd, ParallelConfig(4, 1, enable_expert_parallel=True))
    with pytest.raises(ConfigError, match="moe_intermediate_size=98 is not divisible"):
        check_parallel_split(odd, ParallelConfig(4, 1))
    cfg = json.loads(Path(checkpoints["mixtral"], "config.json").read_text())
    with pytest.raises(ConfigError, match="sliding_window: 64"):
        ModelConfig.from_hf_dict({**cfg, "sliding_window": 64})
    with pytest.raises(ConfigError, match="num_local_experts"):
        ModelConfig.from_hf_dict({k: v for k, v in cfg.items() if k != "num_local_experts"})


# -- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``disagg model tiny`` checkpoints (with tokenizers): what the engine tests serve."""
    from disagg.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_moe")
    return {"mixtral": write_tiny_checkpoint(str(root / "mixtral"), "mixtral", seed=3),
            "qwen3_moe": write_tiny_checkpoint(str(root / "qwen3_moe"), "qwen3_moe", seed=3,
                                               num_hidden_layers=3, mlp_only_layers=(1,))}


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # compare n tokens
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]


ENGINE_OPTS = dict(tokens_per_block=8, kv_cache_tokens=2048, max_num_tokens=24,
                   max_batch_size=8, device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def engine_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab - 8, (n,), generator=g).tolist() for n in (3, 17, 30, 9)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_engine_greedy_matches_transformers(tiny_moe, arch) -> None:
    """Chunked prefills mixed with decodes, several requests per step."""
    prompts = engine_prompts(512)
    with LLM(tiny_moe[arch], **ENGINE_OPTS) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == hf_greedy(tiny_moe[arch], prompts, GREEDY.max_tokens)


PARALLEL_CASES = [  # (arch, tp, pp, expert parallel)
    ("mixtral", 2, 1, False),
    ("mixtral", 2, 1, True),
    ("mixtral", 1, 2, False),
    ("qwen3_moe", 2, 1, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,tp,pp,ep", PARALLEL_CASES,
                         ids=[f"{a}-tp{t}-pp{p}{'-ep' if e else ''}"
                              for a, t, p, e in PARALLEL_CASES])
def test_parallel_workers_match_transformers(tiny_moe, arch, tp, pp, ep) -> None:
    """Rank processes (spawn, gloo): greedy tokens of transformers."""
    prompts = engine_prompts(512)
    with LLM(tiny_moe[arch], tensor_parallel_size=tp, pipeline_parallel_size=pp,
             enable_expert_parallel=ep, **ENGINE_OPTS) as llm:
        ex = llm.engine.runner
        ffn = ex.runner.model.model.layers["0"].feed_forward  # rank 0's first layer
        # 8 experts: all of them (a slice of each) on rank 0, or the first half whole
        assert list(ffn.experts) == [str(e) for e in range(4 if ep else 8)]
        full = llm.engine.config.model.moe.moe_intermediate_size
        assert ffn.experts.w2.shape[-1] == (full if ep else full // tp)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        if tp > 1:
            assert all(s["all_reduce_calls"] > 0 for s in ex.comm_stats())
    assert outs == hf_greedy(tiny_moe[arch], prompts, GREEDY.max_tokens)


def test_tiny_cli_writes_moe_checkpoints(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open

    from disagg.cli import main

    out = tmp_path / "q"
    assert main(["model", "tiny", str(out), "--arch", "qwen3_moe", "--num-experts", "4",
                 "--experts-per-token", "3", "--moe-intermediate-size", "16"]) == 0
    cfg = ModelConfig.from_dir(str(out))
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm and cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok,
            cfg.moe.moe_intermediate_size) == (4, 3, 16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.1.mlp.experts.3.down_proj.weight").get_shape() == [
            64, 16]
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.0.mlp.up_proj.weight" \
        not in names
    out = tmp_path / "m"
    assert main(["model", "tiny", str(out), "--arch", "mixtral"]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.experts.7.w2.weight").get_shape() \
            == [64, 128]
    assert main(["model", "tiny", str(tmp_path / "bad"), "--arch", "mixtral",
                 "--experts-per-token", "9"]) == 1
    assert "num_experts_per_tok" in capsys.readouterr().out


# -- CUDA (skipped without a device; the Triton kernels also: tests/test_triton_moe.py) ------

_skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA device")


def needs_cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Marked ``gpu`` (bench/gpu/run_all.sh runs ``pytest -m gpu``) and skipped without CUDA."""
    return pytest.mark.gpu(_skip_without_cuda(test))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 24, 300])
def test_cuda_paths_match_the_cpu_reference(dtype: torch.dtype, t: int) -> None:
    """On the device: the Triton kernels (when triton is there), the batched and the grouped
    PyTorch paths, all against ``grouped_experts`` on CPU in float32."""
    from disagg.model.triton_attention import HAS_TRITON

    e, k, h, i = 8, 2, 256, 160
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    w, ids = softmax_topk(torch.randn(t, e, generator=g), k, renormalize=True)
    want = grouped_experts(x.to(dtype).float(), ids, w, w13.to(dtype).float(),
                           w2.to(dtype).float())
    dev = [a.cuda() for a in (x.to(dtype), ids, w, w13.to(dtype), w2.to(dtype))]
    paths = {"grouped": grouped_experts, "batched": batched_experts}
    if HAS_TRITON:
        from disagg.model.triton_moe import triton_grouped_experts
        paths["triton"] = triton_grouped_experts
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, fn in paths.items():
        got = fn(*dev).float().cpu()
        assert (got - want).abs().max() <= tol * (1 + want.abs().max()), name


@needs_cuda
def test_runner_check_accepts_the_kernel_on_this_device() -> None:
    from disagg.model.triton_attention import HAS_TRITON
    from disagg.model.triton_moe import triton_experts_kernel

    if not HAS_TRITON:
        pytest.skip("needs triton")
    assert triton_experts_kernel(torch.device("cuda"), torch.bfloat16, 256, 64) is not None


@needs_cuda
def test_engine_on_cuda_matches_transformers(tiny_moe) -> None:
    """The whole model on the device (CUDA graphs for decode, the Triton experts when they
    pass the runner's check): transformers' greedy tokens (computed on CPU)."""
    prompts = engine_prompts(512)
    with LLM(tiny_moe["mixtral"], **{**ENGINE_OPTS, "device": "cuda"}) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs == hf_greedy(tiny_moe["mixtral"], prompts, GREEDY.max_tokens)
