"""DeepSeek-V3 (MLA over a latent paged cache, grouped sigmoid routing) against transformers,
and the "mla" cache kind: config, cache shape, TP ranks, layouts, pull plans, payloads and the
refusal of a peer with another cache kind (CPU, float32, tiny checkpoints)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model import Seq, run  # noqa: E402

from disagg.config import (  # noqa: E402
    ConfigError,
    DeepseekMoEConfig,
    ModelConfig,
    ParallelConfig,
)
from disagg.contracts.params import ContextParams  # noqa: E402
from disagg.kv_connector.kvcopy import gather_tokens  # noqa: E402
from disagg.kv_connector.pull_plan import plan_pull  # noqa: E402
from disagg.layout import (  # noqa: E402
    ParallelLayout,
    RankLayout,
    WorkerLayout,
    check_compatible,
    plan_pulls,
)
from disagg.model.deepseek import grouped_topk  # noqa: E402
from disagg.model.loader import (  # noqa: E402
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    load_model,
)
from disagg.transfer.base import ReadRequest  # noqa: E402
from disagg.transfer.payload import gather_into, payload_shape  # noqa: E402

ATOL = 1e-4
VOCAB = 128
# kv_lora_rank 24 + qk_rope_head_dim 8: a 32-wide latent row per token and layer.
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
             topk_group=1, first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=32,
             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
             max_position_embeddings=256)
WIDTH = 24 + 8

VARIANTS = {
    # low-rank q, interleaved rope pairs (DeepSeek-V3's own settings)
    "lora_q": {},
    # q_proj, rotate-half rope, biases on q_a / kv_a / o_proj... (q_proj has none)
    "plain_q": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True),
    # YaRN: scaled frequencies, cos/sin times mscale ratio, softmax scale times mscale^2
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                  "original_max_position_embeddings": 64, "mscale": 1.0,
                                  "mscale_all_dim": 0.5}),
}


def _make_checkpoint(out_dir: str, extra: dict) -> str:
    cfg = transformers.DeepseekV3Config(**{**SIZES, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # weights large enough that every part shows in the logits
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers some choices
                b.copy_(0.1 * torch.randn_like(b))
    hf.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {v: _make_checkpoint(str(root / v), extra) for v, extra in VARIANTS.items()}


@pytest.fixture(scope="module")
def hf_models(checkpoints: dict[str, str]) -> dict[str, torch.nn.Module]:
    return {v: transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
        for v, d in checkpoints.items()}


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


# ---- the model -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_then_decode_matches_transformers(variant, checkpoints,
                                                          hf_models) -> None:
    """Prefill in chunks that are not block aligned, then greedy decodes, all through the
    latent cache (non-contiguous blocks): transformers' logits for every position."""
    model = load_model(checkpoints[variant], dtype="float32", device="cpu")
    b = 4
    kv = allocate_kv_cache(model.config, num_blocks=12, block_size=b, dtype=torch.float32,
                           device="cpu")
    assert kv.shape == (12, 3, 1, 1, b, WIDTH)
    table = [9, 2, 11, 4, 7, 0]
    toks = prompt(13, seed=2)
    outs, start = [], 0
    for n in (6, 3, 4):
        outs.append(run(model, kv, [Seq(table, start, toks[start:start + n])], 0, b))
        start += n
    for _ in range(5):
        nxt = int(outs[-1][-1].argmax())
        toks.append(nxt)
        outs.append(run(model, kv, [Seq(table, len(toks) - 1, [nxt])], 1, b))
    torch.testing.assert_close(torch.cat(outs), hf_logits(hf_models[variant], toks),
                               atol=ATOL, rtol=0)


def test_mixed_batch_matches_transformers(checkpoints, hf_models) -> None:
    """Two decodes and two prefill chunks (one with cached context) in one forward."""
    model = load_model(checkpoints["lora_q"])
    b = 4
    kv = allocate_kv_cache(model.config, 16, b, torch.float32, "cpu")
    a, bb, c, d = prompt(8, 3), prompt(11, 4), prompt(9, 5), prompt(6, 6)
    tables = {"a": [3, 12], "b": [1, 8, 14], "c": [15, 2, 6], "d": [10, 4]}
    run(model, kv, [Seq(tables["a"], 0, a[:7])], 0, b)
    run(model, kv, [Seq(tables["b"], 0, bb[:10])], 0, b)
    run(model, kv, [Seq(tables["c"], 0, c[:5])], 0, b)
    step = [Seq(tables["a"], 7, a[7:]), Seq(tables["b"], 10, bb[10:]),
            Seq(tables["c"], 5, c[5:]), Seq(tables["d"], 0, d)]
    mixed = run(model, kv, step, 2, b)
    hf = hf_models["lora_q"]
    for toks, row in zip((a, bb, c, d), (0, 1, 5, 11), strict=True):
        torch.testing.assert_close(mixed[row], hf_logits(hf, toks)[-1], atol=ATOL, rtol=0)


