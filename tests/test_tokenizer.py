"""Tokenizer wrapper (parity with transformers' AutoTokenizer) and IncrementalDetokenizer."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg.model.tiny import SPECIAL_TOKENS, _byte_level_alphabet
from disagg.request import SamplingParams
from disagg.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, load_tokenizer

HYPO = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading and trailing spaces  ",
    "The harbour was quiet in the early morning.\nNew line\ttab",
    "héllo wörld 😀👍🏽 你好，世界 مرحبا Привет",
    "a<|eot_id|>b <|start_header_id|>user<|end_header_id|>",
    "numbers 1234567890 3.14159 and symbols #$%^&*(){}[]",
    "\x00\x01 control \u200b zero-width",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure? 😀"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "sunny"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <b>",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint()  # the defaults (seed 0)


@pytest.fixture(scope="module")
def tok(ckpt: str) -> Tokenizer:
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def hf(ckpt: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(ckpt)


def _copy(ckpt: str, dst: str, **config_changes) -> str:
    shutil.copytree(ckpt, dst)
    path = os.path.join(dst, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in config_changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte (splits multi-byte characters across tokens)."""
    char_of = {b: c for c, b in _byte_level_alphabet().items()}
    return [tok.token_to_id(char_of[b]) for b in data]


# -- Tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf(
        text, add_special_tokens=False)["input_ids"]
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip)
    assert tok.decode(ids) == text.replace("<|eot_id|>", "").replace(
        "<|start_header_id|>", "").replace("<|end_header_id|>", "")


def test_decode_random_ids_matches_transformers(tok: Tokenizer, hf) -> None:
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 20))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)


@HYPO
@given(st.text(max_size=40))
def test_roundtrip_any_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_bos_not_doubled(tok: Tokenizer, hf) -> None:
    bos = tok.bos_token_id
    assert tok.encode("<|begin_of_text|>hi") == [bos, *tok.encode("hi", False)]
    assert hf("<|begin_of_text|>hi")["input_ids"][:2] == [bos, bos]  # transformers doubles it
    assert tok.encode("<|begin_of_text|>hi", add_special_tokens=False)[0] == bos
    assert tok.add_bos_token


def test_properties(tok: Tokenizer, hf) -> None:
    eot, eos = tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")
    assert tok.eos_token_id == eot == hf.eos_token_id
    assert tok.eos_token_ids == (eot, eos)  # tokenizer_config first, then generation_config
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.vocab_size == len(tok) == len(hf) == 512
    assert set(hf.all_special_ids) <= set(tok.all_special_ids)
    assert sorted(tok.all_special_ids) == sorted(tok.token_to_id(t) for t in SPECIAL_TOKENS)
    assert tok.is_special(eot) and not tok.is_special(tok.encode("a", False)[0])
    assert tok.model_max_length == 2048


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf, conv: int, gen: bool) -> None:
    messages = CONVERSATIONS[conv]
    ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.startswith(tok.bos_token)
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == gen
    with_tools = tok.apply_chat_template(messages, add_generation_prompt=gen, tools=TOOLS)
    assert with_tools == hf.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                add_generation_prompt=gen)
    assert '"description": "Wetter <b>"' in with_tools  # tojson: no HTML escaping
    # Encoding the rendered chat with special tokens gives one BOS.
    ids = tok.encode(ours)
    assert ids == hf(ours, add_special_tokens=False)["input_ids"]


