"""Benchmark workloads: random prompts of exact token length, ShareGPT, Mooncake traces.

Every dataset yields ``SampleRequest``s. A prompt is either text (sent as ``prompt`` /
a user message) or a list of token ids (``--prompt-as-token-ids``, completions only).

Exact lengths for text prompts
------------------------------
Decoding random token ids and encoding the text again rarely gives the same number of tokens
(byte-level fragments become replacement characters, neighbours merge). ``exact_text`` makes
the length exact by iterating on the *canonical* tokens of the current text:

1. draw random non-special ids, decode them to text (dropping U+FFFD: pieces of split UTF-8
   characters);
2. encode ``prefix + text`` (with special tokens, as the server will) and compare with the target;
3. too long: drop the surplus from the end of the text's canonical tokens; too short: append
   fresh random ids; decode and go to 2;
4. a draw that does not converge in a few rounds is replaced by a new draw.

It nearly always converges in one to three rounds. If it never does (a pathological tokenizer),
the closest text is kept, its true length recorded and a warning counted, so the reported token
totals stay truthful. Token-id prompts are exact by construction.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class DatasetError(ValueError):
    """The dataset file or its options are unusable; the message says why."""


class TokenizerLike(Protocol):
    """What the benchmark needs from a tokenizer (``disagg.tokenizer`` or HF tokenizers)."""

    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class SampleRequest:
    """One benchmark request before it is sent."""

    prompt: str | list[int]  # text, or token ids (completions endpoint only)
    prompt_len: int  # tokens as the server counts them (special tokens included)
    expected_output_len: int  # sent as max_tokens
    timestamp: float | None = None  # seconds from the trace start (trace replay only)
    exact: bool = True  # False when exact_text could not hit the target length


# --------------------------------------------------------------------------------- tokenizer


class _HFTokenizer:
    """Adapter over a bare ``tokenizer.json``, used only while ``disagg.tokenizer`` is absent."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = sorted(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_bench_tokenizer(path: str) -> TokenizerLike:
    """Load the tokenizer of a local model folder (or a tokenizer.json file)."""
    if os.path.isdir(path):
        try:
            from disagg.tokenizer import load_tokenizer
        except ImportError:  # the package tokenizer is not there yet: bare tokenizer.json
            load_tokenizer = None
        if load_tokenizer is not None:
            return load_tokenizer(path)
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise DatasetError(f"no tokenizer at {path!r}")
    return _HFTokenizer(path)


def _normal_ids(tok: TokenizerLike) -> list[int]:
    special = set(tok.all_special_ids)
    return [i for i in range(tok.vocab_size) if i not in special]


# ------------------------------------------------------------------------------ exact text


def exact_text(tok: TokenizerLike, target_len: int, rng: random.Random, ids: Sequence[int],
               prefix: str = "", start: Sequence[int] | None = None,
               add_special_tokens: bool = True, max_rounds: int = 8,
               max_draws: int = 8) -> tuple[str, int]:
    """Text ``t`` such that ``len(encode(prefix + t)) == target_len`` (see module docstring).

    ``ids`` are the ids random text is drawn from; ``start`` optionally seeds the first draw
    (Mooncake blocks). Returns ``(t, actual_len)``; ``actual_len != target_len`` only when no
    draw converged.
    """
    base = len(tok.encode(prefix, add_special_tokens=add_special_tokens))
    if target_len <= base:  # nothing to add (or the prefix alone is already too long)
        return "", base
    best: tuple[int, str, int] | None = None  # (distance, text, length)
    for draw in range(max_draws):
        if draw == 0 and start is not None:
            cur = list(start)[: target_len - base]
            cur += rng.choices(ids, k=target_len - base - len(cur))
        else:
            cur = rng.choices(ids, k=target_len - base)
        for _ in range(max_rounds):
            # Random byte-level ids can split a UTF-8 character; the decoder turns the pieces
            # into U+FFFD, which encodes to several tokens and never converges: drop them.
            text = tok.decode(cur).replace("\ufffd", "")
            n = len(tok.encode(prefix + text, add_special_tokens=add_special_tokens))
            if n == target_len:
                return text, n
            if best is None or abs(n - target_len) < best[0]:
                best = (abs(n - target_len), text, n)
            # Continue from the text's canonical tokens: their decode/encode round trip is stable.
            cur = tok.encode(text, add_special_tokens=False)
            if n > target_len:
                cur = cur[: max(0, len(cur) - (n - target_len))]
            else:
                cur += rng.choices(ids, k=target_len - n)
    assert best is not None
    return best[1], best[2]