def test_two_tp_ranks_split_heads_and_replicate_the_latent(checkpoints, hf_models) -> None:
    """TP 2 (threads summing partials through a barrier): each rank holds half the query
    heads (q_b, kv_b rows; o_proj columns) and half of every expert, but the whole latent
    cache, identical on both ranks; each reproduces transformers' logits."""
    path = checkpoints["lora_q"]
    ranks = [load_model(path, tp_rank=r, tp_size=2) for r in range(2)]
    full = dict(load_model(path).named_parameters())
    params = [dict(m.named_parameters()) for m in ranks]
    for name, dim in (("model.layers.1.self_attn.kv_b_proj.weight", 0),
                      ("model.layers.1.self_attn.q_b_proj.weight", 0),
                      ("model.layers.1.self_attn.o_proj.weight", 1),
                      ("model.layers.2.mlp.experts.5.down_proj.weight", 1),
                      ("model.layers.2.mlp.shared_experts.up_proj.weight", 0)):
        torch.testing.assert_close(torch.cat([p[name] for p in params], dim), full[name])
    for p in params:  # replicated: the latent's projection, its norm, the router
        for name in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                     "model.layers.1.self_attn.kv_a_layernorm.weight",
                     "model.layers.2.mlp.gate.e_score_correction_bias"):
            torch.testing.assert_close(p[name], full[name])
    slots: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2)

    def all_reduce_for(rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return reduce

    toks = prompt(9, seed=7)
    results: list[torch.Tensor | None] = [None, None]
    caches = [allocate_kv_cache(m.config, 4, 4, torch.float32, "cpu",
                                num_kv_heads=m.num_local_kv_heads) for m in ranks]

    def work(rank: int) -> None:
        ranks[rank].tp_all_reduce = all_reduce_for(rank)
        results[rank] = run(ranks[rank], caches[rank], [Seq([1, 3, 0], 0, toks)], 0, 4)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    ref = hf_logits(hf_models["lora_q"], toks)
    for r in range(2):
        torch.testing.assert_close(results[r], ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)


# ---- routing -------------------------------------------------------------------------------


def _logit(p: list[float]) -> torch.Tensor:
    t = torch.tensor([p], dtype=torch.float64)
    return torch.log(t / (1 - t)).float()  # sigmoid(logit(p)) = p


MOE = DeepseekMoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                        n_group=2, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5)


def test_grouped_topk_keeps_the_best_group_not_the_best_expert() -> None:
    # scores: group 0 = experts 0-3, group 1 = experts 4-7
    scores = [0.9, 0.1, 0.2, 0.3, 0.6, 0.7, 0.65, 0.05]
    # group 0: 0.9 + 0.3 = 1.2 < group 1: 0.7 + 0.65 = 1.35 -> only experts 4-7 compete:
    # experts 5 and 6 (expert 0, the best single score, is out), weights 0.7 and 0.65 / 1.35.
    w, ids = grouped_topk(_logit(scores), torch.zeros(8), MOE)
    order = ids[0].argsort()
    assert ids[0][order].tolist() == [5, 6]
    torch.testing.assert_close(w[0][order], torch.tensor([0.7, 0.65]) / 1.35 * 2.5)


def test_grouped_topk_bias_selects_but_does_not_weigh() -> None:
    scores = [0.9, 0.1, 0.2, 0.3, 0.6, 0.7, 0.65, 0.05]
    bias = torch.zeros(8)
    bias[3] = 0.5  # group 0 now 0.9 + 0.8 = 1.7: experts 0 and 3 chosen ...
    w, ids = grouped_topk(_logit(scores), bias, MOE)
    order = ids[0].argsort()
    assert ids[0][order].tolist() == [0, 3]
    # ... weighted by their unbiased scores 0.9 and 0.3 (/ 1.2, * 2.5)
    torch.testing.assert_close(w[0][order], torch.tensor([1.875, 0.625]))
    raw = DeepseekMoEConfig(**{**MOE.__dict__, "norm_topk_prob": False,
                               "routed_scaling_factor": 1.0})
    w, ids = grouped_topk(_logit(scores), bias, raw)
    torch.testing.assert_close(w[0][ids[0].argsort()], torch.tensor([0.9, 0.3]))


