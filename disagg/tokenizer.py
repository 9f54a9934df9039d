"""Tokenizer and streaming detokenizer (DESIGN.md section 6).

``Tokenizer`` wraps a Hugging Face fast tokenizer (``tokenizer.json``, read by the
``tokenizers`` library) plus ``tokenizer_config.json``: BOS/EOS handling, decoding and chat
templates (rendered by a sandboxed jinja2 environment set up like transformers'), without
importing transformers.

``IncrementalDetokenizer`` turns generated token ids into text deltas for streaming: it never
emits half a UTF-8 character, holds back text that could be the start of a stop string, and
cuts the output at the first stop string.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from disagg.request import SamplingParams

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_REPLACEMENT = "\ufffd"  # what lossy UTF-8 decoding yields for bytes of an incomplete character


class ChatTemplateError(ValueError):
    """A chat template could not be rendered (missing template, syntax error, or the template
    called ``raise_exception``); the message says why."""


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return value.get("content")
    return str(value)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """A fast tokenizer plus the settings from ``tokenizer_config.json``.

    Build it with ``load_tokenizer(model_dir)``; the constructor takes the pieces directly
    (``backend`` is a ``tokenizers.Tokenizer``; ``config`` the tokenizer_config dict).
    """

    def __init__(self, backend: Any, config: Mapping[str, Any] | None = None, *,
                 chat_template: str | None = None, extra_eos_token_ids: Iterable[int] = (),
                 name_or_path: str | None = None) -> None:
        self._tok = backend
        self._decoded_one: dict[int, str] = {}  # decode_one's memo
        # Our encode() must give token ids only: a tokenizer.json may carry padding or
        # truncation settings meant for training.
        backend.no_truncation()
        backend.no_padding()
        self.config: dict[str, Any] = dict(config or {})
        self.name_or_path = name_or_path
        self.model_max_length: int | None = self.config.get("model_max_length")

        # Named special tokens (bos_token, eos_token, ...) as strings, like transformers'
        # special_tokens_map; these are also variables of the chat template.
        self.special_tokens_map: dict[str, str] = {}
        for name in _NAMED_SPECIAL:
            content = _token_content(self.config.get(name))
            if content is not None:
                self.special_tokens_map[name] = content
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_token_id = (self.token_to_id(self.special_tokens_map["pad_token"])
                             if "pad_token" in self.special_tokens_map else None)

        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        eos += [int(i) for i in extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

        # Special ids: added tokens flagged special in tokenizer.json, the named ones, and the
        # extra ones listed in tokenizer_config.json. decode(skip_special_tokens=True) drops
        # exactly these.
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        extra = (self.config.get("additional_special_tokens") or []) + list(
            self.config.get("extra_special_tokens") or [])
        for content in [*self.special_tokens_map.values(), *map(_token_content, extra)]:
            i = self.token_to_id(content) if content else None
            if i is not None:
                special.add(i)
        self._special_ids = frozenset(special)

        # BOS/EOS on encode, as transformers (v5) does: an explicit add_bos_token /
        # add_eos_token in tokenizer_config.json replaces tokenizer.json's post-processor;
        # otherwise the post-processor decides.
        self._explicit_special = ("add_bos_token" in self.config
                                  or "add_eos_token" in self.config)
        if self._explicit_special or backend.post_processor is None:
            self._add_bos = bool(self.config.get("add_bos_token")) and self.bos_token_id is not None
            self._add_eos = bool(self.config.get("add_eos_token")) and self.eos_token_id is not None
            self._use_post_processor = False
        else:
            probe = backend.encode("a", add_special_tokens=True).ids
            self._add_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
            self._add_eos = False  # the post-processor adds whatever it adds
            self._use_post_processor = True

        template = chat_template if chat_template is not None else self.config.get(
            "chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template

    # -- vocabulary --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (base vocabulary plus added tokens), like ``len(hf_tokenizer)``."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._special_ids)

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` starts with BOS."""
        return self._add_bos

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    # -- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS (and EOS) as configured.

        BOS is not doubled when ``text`` already starts with the BOS token (as a rendered chat
        template does); transformers would give two BOS tokens there.
        """
        if self._use_post_processor:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if add_special_tokens:
                if self._add_bos:
                    ids = [self.bos_token_id, *ids]
                if self._add_eos:
                    ids = [*ids, self.eos_token_id]
        if (add_special_tokens and self._add_bos and len(ids) >= 2
                and ids[0] == ids[1] == self.bos_token_id):
            ids = ids[1:]
        return ids

    def decode_ints(self, ids: list[int]) -> str:
        """``decode(ids, skip_special_tokens=False)`` for a list of Python ints (no copy)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_one(self, token_id: int) -> str:
        """``decode_ints([token_id])``, memoized: the detokenizer decodes each new token on
        its own once per step and request (at most one string per vocabulary entry)."""
        text = self._decoded_one.get(token_id)
        if text is None:
            text = self._decoded_one[token_id] = self._tok.decode([token_id],
                                                                  skip_special_tokens=False)
        return text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid or incomplete UTF-8 becomes U+FFFD). Unlike transformers,
        never applies ``clean_up_tokenization_spaces``."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            *, tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) with the chat template.

        Like ``transformers``' ``apply_chat_template(..., tokenize=False)``: the template sees
        ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the named special
        tokens (``bos_token``, ``eos_token``, ...) and ``kwargs``. Raises ``ChatTemplateError``.
        """
        template = chat_template or self.chat_template
        if not template:
            where = f"{self.name_or_path}: " if self.name_or_path else ""
            raise ChatTemplateError(f"{where}the tokenizer has no chat template (no "
                                    f"chat_template in tokenizer_config.json and no "
                                    f"chat_template.jinja)")
        msgs = [_plain_message(m) for m in messages]
        context = {**self.special_tokens_map, **kwargs}
        import jinja2

        try:
            compiled = _compile_template(template)
            return compiled.render(messages=msgs, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None


def _plain_message(message: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = dataclasses.asdict(message)
    elif hasattr(message, "model_dump"):  # pydantic
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
    # Drop None values (OpenAI clients send content=None with tool calls), as transformers
    # does: templates handle a missing key better than a None.
    return {k: v for k, v in message.items() if v is not None}


@lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    """Compile a chat template in a sandbox configured like transformers' (same whitespace
    options, ``raise_exception``, ``tojson`` without HTML escaping, ``strftime_now``)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # transformers' {% generation %} ... {% endgeneration %} marks assistant text for
        # training masks; for rendering it is a no-op block.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def is_template_text(value: str) -> bool:
    """Whether a ``chat_template`` value is a template itself rather than a file name."""
    return "{{" in value or "{%" in value