def test_chat_template_errors_and_sources(tok: Tokenizer, ckpt: str, tmp_path) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")
    # Template variables: bos/eos tokens, extra kwargs, {% generation %} blocks.
    custom = ("{{ bos_token }}|{{ eos_token }}|{{ greeting }}|"
              "{% generation %}{{ messages[0].content }}{% endgeneration %}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=custom,
                                   greeting="hi") == "<|begin_of_text|>|<|eot_id|>|hi|x"
    # chat_template.jinja wins over tokenizer_config.json; no template at all is an error.
    other = _copy(ckpt, str(tmp_path / "jinja"))
    with open(os.path.join(other, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert load_tokenizer(other).apply_chat_template(
        [{"role": "user", "content": "hey"}]) == "[user]hey"
    bare = _copy(ckpt, str(tmp_path / "bare"), chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(bare).apply_chat_template([{"role": "user", "content": "x"}])


def test_config_variants(ckpt: str, tmp_path, hf) -> None:
    # bos/eos given as AddedToken dicts.
    added = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False,
             "normalized": False, "rstrip": False, "single_word": False, "special": True}
    d = _copy(ckpt, str(tmp_path / "dicts"), bos_token=added,
              eos_token=dict(added, content="<|end_of_text|>"))
    t = load_tokenizer(d)
    assert t.bos_token == "<|begin_of_text|>" and t.eos_token == "<|end_of_text|>"
    assert t.eos_token_ids[0] == t.token_to_id("<|end_of_text|>")
    assert t.encode("hi")[0] == t.bos_token_id
    # add_bos_token false overrides the post-processor (as transformers v5 does).
    d = _copy(ckpt, str(tmp_path / "nobos"), add_bos_token=False)
    t = load_tokenizer(d)
    assert t.encode("hi") == t.encode("hi", add_special_tokens=False)
    assert not t.add_bos_token
    # No add_bos_token key: the post-processor in tokenizer.json decides.
    d = _copy(ckpt, str(tmp_path / "post"), add_bos_token=None, add_eos_token=None)
    assert load_tokenizer(d).encode("hi") == hf("hi")["input_ids"]
    # add_eos_token true appends EOS.
    d = _copy(ckpt, str(tmp_path / "eos"), add_eos_token=True)
    t = load_tokenizer(d)
    assert t.encode("hi") == [t.bos_token_id, *t.encode("hi", False), t.eos_token_id]
    # No tokenizer_config.json at all: works, no BOS known.
    d = _copy(ckpt, str(tmp_path / "noconfig"))
    os.remove(os.path.join(d, "tokenizer_config.json"))
    t = load_tokenizer(d)
    assert t.bos_token_id is None and t.decode(t.encode("héllo")) == "héllo"


def test_missing_files(tmp_path, ckpt: str) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(empty))
    (empty / "tokenizer.model").write_bytes(b"sp")
    with pytest.raises(FileNotFoundError, match="sentencepiece"):
        load_tokenizer(str(empty))
    d = _copy(ckpt, str(tmp_path / "badjson"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(d)


# -- IncrementalDetokenizer --------------------------------------------------------------------


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int],
            params: SamplingParams) -> tuple[list[str], str, IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    for i in ids:
        deltas.append(det.update(i))
        assert det.text.startswith("".join(deltas))  # emitted text is final text's prefix
        if det.stopped:
            break
    tail = det.flush()
    assert "".join(deltas) + tail == det.text
    return deltas, tail, det


def test_streams_text_without_broken_characters(tok: Tokenizer) -> None:
    text = "naïve café 😀 你好 Ünïcödé 👍🏽!"
    for ids in (tok.encode(text, False), _byte_ids(tok, text.encode())):
        deltas, tail, det = _stream(tok, tok.encode("Q:"), ids, SamplingParams())
        assert "".join(deltas) == text and tail == ""
        assert not any("\ufffd" in d for d in deltas)
        assert not det.stopped and det.stop_reason is None


def test_complete_text_before_a_split_character_streams_at_once() -> None:
    # A token holding a whole character and the first byte of the next one ("a" + 0xC3, as
    # real byte-level vocabularies have): "a" streams at once, "é" when its last byte comes.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    char_of = {b: c for c, b in _byte_level_alphabet().items()}
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merged = "a" + char_of[0xC3]
    vocab[merged] = len(vocab)
    backend = Backend(models.BPE(vocab, [("a", char_of[0xC3])]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = Tokenizer(backend, {})
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    assert det.update(vocab[merged]) == "a"
    assert det.update(vocab[char_of[0xA9]]) == "é"
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    assert [det.update(vocab[merged]), det.update(vocab[merged])] == ["a", "\ufffda"]
    assert det.flush() == "\ufffd" and det.text == tok.decode([vocab[merged]] * 2)


def test_random_token_streams_join_to_the_whole_decode(tok: Tokenizer) -> None:
    """Without stop strings the pieces of a stream join to the output's text whatever the ids:
    ``decode(ids)`` for a byte-level vocabulary (split characters included), the text after
    the prompt's in ``decode(prompt + ids)`` for a sentencepiece-style decoder, whose text of
    a token alone differs from its text in context (the detokenizer's memoized one-token
    decodes must not change that)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    words = ["\u2581hello", "\u2581world", "\u2581", "a", "b", "\u2581caf\u00e9", "!", "<unk>"]
    sp_backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    sp_backend.pre_tokenizer = pre_tokenizers.Metaspace()
    sp_backend.decoder = decoders.Metaspace()
    sp = Tokenizer(sp_backend, {})
    assert sp.decode_one(0) == "hello" and sp.decode_ints([3, 0]) == "a hello"
    rng = random.Random(5)
    for t, vocab in ((tok, tok.vocab_size), (sp, len(words) - 1)):
        assert all(t.decode_one(i) == t.decode_ints([i]) for i in range(vocab))
        for _ in range(100):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
            deltas, tail, det = _stream(t, prompt, ids, SamplingParams())
            want = (t.decode(ids) if t is tok
                    else t.decode(prompt + ids)[len(t.decode(prompt)):])
            assert "".join(deltas) + tail == want == det.text


def test_incomplete_character_at_end_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok ", False) + _byte_ids(tok, "😀".encode()[:2])
    deltas, tail, det = _stream(tok, [], ids, SamplingParams())
    assert "".join(deltas) == "ok " and tail == "\ufffd"
    assert det.text == tok.decode(ids) == "ok \ufffd"


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    ids = _byte_ids(tok, b"hello wor") + tok.encode("ld and more", False)
    deltas, tail, det = _stream(tok, [], ids, SamplingParams(stop=["o wo", "zzz"]))
    assert det.stopped and det.stop_reason == "o wo"
    assert det.text == "".join(deltas) == "hell" and tail == ""
    assert det.update(tok.encode("x", False)[0]) == ""  # stopped: nothing more
    _, _, det = _stream(tok, [], ids, SamplingParams(stop=["o wo"],
                                                     include_stop_str_in_output=True))
    assert det.text == "hello wo" and det.stopped


def test_stop_string_held_back_then_released(tok: Tokenizer) -> None:
    ids = _byte_ids(tok, b"abcSTOxyz")
    deltas, tail, det = _stream(tok, [], ids, SamplingParams(stop=["STOP"]))
    assert not det.stopped and det.text == "abcSTOxyz"
    assert "".join(deltas) == "abcSTO" and tail == "xyz"  # last len("STOP") - 1 chars held
    # Held-back text never runs more than max(len(stop)) - 1 characters behind.
    assert all(len(deltas[i]) == 1 for i in range(3, len(deltas)))


def test_stop_string_respects_min_tokens(tok: Tokenizer) -> None:
    ids = _byte_ids(tok, b"aXbXc")
    _, _, det = _stream(tok, [], ids, SamplingParams(stop=["X"], min_tokens=2, max_tokens=9))
    assert det.text == "aXb" and det.stop_reason == "X"


def test_skip_special_tokens(tok: Tokenizer) -> None:
    eot = tok.token_to_id("<|eot_id|>")
    ids = [*tok.encode("Hi", False), eot, *tok.encode(" there", False)]
    _, _, det = _stream(tok, [], ids, SamplingParams())
    assert det.text == "Hi there"
    _, _, det = _stream(tok, [], ids, SamplingParams(skip_special_tokens=False))
    assert det.text == "Hi<|eot_id|> there"
    _, _, det = _stream(tok, [], ids, SamplingParams(skip_special_tokens=False,
                                                     stop=["|> t"]))
    assert det.text == "Hi<|eot_id" and det.stop_reason == "|> t"


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    emoji = _byte_ids(tok, "😀".encode())
    deltas, tail, det = _stream(tok, tok.encode("x") + emoji[:2], emoji[2:] + emoji,
                                SamplingParams())
    assert det.text == "".join(deltas) + tail
    assert det.text.endswith("😀")


@HYPO
@given(ids=st.lists(st.integers(0, 511), max_size=30),
       prompt=st.lists(st.integers(0, 511), max_size=8), skip=st.booleans())
def test_random_ids_concatenate_to_decode(tok: Tokenizer, ids: list[int], prompt: list[int],
                                          skip: bool) -> None:
    deltas, tail, det = _stream(tok, prompt, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) + tail == det.text == tok.decode(ids, skip_special_tokens=skip)


_ALPHABET = st.sampled_from(list("abcXY ,.\n") + ["é", "ü", "😀", "你", "好", "👍", "🏽", "\u200b"])


def _tokens_for(tok: Tokenizer, text: str, split: list[bool]) -> list[int]:
    """Encode ``text`` in chunks: normally, or byte by byte (splitting characters)."""
    ids: list[int] = []
    words = text.split(" ")
    for n, word in enumerate(words):
        piece = word + (" " if n < len(words) - 1 else "")
        ids += (_byte_ids(tok, piece.encode()) if split[n % len(split)]
                else tok.encode(piece, False))
    return ids


@HYPO
@given(text=st.text(_ALPHABET, max_size=40), split=st.lists(st.booleans(), min_size=1),
       stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=4), max_size=3),
       include=st.booleans())
def test_stop_strings_property(tok: Tokenizer, text: str, split: list[bool], stops: list[str],
                               include: bool) -> None:
    ids = _tokens_for(tok, text, split)
    assert tok.decode(ids) == text
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, tail, det = _stream(tok, tok.encode("prompt"), ids, params)
    out = det.text
    assert "".join(deltas) + tail == out and text.startswith(out)
    assert not any("\ufffd" in d for d in deltas)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        assert out == text and not det.stopped and det.stop_reason is None
        return
    assert det.stopped and det.stop_reason in stops
    s = det.stop_reason
    if include:
        assert out.endswith(s)
        assert not any(x in out[:-1] for x in stops)  # no earlier stop string ended
    else:
        assert text[len(out):].startswith(s)
        assert not any(x in out for x in stops)
    if len(stops) == 1:  # one stop string: its first occurrence, whatever the tokens
        first = text.find(s)
        assert out == text[:first + (len(s) if include else 0)]