# ---------------------------------------------------------------------------------- random


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    # Uniform integers in [mean*(1-ratio), mean*(1+ratio)], at least 1.
    lo = max(1, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def sample_random(tok: TokenizerLike, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
                  as_token_ids: bool = False) -> list[SampleRequest]:
    """Random prompts of ``prefix_len + input_len_i`` tokens (special tokens included).

    All prompts share one random prefix of ``prefix_len`` tokens (prefix caching studies);
    ``input_len_i`` and the output lengths are uniform within ``range_ratio`` of the means.
    """
    if input_len < 1 or output_len < 1 or prefix_len < 0 or not 0 <= range_ratio < 1:
        raise DatasetError("random dataset: need input_len >= 1, output_len >= 1, "
                           "prefix_len >= 0, 0 <= range_ratio < 1")
    rng = random.Random(seed)
    ids = _normal_ids(tok)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    samples: list[SampleRequest] = []
    if as_token_ids:
        prefix_ids = rng.choices(ids, k=prefix_len)
        for n_in, n_out in zip(in_lens, out_lens, strict=True):
            prompt = prefix_ids + rng.choices(ids, k=n_in)
            samples.append(SampleRequest(prompt, len(prompt), n_out))
        return samples
    # The shared prefix counts its tokens without specials; the specials (e.g. BOS) are
    # charged to each prompt's own length, so the total is prefix_len + n_in as the server sees.
    prefix = ""
    if prefix_len:
        prefix, _ = exact_text(tok, prefix_len, rng, ids, add_special_tokens=False)
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        target = prefix_len + n_in
        text, n = exact_text(tok, target, rng, ids, prefix=prefix)
        samples.append(SampleRequest(prefix + text, n, n_out, exact=n == target))
    return samples


# -------------------------------------------------------------------------------- sharegpt


def _first_turns(conv: list[dict[str, Any]]) -> tuple[str, str] | None:
    # The first human turn and the first assistant turn after it.
    human = None
    for turn in conv:
        who, text = turn.get("from"), turn.get("value")
        if not isinstance(text, str):
            continue
        if human is None and who in ("human", "user"):
            human = text
        elif human is not None and who in ("gpt", "assistant", "chatgpt", "bard"):
            return human, text
    return None


def sample_sharegpt(path: str, tok: TokenizerLike, num_prompts: int, seed: int = 0,
                    output_len: int | None = None,
                    as_token_ids: bool = False) -> list[SampleRequest]:
    """Prompts from a ShareGPT JSON file: first human turn; output length from the first gpt turn.

    Conversations are shuffled with ``seed``; ones without both turns, or whose prompt or reply
    is empty, are skipped. ``output_len`` overrides the reply's length.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"cannot read ShareGPT file {path!r}: {e}") from e
    if not isinstance(data, list):
        raise DatasetError(f"ShareGPT file {path!r}: expected a JSON list of conversations")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    samples: list[SampleRequest] = []
    for i in order:
        if len(samples) >= num_prompts:
            break
        entry = data[i]
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        turns = _first_turns(conv) if isinstance(conv, list) else None
        if turns is None:
            continue
        if not turns[0].strip():
            continue
        prompt_ids = tok.encode(turns[0])
        n_out = output_len or len(tok.encode(turns[1], add_special_tokens=False))
        if n_out < 1:
            continue
        prompt: str | list[int] = prompt_ids if as_token_ids else turns[0]
        samples.append(SampleRequest(prompt, len(prompt_ids), n_out))
    if not samples:
        raise DatasetError(f"ShareGPT file {path!r}: no usable conversation "
                           "(need a human turn followed by a gpt turn)")
    return samples


# -------------------------------------------------------------------------------- mooncake


def _block_ids(ids: Sequence[int], seed: int, hash_id: int, n: int) -> list[int]:
    # Content of a hash block depends only on (seed, hash_id): equal ids give equal text.
    return random.Random(f"{seed}:{hash_id}").choices(ids, k=n)


def sample_mooncake(path: str, tok: TokenizerLike, num_prompts: int, seed: int = 0,
                    block_size: int = 512, as_token_ids: bool = False,
                    speedup: float = 1.0) -> list[SampleRequest]:
    """Requests from a Mooncake trace: JSONL of ``{timestamp, input_length, output_length,
    hash_ids}``.

    ``timestamp`` is in milliseconds; ``SampleRequest.timestamp`` is seconds since the first
    request divided by ``speedup``. Each hash id stands for one ``block_size``-token block of
    prompt content, the same content wherever the id appears, so requests sharing leading hash
    ids share a prompt prefix. As text: each full block is a text of exactly ``block_size``
    tokens built from its id (cached per id); a tail, seeded by the next hash id, is tuned with
    ``exact_text`` so the whole prompt has exactly ``input_length`` tokens (merges across block
    boundaries are absorbed by the tail). As token ids: the blocks' ids, cut to the length.
    """
    if block_size < 1 or speedup <= 0:
        raise DatasetError("mooncake trace: need block_size >= 1 and speedup > 0")
    ids = _normal_ids(tok)
    rng = random.Random(seed)
    block_text: dict[int, str] = {}
    samples: list[SampleRequest] = []
    t0: float | None = None
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"cannot read Mooncake trace {path!r}: {e}") from e
    with f:
        for lineno, line in enumerate(f, 1):
            if len(samples) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"])
                n_in, n_out = int(rec["input_length"]), int(rec["output_length"])
                hashes = [int(h) for h in rec.get("hash_ids") or []]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise DatasetError(f"{path}:{lineno}: bad trace record: {e!r}") from e
            if n_in < 1 or n_out < 1:
                raise DatasetError(f"{path}:{lineno}: input_length and output_length must be >= 1")
            t0 = ts if t0 is None else t0
            when = (ts - t0) / 1000.0 / speedup
            if as_token_ids:
                prompt_ids: list[int] = []
                for h in hashes:
                    prompt_ids += _block_ids(ids, seed, h, block_size)
                # Trace lengths beyond the hash blocks get unique filler.
                prompt_ids = prompt_ids[:n_in] + rng.choices(ids, k=max(0, n_in - len(prompt_ids)))
                samples.append(SampleRequest(prompt_ids, n_in, n_out, timestamp=when))
                continue
            # Full blocks form the shared prefix; keep at least one token for the tunable tail.
            n_full = min(len(hashes), max(0, (n_in - 2) // block_size))
            for h in hashes[:n_full]:
                if h not in block_text:  # a text of exactly block_size tokens on its own
                    block_text[h], _ = exact_text(
                        tok, block_size, random.Random(f"{seed}:{h}:text"), ids,
                        start=_block_ids(ids, seed, h, block_size), add_special_tokens=False)
            prefix = "".join(block_text[h] for h in hashes[:n_full])
            start = (_block_ids(ids, seed, hashes[n_full], block_size)
                     if n_full < len(hashes) else None)
            text, n = exact_text(tok, n_in, rng, ids, prefix=prefix, start=start)
            samples.append(SampleRequest(prefix + text, n, n_out, timestamp=when,
                                         exact=n == n_in))
    if not samples:
        raise DatasetError(f"Mooncake trace {path!r} has no records")
    return samples