def read_chat_template(value: str, name: str = "chat_template") -> str:
    """A ``chat_template`` option (``--chat-template``, the YAML key ``name``) -> the template
    text, compiled to check it. A value naming an existing file is read; else a value with
    Jinja syntax (``{{`` or ``{%``) is the template itself. ``ChatTemplateError`` naming
    ``name`` otherwise: the file does not exist, cannot be read, or does not compile."""
    if not isinstance(value, str) or not value.strip():
        raise ChatTemplateError(f"{name}: expected a template file or the template text, "
                                f"got {value!r}")
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{name}: cannot read {value}: {e}") from None
        where = value
    elif is_template_text(value):
        text, where = value, "the template"
    else:
        raise ChatTemplateError(f"{name}: {value!r}: no such file ({os.path.abspath(path)}), "
                                f"and not a template either (no '{{{{' or '{{%')")
    check_chat_template(text, f"{name}: {where}")
    return text


def check_chat_template(text: str, where: str = "chat_template") -> None:
    """``ChatTemplateError`` (``where: ...``) when ``text`` is empty or does not compile."""
    if not text.strip():
        raise ChatTemplateError(f"{where}: empty template")
    import jinja2

    try:
        _compile_template(text)
    except jinja2.TemplateError as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"{where}: the template does not compile{line}: {e}") from None


def load_tokenizer(model_dir: str, chat_template: str | None = None) -> Tokenizer:
    """Load ``model_dir``'s tokenizer: ``tokenizer.json`` (required), ``tokenizer_config.json``,
    ``chat_template.jinja`` (preferred over the config's template), and EOS ids from
    ``generation_config.json`` / ``config.json``. Missing files raise ``FileNotFoundError``
    naming the file. ``chat_template`` (its text, ``read_chat_template``) replaces the
    checkpoint's (``--chat-template``)."""
    from tokenizers import Tokenizer as _Backend

    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: tokenizer folder not found")
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        hint = (" (only fast tokenizers are supported: this folder has a sentencepiece "
                "tokenizer.model but no tokenizer.json)"
                if os.path.isfile(os.path.join(model_dir, "tokenizer.model")) else "")
        raise FileNotFoundError(f"{path}: file not found{hint}")
    try:
        backend = _Backend.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"{path}: cannot load tokenizer: {e}") from None

    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    config = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}

    template = None
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    json_path = os.path.join(model_dir, "chat_template.json")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    elif os.path.isfile(json_path):
        template = _read_json(json_path).get("chat_template")

    extra_eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(model_dir, name)
        if os.path.isfile(p):
            extra_eos += _eos_list(_read_json(p).get("eos_token_id"))
    if chat_template is not None:
        template = chat_template
    return Tokenizer(backend, config, chat_template=template, extra_eos_token_ids=extra_eos,
                     name_or_path=model_dir)


# -- streaming detokenization ------------------------------------------------------------------

