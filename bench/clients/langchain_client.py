"""langchain-openai against the router: ``ChatOpenAI(...).bind_tools([get_weather])`` as a
tool loop written out (case ``tools``: invoke, run the tool call, send the ``ToolMessage``
back, invoke again for the answer; ``--tool-choice required`` forces the first turn's
call, the second is auto) and ``with_structured_output(City)`` (case
``structured``, the library's default method). Run by the harness (``python -m
bench.clients``) inside langchain-openai's own virtualenv; criteria:
``common.Run.weather_checks`` / ``city_checks``."""

from __future__ import annotations

import argparse
import sys

from bench.clients import common


def chat_model(args: argparse.Namespace):  # noqa: ANN201 - a langchain ChatOpenAI
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=args.model, base_url=args.base_url, api_key="none", temperature=0,
                      max_tokens=args.max_tokens, max_retries=0, timeout=args.timeout)


def run_tools(args: argparse.Namespace, run: common.Run) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        run.tool(city=city)
        return common.weather(city)

    llm = chat_model(args).bind_tools([get_weather])
    first_llm = (chat_model(args).bind_tools([get_weather], tool_choice="required",
                                             parallel_tool_calls=False)
                 if args.tool_choice == "required" else llm)
    messages = [SystemMessage(common.INSTRUCTIONS), HumanMessage(common.PROMPT)]
    first = first_llm.invoke(messages)
    run.notes["turn 1 tool_calls"] = first.tool_calls
    run.notes["turn 1 content"] = first.content
    messages.append(first)
    for call in first.tool_calls:
        if call["name"] != "get_weather":
            run.check("turn 1 calls get_weather", False, call)
            return
        messages.append(ToolMessage(get_weather.invoke(call["args"]),
                                    tool_call_id=call["id"]))
    if not first.tool_calls:  # answered at once: the tool criteria fail on it
        run.weather_checks(_text(first))
        return
    second = llm.invoke(messages)
    run.notes["turn 2 tool_calls"] = second.tool_calls
    run.weather_checks(_text(second) if not second.tool_calls else None)


def _text(message) -> str:  # noqa: ANN001 - a langchain AIMessage
    return message.content if isinstance(message.content, str) else str(message.text)


def run_structured(args: argparse.Namespace, run: common.Run) -> None:
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    out = chat_model(args).with_structured_output(City, include_raw=True).invoke(
        common.EXTRACT_PROMPT)
    raw = out["raw"]
    run.notes["raw content"] = getattr(raw, "content", None)
    run.notes["raw tool_calls"] = getattr(raw, "tool_calls", None)
    if out["parsing_error"] is not None:
        raise out["parsing_error"]
    run.city_checks(out["parsed"])


if __name__ == "__main__":
    sys.exit(common.main({"tools": run_tools, "structured": run_structured},
                          ("langchain-openai", "langchain-core", "openai", "pydantic"),
                          model_errors=("OutputParserException", "ValidationError")))
