"""The feed-forward's residual add moved into the next norm (issue 44 item 2): a decoder layer
returns ``(ffn, h)`` and the next layer's ``input_layernorm.add_norm`` (or the final norm) adds
them in its launch; a non-last pipeline stage adds them at its end. On CPU, every family, the
bits of the forward that added at each layer's end (``unfused_forward``, the code the layers ran
before): the engine's greedy tokens and logprob values, eager and padded (the graph buckets'
path), and pipeline stages chained in process (the hidden state a stage hands on, the cache,
the logits, the KV streaming hook's order).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import disagg.engine.llm_engine as engine_mod
from disagg import LLM, SamplingParams
from disagg.config import ModelConfig
from disagg.model.attention import AttentionMetadata
from disagg.model.deepseek import DeepseekDecoderLayer
from disagg.model.llama import LlamaForCausalLM
from disagg.model.loader import allocate_kv_cache, load_model
from disagg.model.static_decode import paged_decode_reference
from disagg.runner import ModelRunner

# name -> write_tiny_checkpoint arguments; three layers so a two-stage split has a stage of two
ARCHS: dict[str, dict[str, object]] = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True),  # q/k/v bias
    "qwen3": dict(arch="qwen3"),  # q/k norms
    "mixtral": dict(arch="mixtral"),  # every layer's feed-forward routed
    "qwen3_moe": dict(arch="qwen3_moe", mlp_only_layers=(1,)),  # routed and dense layers
    "deepseek_v3": dict(arch="deepseek_v3"),  # MLA; layer 0 dense, then routed + shared
}


@pytest.fixture(scope="module")
def dirs(tiny_checkpoint: Callable[..., str]) -> dict[str, str]:
    return {name: tiny_checkpoint(name, seed=5, num_hidden_layers=3, **kw)
            for name, kw in ARCHS.items()}


def _layer_then_add(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_layer: torch.Tensor, meta: object,
                    workspace: object) -> torch.Tensor:
    """A decoder layer as it was before the add moved: the stream in, the stream out."""
    a = layer.self_attn(layer.input_layernorm(x), cos, sin, kv_layer, meta, workspace)
    h, x = layer.post_attention_layernorm.add_norm(a, x)
    ffn = layer.mlp if isinstance(layer, DeepseekDecoderLayer) else layer.feed_forward
    return x + ffn(h)


def unfused_forward(model: LlamaForCausalLM, input_ids: torch.Tensor | None,
                    positions: torch.Tensor, kv_cache: torch.Tensor, meta: object,
                    hidden_states: torch.Tensor | None = None) -> torch.Tensor:
    """``LlamaForCausalLM.forward`` as it was: each layer adds its feed-forward output."""
    x = model.model.embed_tokens(input_ids) if hidden_states is None else hidden_states
    cos, sin = model.rotary(positions, x.dtype)
    for i, layer in enumerate(model.model.layers.values()):
        x = _layer_then_add(layer, x, cos, sin, kv_cache[:, i], meta, model.workspace)
    return x if model.model.norm is None else model.model.norm(x)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(as_int),
                                                                      b.view(as_int))


# ---- the engine -----------------------------------------------------------------------------


def _generate(monkeypatch: pytest.MonkeyPatch, model_dir: str, dtype: str, unfused: bool,
              padded: bool) -> list[tuple[list[int], object]]:
    """Greedy tokens and top-2 logprobs of 4 prompts (prefills, mixed and pure decode steps);
    ``padded``: decode steps through the graph buckets' static path, run eagerly on CPU."""
    made: list[ModelRunner] = []

    def make(config, disagg=None):  # type: ignore[no-untyped-def]
        runner = ModelRunner(config, padded_decode=paged_decode_reference if padded else None)
        made.append(runner)
        return runner

    with monkeypatch.context() as mp:
        mp.setattr(engine_mod, "make_executor", make)
        llm = LLM(model_dir, dtype=dtype, max_num_tokens=64, tokens_per_block=8,
                  kv_cache_tokens=2048, max_model_len=128, cuda_graph_max_batch_size=4,
                  enable_prefix_caching=False)
    with llm:
        runner = made[0]
        assert (runner.graphs is not None) == padded
        calls: list[int] = []
        model = runner.model
        real = unfused_forward if unfused else type(model).forward

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return real(model, *args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)
        prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(n)]
                   for i, n in enumerate((3, 9, 17, 8))]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
                  for n in (3, 6, 5, 7)]
        outs = llm.generate(prompts, params)
        assert calls  # the forward under test ran
        assert not padded or runner.graphs.eager_runs > 0  # type: ignore[union-attr]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_engine_gives_the_bits_of_the_add_at_each_layer_end(dirs, arch: str, dtype: str,
                                                            monkeypatch) -> None:
    want = _generate(monkeypatch, dirs[arch], dtype, unfused=True, padded=False)
    got = _generate(monkeypatch, dirs[arch], dtype, unfused=False, padded=False)
    assert got == want  # token ids and logprob floats, compared exactly


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_padded_decode_gives_the_bits_of_the_add_at_each_layer_end(dirs, arch: str,
                                                                   monkeypatch) -> None:
    """The graph buckets' path (``StaticDecodeMeta``; captured on CUDA, eager here)."""
    want = _generate(monkeypatch, dirs[arch], "bfloat16", unfused=True, padded=True)
    got = _generate(monkeypatch, dirs[arch], "bfloat16", unfused=False, padded=True)
    assert got == want


