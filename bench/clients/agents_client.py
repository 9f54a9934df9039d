"""openai-agents (the OpenAI Agents SDK) against the router: an Agent with one function tool,
run to completion through ``OpenAIChatCompletionsModel`` (case ``chat``: ``POST
/v1/chat/completions``) or ``OpenAIResponsesModel`` (case ``responses``: ``POST
/v1/responses``), with ``Runner.run`` or (cases ``chat-stream``, ``responses-stream``)
``Runner.run_streamed`` (``stream: true``); ``--tool-choice required`` forces the first turn's
call. Tracing is off (it would post to OpenAI). Run by the harness (``python -m
bench.clients``) inside the SDK's own virtualenv; the criteria are
``common.Run.weather_checks``."""

from __future__ import annotations

import argparse
import os
import sys

from bench.clients import common


async def run_agent(args: argparse.Namespace, run: common.Run) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url, api_key="none", max_retries=0,
                         timeout=args.timeout)
    model = (OpenAIChatCompletionsModel(args.model, client) if args.case.startswith("chat")
             else OpenAIResponsesModel(args.model, client))

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: the city's name.
        """
        run.tool(city=city)
        return common.weather(city)

    # tool_choice "required" (one call: no parallel calls): the SDK resets it to auto once
    # the tool ran (Agent.reset_tool_choice, on by default), so that the model can answer.
    forced = args.tool_choice == "required"
    agent = Agent(name="weather assistant", instructions=common.INSTRUCTIONS,
                  tools=[get_weather], model=model,
                  model_settings=ModelSettings(
                      temperature=0, max_tokens=args.max_tokens,
                      tool_choice="required" if forced else None,
                      parallel_tool_calls=False if forced else None))
    if args.case.endswith("-stream"):  # the same run as server-sent events
        streamed = Runner.run_streamed(agent, common.PROMPT, max_turns=4)
        kinds: dict[str, int] = {}
        async for event in streamed.stream_events():
            kinds[event.type] = kinds.get(event.type, 0) + 1
        run.notes["stream events"] = kinds
        result = streamed
    else:
        result = await Runner.run(agent, common.PROMPT, max_turns=4)
    run.notes["turns"] = len(result.raw_responses)
    run.weather_checks(result.final_output)


if __name__ == "__main__":
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    sys.exit(common.main({c: run_agent for c in ("chat", "responses", "chat-stream",
                                                  "responses-stream")},
                          ("openai-agents", "openai", "pydantic"),
                          model_errors=("ModelBehaviorError", "MaxTurnsExceeded")))