def test_grouped_topk_matches_transformers_router() -> None:
    cfg = transformers.DeepseekV3Config(**{**SIZES, "n_routed_experts": 16, "n_group": 4,
                                           "topk_group": 2, "num_experts_per_tok": 3})
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.2)
    x = torch.randn(40, SIZES["hidden_size"])
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    moe = DeepseekMoEConfig(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=4,
                            n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=cfg.routed_scaling_factor)
    w, ids = grouped_topk(logits, router.e_score_correction_bias, moe)
    ref_order, order = ref_ids.argsort(dim=1), ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))


# ---- the cache kind --------------------------------------------------------------------------


def test_config_names_the_latent_cache(checkpoints) -> None:
    cfg = ModelConfig.from_dir(checkpoints["lora_q"])
    assert (cfg.architecture, cfg.cache_kind, cfg.kv_parts, cfg.kv_cache_width) == (
        "deepseek_v3", "mla", 1, WIDTH)
    # config.json says num_key_value_heads 4: the cache has one latent head regardless
    assert cfg.num_key_value_heads == 1 and cfg.mla is not None and cfg.mla.q_lora_rank == 32
    assert ModelConfig.from_dir(checkpoints["plain_q"]).mla.q_lora_rank is None
    assert kv_cache_shape(cfg, 5, 16) == (5, 3, 1, 1, 16, WIDTH)
    assert kv_cache_bytes_per_block(cfg, 16, torch.float32) == 3 * 16 * WIDTH * 4
    # tp 2 pp 2: every rank one latent head, its stage's layers
    lays = ParallelLayout.all_ranks(cfg, ParallelConfig(tensor_parallel_size=2,
                                                        pipeline_parallel_size=2))
    assert [(lay.kv_head_range, lay.layer_range) for lay in lays] == [
        ((0, 1), (0, 2)), ((0, 1), (0, 2)), ((0, 1), (2, 3)), ((0, 1), (2, 3))]
    assert {(lay.cache_kind, lay.kv_parts, lay.head_dim) for lay in lays} == {("mla", 1, WIDTH)}


@pytest.mark.parametrize(("change", "match"), [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "original_max_position_embeddings"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config"),
])
def test_unsupported_deepseek_configs_are_named(checkpoints, change, match) -> None:
    with open(f"{checkpoints['lora_q']}/config.json") as f:
        raw = json.load(f)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict({**raw, **change})