# Prompt tokens decoded together with the first output tokens, so that decoders which treat
# the start of a text specially (sentencepiece's leading-space strip) see it mid-text.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas.

    Invariant: the concatenation of every ``update()`` result and ``flush()`` equals
    ``.text`` at the end; for a run without a stop string that is
    ``tokenizer.decode(output_ids, skip_special_tokens)``.

    Token ids are decoded in a sliding window (the prefix-offset / read-offset technique):
    ``ids[prefix:read]`` is text already read, kept as context; ``ids[read:]`` is new. A
    window whose text ends in U+FFFD ends inside a UTF-8 character, so its last characters
    wait for more tokens. Text that could still grow into a stop string (its last
    ``max(len(stop)) - 1`` characters) is held back too, unless the stop string is to be
    included in the output anyway.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._skip = params.skip_special_tokens
        self._stops = tuple(params.stop)
        self._hold = (max(map(len, self._stops)) - 1
                      if self._stops and not params.include_stop_str_in_output else 0)
        ids = [int(t) for t in prompt_token_ids]
        if self._skip:
            ids = [t for t in ids if not tokenizer.is_special(t)]
        context = ids[-_PROMPT_CONTEXT_TOKENS:]
        if tokenizer.decode(context, skip_special_tokens=False).endswith(_REPLACEMENT):
            context = []  # the prompt ends inside a character: decode the output on its own
        # ids[0:prefix) forgotten | ids[prefix:read) read, kept as context | ids[read:) new
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = tokenizer.decode(context, skip_special_tokens=False)
        self._decode = tokenizer.decode_ints
        self._partial = 0  # characters of ids[read:]'s text already taken (complete ones)
        self._text = ""  # output text so far: emitted + held back (cut at a stop string)
        self._emitted = 0  # text[:emitted] has been returned
        self.num_output_tokens = 0
        self.stopped = False
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """Output text so far (emitted plus held back), cut at the stop string if stopped."""
        return self._text

    def update(self, new_token_id: int) -> str:
        """Add one generated token; return the text that is now safe to stream (may be "")."""
        if self.stopped or self.finished:
            return ""
        self.num_output_tokens += 1
        token_id = int(new_token_id)
        if self._skip and self.tokenizer.is_special(token_id):
            return ""
        self._ids.append(token_id)
        new = self._read_new(final=False)
        if not self._stops:  # nothing held back: every call returns all of its new text
            if new:
                self._text += new
                self._emitted = len(self._text)
            return new
        return self._advance(new, final=False)

    def flush(self) -> str:
        """The request is over: return everything not yet emitted (held-back text, and the
        bytes of an incomplete trailing character, as U+FFFD)."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return self._advance("", final=True)
        new = self._read_new(final=True) if self._read < len(self._ids) else ""
        return self._advance(new, final=True)

    def _read_new(self, final: bool) -> str:
        """New complete text from ids[read:] (all of it when ``final``)."""
        ids = self._ids  # Python ints only
        full = self._decode(ids[self._prefix:])
        tail = full[len(self._prefix_text):]  # text of ids[read:]
        if final or not tail.endswith(_REPLACEMENT):
            new = tail[self._partial:]
            # Everything is read: the read part becomes the context of the next window
            # (mostly the one new token: its text alone is memoized by the tokenizer).
            prefix, self._read, self._partial = self._read, len(ids), 0
            self._prefix = prefix
            self._prefix_text = (self.tokenizer.decode_one(ids[prefix])
                                 if self._read - prefix == 1
                                 else self._decode(ids[prefix:self._read]))
            return new
        # The window ends inside a character: the text before the trailing U+FFFD run is final
        # (UTF-8 decoding of earlier bytes does not depend on later ones); take what's new.
        stable = tail.rstrip(_REPLACEMENT)
        new = stable[self._partial:]
        self._partial = max(self._partial, len(stable))
        return new

    def _advance(self, new: str, final: bool) -> str:
        if new:
            old_len = len(self._text)
            self._text += new
            # Like vLLM, stop strings count only after min_tokens tokens.
            if self._stops and self.num_output_tokens > self.params.min_tokens:
                self._check_stop(old_len)
        if self.stopped or final:
            cut = len(self._text)
        else:
            cut = max(self._emitted, len(self._text) - self._hold)
        # text[:emitted) returned before | text[emitted:cut) returned now | text[cut:) held
        delta = self._text[self._emitted:cut]
        self._emitted = cut
        return delta

    def _check_stop(self, old_len: int) -> None:
        """Find a stop string ending in the new text text[old_len:]; cut the text there."""
        best: tuple[int, str] | None = None
        include = self.params.include_stop_str_in_output
        for stop in self._stops:
            i = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if i < 0:
                continue
            end = i + len(stop) if include else i
            if best is None or end < best[0]:
                best = (end, stop)
        if best is not None:
            # Held-back text covers any stop string's start (end >= emitted), so nothing
            # past the cut was ever streamed.
            self._text = self._text[:best[0]]
            self.stopped = True
            self.stop_reason = best[1]
