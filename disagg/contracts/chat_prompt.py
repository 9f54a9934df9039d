"""A chat request's prompt text: the messages through the chat template, with vLLM's
``continue_final_message`` (the prompt ends inside the last message, so the model continues
it) and ``chat_template_kwargs`` (extra template variables)."""

from __future__ import annotations

from typing import Any

from disagg.contracts import protocol as P


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, template_vars: dict[str, Any],
                **template_args: Any) -> str:
    """The rendered prompt; 400 naming ``messages`` when the template rejects them.
    ``template_args``: what the template takes besides (``tools``, ...)."""
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_args,
            **template_vars)
    except ValueError as e:  # ChatTemplateError: raise_exception(...) in the template
        raise P.bad_request(f"messages: the chat template rejected them: {e}",
                            param="messages") from None
    if continue_final_message:
        text = _cut_after_final_message(text, messages)
    return text


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` up to the end of the last message's content (what follows it is the
    template's end-of-turn), as transformers does for ``continue_final_message``."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise P.bad_request("continue_final_message: the last message must have text content",
                            param="continue_final_message")
    at = text.rfind(final.strip())
    if at < 0:
        raise P.bad_request("continue_final_message: the chat template does not render the "
                            "last message's content verbatim", param="continue_final_message")
    return text[:at + len(final.strip())]
