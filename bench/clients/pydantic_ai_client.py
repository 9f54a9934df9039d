"""pydantic-ai against the router: an ``Agent`` with one plain tool on ``OpenAIChatModel``
(an ``OpenAIProvider`` whose ``AsyncOpenAI`` client points at the router), run to completion
(case ``tools``; ``--tool-choice required`` forces one call until the tool ran). Run by the
harness (``python -m bench.clients``) inside pydantic-ai's own virtualenv; criteria:
``common.Run.weather_checks``."""

from __future__ import annotations

import argparse
import sys

from bench.clients import common


async def run_tools(args: argparse.Namespace, run: common.Run) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    client = AsyncOpenAI(base_url=args.base_url, api_key="none", max_retries=0,
                         timeout=args.timeout)
    model = OpenAIChatModel(args.model, provider=OpenAIProvider(openai_client=client))
    def settings(ctx: RunContext[None]) -> ModelSettings:
        # "required" until the tool ran, then auto (a callable: pydantic-ai refuses a static
        # "required", which would leave the agent no way to answer).
        forced = args.tool_choice == "required" and not run.tool_calls
        return {"temperature": 0, "max_tokens": args.max_tokens,
                "tool_choice": "required" if forced else "auto",
                **({"parallel_tool_calls": False} if forced else {})}

    agent = Agent(model, instructions=common.INSTRUCTIONS, model_settings=settings)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: the city's name.
        """
        run.tool(city=city)
        return common.weather(city)

    result = await agent.run(common.PROMPT, usage_limits=UsageLimits(request_limit=4))
    run.notes["messages"] = len(result.all_messages())
    run.weather_checks(result.output)


if __name__ == "__main__":
    sys.exit(common.main({"tools": run_tools}, ("pydantic-ai-slim", "openai", "pydantic"),
                          model_errors=("UnexpectedModelBehavior", "UsageLimitExceeded")))