def mla_layout(tp: int = 1, pp: int = 1, block: int = 4, layers: int = 4) -> WorkerLayout:
    ranks = tuple(RankLayout(p * tp + t, t, p, (p * layers // pp, (p + 1) * layers // pp),
                             (0, 1)) for p in range(pp) for t in range(tp))
    return WorkerLayout(tp_size=tp, pp_size=pp, num_layers=layers, num_kv_heads=1,
                        head_dim=WIDTH, tokens_per_block=block, dtype="float32", ranks=ranks,
                        cache_kind="mla", kv_parts=1)


def mla_params(src: WorkerLayout, num_tokens: int = 10) -> ContextParams:
    n = -(-num_tokens // src.tokens_per_block)
    return ContextParams(
        ctx_request_id="c", first_gen_tokens=[1], prompt_token_ids=list(range(num_tokens)),
        worker_id="w", backend="TCP", addresses=[f"10.0.0.{r}:7" for r in range(len(src.ranks))],
        block_ids=list(range(20, 20 + n)), num_tokens=num_tokens, layout=src, lease_expiry=0.0)


@pytest.mark.parametrize(("src", "dst"), [((2, 1), (2, 1)), ((1, 1), (2, 1)), ((2, 1), (1, 1)),
                                          ((1, 2), (1, 1)), ((2, 2), (1, 2)), ((2, 1), (1, 2))])
def test_each_generation_rank_reads_the_latent_once(src, dst) -> None:
    """Every context rank of a stage holds the latent: a generation rank reads each of its
    layers from exactly one of them (the one of its own tensor index when there is one), and
    the payload is [blocks, layers, 1, 1, B, W]."""
    s, d = mla_layout(*src), mla_layout(*dst)
    for rank, me in enumerate(d.ranks):
        pieces = plan_pulls(s, d, rank)
        covered = [g for p in pieces for g in range(*p.layers)]
        assert sorted(covered) == list(range(*me.layer_range))  # each layer once
        for p in pieces:
            holder = s.ranks[p.src_rank]
            assert p.heads == (0, 1) and holder.tp_rank == me.tp_rank % s.tp_size
        plan = plan_pull(mla_params(s), d, rank, cache_device="cpu", runs=True, wait_s=5.0)
        for r in plan.reads:
            nl = r.piece.layers[1] - r.piece.layers[0]
            assert r.shape == (3, nl, 1, 1, 4, WIDTH)


def test_latent_payloads_gather_and_convert_block_sizes() -> None:
    """A context rank's READ of an MLA cache, in both formats, carries the latent rows."""
    kv = torch.randn(8, 2, 1, 1, 4, WIDTH)
    ids = (5, 2, 7)
    for fmt, want in (("blocks", (3, 2, 1, 1, 4, WIDTH)), ("tokens", (2, 1, 1, 10, WIDTH))):
        req = ReadRequest(lease_id="c", block_ids=ids, layer_slice=(0, 2), head_slice=(0, 1),
                          num_tokens=10, format=fmt)
        assert payload_shape(tuple(kv.shape), req) == want
        out = torch.empty(want)
        gather_into(kv, req, out)
        if fmt == "blocks":
            torch.testing.assert_close(out, kv[list(ids)])
        else:
            torch.testing.assert_close(out, gather_tokens(kv, list(ids), 10, (0, 2), (0, 1)))


def test_another_cache_kind_is_refused_by_name() -> None:
    mla = mla_layout()
    mha = WorkerLayout(tp_size=1, pp_size=1, num_layers=4, num_kv_heads=1, head_dim=WIDTH,
                       tokens_per_block=4, dtype="float32",
                       ranks=(RankLayout(0, 0, 0, (0, 4), (0, 1)),))
    with pytest.raises(ValueError, match="cache_kind differs .* context \\(mha\\) and "
                                         "generation \\(mla\\)"):
        check_compatible(mha, mla)
    # an older peer's layout has no cache_kind: it is an MHA one
    old = mla.to_dict()
    del old["cache_kind"], old["kv_parts"]
    assert WorkerLayout.from_dict(old).cache_kind == "mha"
    assert WorkerLayout.from_dict(mla.to_dict()) == mla
    with pytest.raises(ValueError, match="cache_kind 'mla' with kv_parts 2"):
        WorkerLayout.from_dict({**mla.to_dict(), "kv_parts": 2})


# ---- the tiny checkpoint and the engine ----------------------------------------------------


def test_tiny_deepseek_cli_checkpoint_runs_like_transformers(tmp_path) -> None:
    """``disagg model tiny --arch deepseek_v3`` writes a checkpoint transformers loads as
    DeepseekV3ForCausalLM; the engine (runner, scheduler, latent cache of 4-token blocks)
    decodes it greedily to the same tokens as transformers' generate."""
    from disagg.cli import main
    from disagg.llm import LLM
    from disagg.request import SamplingParams

    out = tmp_path / "ds"
    assert main(["model", "tiny", str(out), "--arch", "deepseek_v3", "--layers", "3",
                 "--seed", "3"]) == 0
    cfg = ModelConfig.from_dir(str(out))
    assert (cfg.cache_kind, cfg.kv_cache_width, cfg.num_hidden_layers) == ("mla", 48, 3)
    moe = cfg.deepseek_moe
    assert moe is not None and (moe.first_k_dense_replace, moe.n_group,
                                moe.n_routed_experts) == (1, 2, 8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ids = [5, 77, 300, 12, 9, 41, 250]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, 7:]
    assert len(set(ref.tolist())) >= 8  # a random model, not a degenerate one
    llm = LLM(str(out), kv_cache_tokens=256, tokens_per_block=4)
    got = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))
    assert got[0].outputs[0].token_ids == ref.tolist()


@pytest.mark.parametrize(("kwargs", "field"), [({"num_experts": 3}, "num_experts"),
                                               ({"num_experts_per_tok": 5},
                                                "num_experts_per_tok")])
def test_tiny_deepseek_bad_arguments(tmp_path, kwargs: dict, field: str) -> None:
    from disagg.model.tiny import write_tiny_checkpoint

    with pytest.raises(ValueError, match=field):
        write_tiny_checkpoint(str(tmp_path / "x"), "deepseek_v3", **kwargs)


def test_bfloat16_keeps_the_routing_bias_in_float32(checkpoints) -> None:
    model = load_model(checkpoints["lora_q"], dtype=torch.bfloat16)
    p = dict(model.named_parameters())
    assert p["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert p["model.layers.2.mlp.gate.weight"].dtype == torch.bfloat16
    kv = allocate_kv_cache(model.config, 4, 4, torch.bfloat16, "cpu")
    logits = run(model, kv, [Seq([2, 0, 1], 0, prompt(9, seed=8))], 0, 4)
    assert logits.shape == (9, VOCAB) and bool(logits.isfinite().all())
