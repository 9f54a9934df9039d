"""The response formats: a completions or chat completions answer, whole or as stream chunks,
built from the engine outputs of a request's choices (protocol.py has the JSON shapes)."""

from __future__ import annotations

import abc
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from disagg.contracts import protocol as P
from disagg.contracts import responses as R
from disagg.contracts.kv_mode import Pull
from disagg.engine.outputs import RequestOutput
from disagg.server.fanout import Choice
from disagg.server.tool_calls import ToolCalls

if TYPE_CHECKING:
    from disagg.server.state import ServerState
    from disagg.tracing import Trace


class Format(abc.ABC):
    """Builds one endpoint's responses and stream chunks from engine outputs.

    One instance per HTTP request (``rid`` is its id, ``created`` its time). A non-streamed
    request calls ``response`` once, after every choice finished. A streamed one sends
    ``start_chunks``, then ``delta_chunk`` for each engine output in arrival order (None: the
    output adds nothing to send yet, its text being held back), then ``usage_chunk`` when the
    client asked for usage. Logprobs are sent with the text of their tokens, so a delta whose
    text is held back keeps its logprobs for the next one (``take_logprobs``).
    """

    request_model: type[P.CompletionRequest] | type[P.ChatCompletionRequest]
    id_prefix: str  # of the response's id
    chunk_object: str  # a stream chunk's "object"

    def __init__(self, srv: ServerState, req: Any, rid: str) -> None:
        self.srv = srv
        self.req = req
        self.rid = rid
        self.created = P.now()
        self.model = srv.model_name
        self.include_usage = req.include_usage_in_stream
        self.continuous_usage = req.continuous_usage_in_stream  # every chunk: running counts
        # Migration (``disagg_requests.migration_fields``): each chunk's token ids in the
        # stream for the router; the output tokens another worker streamed (a resumed answer).
        self.token_ids = False
        self.resumed: tuple[int, ...] | None = None
        # The answer carries its phase breakdown (``request_timing``; the routes decide).
        self.timing = False
        # Its trace when the worker traces (``disagg/tracing.py``; None: off).
        self.trace: Trace | None = None

    def usage(self, choices: list[Choice]) -> dict[str, Any]:
        prompts: dict[int, list[Choice]] = {}
        for c in choices:
            prompts.setdefault(c.prompt_index, []).append(c)
        prompt_tokens = sum(len(cs[0].prompt_ids) for cs in prompts.values())
        completion_tokens = sum(c.num_tokens for c in choices)
        # n choices are n engine requests over one prompt: report what all of them reused.
        cached = sum(min(cached_tokens(c) for c in cs) for cs in prompts.values())
        return P.usage(prompt_tokens, completion_tokens, cached)

    def running_usage(self, c: Choice) -> dict[str, Any] | None:
        """A stream chunk's ``usage`` for choice ``c``: its running counts with
        ``continuous_usage_stats`` (vLLM's: the choice's prompt and the tokens it generated so
        far), else None (null but in the last chunk)."""
        if not self.continuous_usage:
            return None
        done = c.num_tokens
        return {"prompt_tokens": len(c.prompt_ids), "completion_tokens": done,
                "total_tokens": len(c.prompt_ids) + done}

    def start_chunks(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return []

    # A stream's chunks as server-sent events: ``data: <chunk>`` each, an in-band error, and
    # ``data: [DONE]`` last (a subclass may write other events for the same chunks).

    def sse(self, chunk: dict[str, Any]) -> str:
        return P.sse(chunk)

    def sse_error(self, body: dict[str, Any]) -> str:
        return P.sse(body)

    def sse_end(self) -> str:
        return P.SSE_DONE

    @abc.abstractmethod
    def response(self, choices: list[Choice]) -> dict[str, Any]:
        """The whole answer of a non-streamed request."""

    def delta_chunk(self, c: Choice, out: Any) -> dict[str, Any] | list[dict[str, Any]] | None:
        """The stream chunk(s) of one engine output of choice ``c`` (None: nothing to send)."""
        comp = out.outputs[0]
        finish, stop_reason = finish_of(out)
        ids, lps = self.take_logprobs(c, comp, flush=finish is not None)
        if not comp.delta_text and finish is None:
            return None
        return self.delta(c, comp.delta_text, ids, lps, finish, stop_reason)

    @abc.abstractmethod
    def delta(self, c: Choice, text: str, ids: list[int], lps: list[dict[int, float]],
              finish: str | None, stop_reason: int | str | None
              ) -> dict[str, Any] | list[dict[str, Any]]:
        """A stream chunk with ``text`` (and the logprobs of ``ids``) for choice ``c``."""

    @abc.abstractmethod
    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        """The last chunk of a stream whose client asked for usage."""

    def timing_chunk(self, timing: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream that asked for its timing but not for usage (with
        usage, the usage chunk carries it): no choice, the ``timing`` object."""
        return {"id": self.rid, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": [], "timing": timing}

    def take_logprobs(self, c: Choice, comp: Any, flush: bool) -> tuple[list[int],
                                                                         list[dict[int, float]]]:
        """The delta's tokens and logprobs, held back while the delta has no text yet."""
        if c.params.logprobs is None or comp.delta_logprobs is None:
            return [], []
        c.pending_ids.extend(comp.delta_token_ids)
        c.pending_lps.extend(comp.delta_logprobs)
        if not (comp.delta_text or flush):
            return [], []
        ids, lps = c.pending_ids, c.pending_lps
        c.pending_ids, c.pending_lps = [], []
        return ids, lps


def cached_tokens(c: Choice) -> int:
    """The choice's prompt tokens not computed for it: a generation_only request reports the
    context worker's (it did the prefill; this worker pulled the KV)."""
    if isinstance(c.mode, Pull) and c.mode.params.cached_tokens is not None:
        return c.mode.params.cached_tokens
    # (a resumed request's hit may cover some of its outputs too: only the prompt's count)
    return min(c.final.num_cached_tokens, len(c.prompt_ids)) if c.final is not None else 0


def final_output(c: Choice) -> Any:
    """The choice's last CompletionOutput; an empty aborted one if the engine never sent it."""
    if c.final is not None:
        return c.final.outputs[0]
    return SimpleNamespace(text="", token_ids=[], logprobs=None, finish_reason="abort",
                           stop_reason=None)


def finish_of(out: Any) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) of a finished output; (None, None) before."""
    if not out.finished:
        return None, None
    comp = out.outputs[0]
    return comp.finish_reason, comp.stop_reason


class CompletionFormat(Format):
    """``echo``: the prompt's text (and, with ``logprobs``, its tokens' logprobs, the first
    null) comes before the completion's, in the answer or in each choice's first chunk.
    ``echo`` with ``max_tokens`` 0 answers the prompt alone (``echo_only``)."""

    request_model = P.CompletionRequest
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, srv: ServerState, req: Any, rid: str) -> None:
        super().__init__(srv, req, rid)
        self._to_echo: dict[int, Any] = {}  # choice index -> an engine output (streaming)
        self._echoed: set[int] = set()

    def usage(self, choices: list[Choice]) -> dict[str, Any]:
        u = super().usage(choices)
        if self.req.echo_only:  # the engine's one sampled token is not part of the answer
            u = P.usage(u["prompt_tokens"], 0, u["prompt_tokens_details"]["cached_tokens"])
        return u

    def running_usage(self, c: Choice) -> dict[str, Any] | None:
        u = super().running_usage(c)
        if u is not None and self.req.echo_only:  # (as usage: no token is the answer's)
            u = {**u, "completion_tokens": 0, "total_tokens": u["prompt_tokens"]}
        return u

    def _echo(self, c: Choice, out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt's text and (with ``logprobs``) its logprobs part."""
        # Token ids echo as /detokenize shows them (special tokens too, as their logprobs do).
        text = (c.prompt_text if c.prompt_text is not None
                else self.srv.engine.tokenizer.decode(c.prompt_ids, skip_special_tokens=False))
        lps = out.prompt_logprobs
        if self.req.logprobs is None or lps is None:
            return text, None
        return text, P.echo_logprobs(c.prompt_ids, lps, self.srv.token_text)

    def _choice(self, c: Choice, out: RequestOutput | None, text: str, ids: list[int],
                lps: list[dict[int, float]] | None, offset: int, finish: str | None,
                stop_reason: int | str | None) -> dict[str, Any]:
        """One choice (of the answer or a chunk); ``out``: an engine output with the prompt's
        logprobs when this choice echoes or reports them now, else None."""
        if self.req.echo_only:
            ids, lps, text = [], [], ""
            if finish is not None:
                finish, stop_reason = "length", None
        lp = None
        if c.params.logprobs is not None and lps is not None:
            lp = P.completion_logprobs(ids, lps, self.srv.token_text, offset)
        if out is not None and self.req.echo:
            echo_text, echo_lp = self._echo(c, out)
            text = echo_text + text
            if lp is not None and echo_lp is not None:
                lp = P.join_logprobs(echo_lp, lp)
        choice = P.completion_choice(c.index, text, finish, lp, stop_reason)
        plps = out.prompt_logprobs if out is not None else None
        if out is not None and self.req.prompt_logprobs is not None and plps is not None:
            choice["prompt_logprobs"] = P.prompt_logprobs_json(
                c.prompt_ids, plps, out.prompt_logprob_ranks, self.srv.token_text)
        return choice

    def _echo_end(self, c: Choice, out: RequestOutput | None) -> int:
        """Where the completion's text offsets start: after the echoed prompt's tokens."""
        if not self.req.echo or out is None or out.prompt_logprobs is None:
            return 0
        return sum(len(self.srv.token_text(t)) for t in c.prompt_ids)

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        items = []
        for c in choices:
            comp = final_output(c)
            items.append(self._choice(c, c.final, comp.text, comp.token_ids, comp.logprobs,
                                      self._echo_end(c, c.final), comp.finish_reason,
                                      comp.stop_reason))
        return P.completion_response(self.rid, self.created, self.model, items,
                                     self.usage(choices))

    def delta_chunk(self, c: Choice, out: Any) -> dict[str, Any] | None:
        if self.req.echo and c.index not in self._echoed:
            self._to_echo.setdefault(c.index, out)  # echoed with the choice's first chunk
        return super().delta_chunk(c, out)

    def delta(self, c: Choice, text: str, ids: list[int], lps: list[dict[int, float]],
              finish: str | None, stop_reason: int | str | None) -> dict[str, Any]:
        out = self._to_echo.pop(c.index, None)
        if out is not None:
            self._echoed.add(c.index)
            c.text_offset = self._echo_end(c, out)
        choice = self._choice(c, out, text, ids, lps, c.text_offset, finish, stop_reason)
        if choice["logprobs"] is not None:
            c.text_offset += sum(len(self.srv.token_text(t)) for t in ids)
        return P.completion_chunk(self.rid, self.created, self.model, [choice],
                                  self.running_usage(c), with_usage_field=self.include_usage)

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return P.completion_chunk(self.rid, self.created, self.model, [], self.usage(choices),
                                  with_usage_field=True)


