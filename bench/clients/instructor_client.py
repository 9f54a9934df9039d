"""instructor against the router: ``instructor.from_openai(OpenAI(...),
mode=Mode.TOOLS_STRICT)`` extracting a small pydantic model (case ``tools-strict``: a forced
call of one strict function tool whose parameters are the model's schema; instructor re-asks
once on a validation error). Run by the harness (``python -m bench.clients``) inside
instructor's own virtualenv; criteria: ``common.Run.city_checks``."""

from __future__ import annotations

import argparse
import sys

from bench.clients import common


def run_tools_strict(args: argparse.Namespace, run: common.Run) -> None:
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    client = instructor.from_openai(
        OpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=args.timeout),
        mode=instructor.Mode.TOOLS_STRICT)
    city = client.chat.completions.create(
        # strict=True: instructor 1.x maps TOOLS_STRICT onto TOOLS and marks the tool
        # strict only when asked (otherwise the request carries no "strict": true).
        model=args.model, response_model=City, max_retries=2, temperature=0, strict=True,
        max_tokens=args.max_tokens,
        messages=[{"role": "user", "content": common.EXTRACT_PROMPT}])
    run.city_checks(city)


if __name__ == "__main__":
    sys.exit(common.main({"tools-strict": run_tools_strict}, ("instructor", "openai", "pydantic"),
                          model_errors=("InstructorRetryException", "ValidationError"),
                          sdk_errors=("ResponseParsingError",)))