# ---- pipeline stages in process ---------------------------------------------------------------


def _steps(block_size: int) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """A prefill of two sequences (7 and 12 tokens), then a decode step of both."""
    g = torch.Generator().manual_seed(3)
    lens, tables = (7, 12), ([1, 2], [3, 4])
    steps = []
    for start, n in (((0, 0), lens), (lens, (1, 1))):
        ids, pos, sb, so, qsl = [], [], [], [], [0]
        for s in range(2):
            for p in range(start[s], start[s] + n[s]):
                ids.append(int(torch.randint(3, 400, (1,), generator=g)))
                pos.append(p)
                sb.append(tables[s][p // block_size])
                so.append(p % block_size)
            qsl.append(qsl[-1] + n[s])
        seq_lens = [start[s] + n[s] for s in range(2)]
        decodes = 2 if n == (1, 1) else 0
        meta = AttentionMetadata(
            num_decodes=decodes, query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=torch.tensor(tables), slot_block=torch.tensor(sb),
            slot_offset=torch.tensor(so), decode_seq_lens=torch.tensor(seq_lens[:decodes]))
        steps.append((torch.tensor(ids), torch.tensor(pos), meta))
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_pipeline_stages_hand_on_the_bits_of_the_add_at_each_layer_end(
        dirs, arch: str, dtype: torch.dtype) -> None:
    """Stages [0, 2) and [2, 3) chained in process as pp=2 ranks chain them: the hidden state
    stage 0 hands on (its ends' add materialised), the caches and the logits equal the whole
    model's forward that added at each layer's end, to the bit; the KV streaming hook still
    reports each local layer once, in order."""
    path = dirs[arch]
    cfg = ModelConfig.from_dir(path)
    whole = load_model(path, cfg, dtype=dtype)
    stages = [load_model(path, cfg, dtype=dtype, layer_range=r) for r in ((0, 2), (2, 3))]
    kv_whole = allocate_kv_cache(cfg, 6, 8, dtype, "cpu")
    kv_stages = [allocate_kv_cache(cfg, 6, 8, dtype, "cpu", num_layers=n) for n in (2, 1)]
    hooked: list[list[int]] = [[], []]
    for stage, seen in zip(stages, hooked, strict=True):
        stage.layer_hook = seen.append  # type: ignore[assignment]
    with torch.inference_mode():
        for ids, pos, meta in _steps(8):
            want_h = unfused_forward(stages[0], ids, pos, kv_stages[0].clone(), meta)
            want = whole.compute_logits(unfused_forward(whole, ids, pos, kv_whole, meta))
            h = stages[0](ids, pos, kv_stages[0], meta)
            assert _bits(h, want_h)
            got = stages[1].compute_logits(stages[1](None, pos, kv_stages[1], meta,
                                                     hidden_states=h))
            assert _bits(got, want)
            for i in range(3):  # the cache each layer wrote
                stage_kv = kv_stages[0][:, i] if i < 2 else kv_stages[1][:, 0]
                assert _bits(stage_kv, kv_whole[:, i])
    assert hooked == [[0, 1, 0, 1], [0, 0]]


def test_a_stage_of_one_layer_returns_the_stream(dirs) -> None:
    """A non-last stage of a single layer: what it hands on is the stream after that layer
    (embedding + attention + feed-forward), not the layer's feed-forward output alone."""
    path = dirs["llama"]
    cfg = ModelConfig.from_dir(path)
    stage = load_model(path, cfg, layer_range=(0, 1))
    ids, pos, meta = _steps(8)[0]
    kv = allocate_kv_cache(cfg, 6, 8, torch.float32, "cpu", num_layers=1)
    with torch.inference_mode():
        want = unfused_forward(stage, ids, pos, kv.clone(), meta)
        got = stage(ids, pos, kv, meta)
        layer = stage.model.layers["0"]
        ffn, h = layer(stage.model.embed_tokens(ids), *stage.rotary(pos, torch.float32),
                       kv.clone()[:, 0], meta, stage.workspace)
    assert _bits(got, want) and _bits(got, h + ffn) and not torch.equal(got, ffn)


def test_the_add_runs_in_the_next_norm(dirs) -> None:
    """The forward hands layer 1's input norm the residual and the previous feed-forward's
    output apart (the sum is the norm's to make: one launch on CUDA); the reference above hands
    it the sum."""
    model = load_model(dirs["qwen2"], dtype=torch.float32)
    seen: list[torch.Tensor | None] = []
    norm = model.model.layers["1"].input_layernorm
    real = norm.add_norm
    norm.add_norm = lambda x, r: (seen.append(r), real(x, r))[1]  # type: ignore[method-assign]
    ids, pos, meta = _steps(8)[0]
    kv = allocate_kv_cache(model.config, 6, 8, torch.float32, "cpu")
    with torch.inference_mode():
        unfused_forward(model, ids, pos, kv.clone(), meta)
        assert seen == [None]
        model(ids, pos, kv, meta)
    assert len(seen) == 2 and isinstance(seen[1], torch.Tensor)