class ChatFormat(Format):
    request_model = P.ChatCompletionRequest
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, srv: ServerState, req: Any, rid: str) -> None:
        super().__init__(srv, req, rid)
        self.tool_choice = req.tool_choice_of()
        self._tool_calls: dict[int, ToolCalls] = {}  # by choice index

    def tool_calls(self, c: Choice) -> ToolCalls:
        """Choice ``c``'s reader of tool calls (its streaming state)."""
        return self._tool_calls.setdefault(c.index, ToolCalls(
            self.tool_choice, self.srv.settings.tool_call_parser))

    @property
    def top_n(self) -> int:
        return self.req.top_logprobs or 0

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        items = []
        for c in choices:
            comp = final_output(c)
            lp = None
            if self.req.logprobs and comp.logprobs is not None:
                lp = P.chat_logprobs(comp.token_ids, comp.logprobs, self.srv.token_text,
                                     self.top_n)
            message, finish = self.tool_calls(c).message(comp.text, comp.finish_reason)
            items.append(P.chat_choice(c.index, comp.text, finish, lp, comp.stop_reason,
                                       message))
        answer = P.chat_response(self.rid, self.created, self.model, items,
                                 self.usage(choices))
        final = choices[0].final if choices else None
        plps = final.prompt_logprobs if final is not None else None
        if final is not None and self.req.prompt_logprobs is not None and plps is not None:
            answer["prompt_logprobs"] = P.prompt_logprobs_json(
                choices[0].prompt_ids, plps, final.prompt_logprob_ranks,
                self.srv.token_text)
        return answer

    def start_chunks(self, choices: list[Choice]) -> list[dict[str, Any]]:
        # OpenAI opens each choice with a role-only delta (a resumed answer had it already).
        if self.resumed is not None:
            return []
        return [P.chat_chunk(self.rid, self.created, self.model,
                             [P.chat_chunk_choice(c.index, {"role": "assistant", "content": ""})],
                             self.running_usage(c), with_usage_field=self.include_usage)
                for c in choices]

    def delta(self, c: Choice, text: str, ids: list[int], lps: list[dict[int, float]],
              finish: str | None, stop_reason: int | str | None
              ) -> dict[str, Any] | list[dict[str, Any]]:
        lp = None
        if self.req.logprobs:
            lp = P.chat_logprobs(ids, lps, self.srv.token_text, self.top_n)
        tc = self.tool_calls(c)
        if not tc.active:
            deltas = [{"content": text}] if text else [{}]
        else:  # content and tool-call deltas; the last one carries the finish and logprobs
            deltas = tc.stream_delta(text, finish is not None)
            if not deltas and finish is None:
                return []  # held back: it may open a tool call
            deltas = deltas or [{}]
            finish = tc.stream_finish_reason(finish)
        chunks = [P.chat_chunk(self.rid, self.created, self.model, [P.chat_chunk_choice(
            c.index, d, *((finish, lp, stop_reason) if i == len(deltas) - 1 else ()))],
            self.running_usage(c), with_usage_field=self.include_usage)
            for i, d in enumerate(deltas)]
        return chunks[0] if len(chunks) == 1 else chunks

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return P.chat_chunk(self.rid, self.created, self.model, [], self.usage(choices),
                            with_usage_field=True)


class ResponsesFormat(ChatFormat):
    """``/v1/responses``: the chat answer of the request's chat form (``responses``), turned
    into a Response object, or its chunks into the Responses event stream; a finished
    response is stored when the request asks (``store``)."""

    id_prefix = "resp"

    def __init__(self, srv: ServerState, req: Any, rid: str, call: R.ResponsesCall,
                 store: R.ResponseStore) -> None:
        super().__init__(srv, req, rid)
        self.call = call
        self.store = store
        self.events = R.EventStream(call, lambda resp: call.keep(store, resp))

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        resp = self.call.response(super().response(choices))
        self.call.keep(self.store, resp)
        return resp

    def sse(self, chunk: dict[str, Any]) -> str:
        return self.events.feed(chunk)

    def sse_error(self, body: dict[str, Any]) -> str:
        return self.events.error(body)

    def sse_end(self) -> str:
        return self.events.finish()
