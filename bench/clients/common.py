"""What every client module of the ``bench.clients`` harness shares (stdlib only: it runs
inside each client library's own virtualenv, beside that library and nothing of this project).

A client module is run as ``python -m bench.clients.<lib>_client --case NAME --base-url URL
--model NAME --result FILE [--max-tokens N] [--timeout S] [--tool-choice auto|required]``
(``PYTHONPATH``: the repository root).
It runs one case against the OpenAI-compatible server at ``URL`` and writes ``FILE``: one
JSON object::

    {"case", "library": {dist: version}, "checks": [{"name", "ok", "detail"}],
     "tool_calls": [{...arguments the tool function received}], "final": str | null,
     "error": null | {"type", "message", "kind", "traceback"}, "passed": bool}

``passed``: no exception and every check ok (and at least one check). ``error.kind`` sorts an
exception by its class (and the classes of the exceptions chained to it): ``server`` (the SDK
got a 4xx/5xx), ``sdk`` (the SDK could not read a 2xx answer: a wrong shape), ``model`` (the
library's own "the model misbehaved" errors: bad tool arguments after retries, too many turns),
``other`` (anything else: the harness reports it as unclassified). The harness, not this
file, makes the final call from the HTTP exchanges it recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

PROMPT = "What is the weather in Paris?"
INSTRUCTIONS = ("You are a helpful assistant. Use the get_weather tool to look up the weather, "
                "then answer the user in one sentence.")
EXTRACT_PROMPT = ("Extract the city and the country it is in from this sentence: "
                  "Paris is the capital of France.")
TOOL_DOC = "Get the current weather in a city."
# The status errors of the openai SDK and of pydantic-ai (its own class, chained or not).
SERVER_ERRORS = frozenset({"APIStatusError", "ModelHTTPError"})
SDK_ERRORS = frozenset({"APIResponseValidationError"})


def weather(city: str) -> str:
    """The tool's fixed answer (no network): the final answer can be checked against it."""
    return f"It is sunny and 22 degrees Celsius in {city}."


@dataclass
class Run:
    """What one case found: its checks, the tool calls its functions received, the answer."""

    case: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    final: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def tool(self, **arguments: Any) -> None:
        self.tool_calls.append(arguments)

    def weather_checks(self, final: Any) -> None:
        """The tool-loop criteria: the tool ran, with a city naming Paris, then a non-empty
        text answer came back."""
        self.final = final if isinstance(final, str) else repr(final)
        self.check("the tool was called", bool(self.tool_calls), self.tool_calls)
        cities = [str(c.get("city", "")) for c in self.tool_calls]
        self.check("its city argument names Paris", any("paris" in c.lower() for c in cities),
                   cities)
        self.check("a non-empty text answer at the end of the run",
                   isinstance(final, str) and final.strip() != "", self.final)

    def city_checks(self, parsed: Any) -> None:
        """The extraction criteria: an instance of the model class with the right values."""
        self.final = repr(parsed)
        name = str(getattr(parsed, "name", ""))
        country = str(getattr(parsed, "country", ""))
        self.check("a City instance came back", type(parsed).__name__ == "City", self.final)
        self.check("name names Paris", "paris" in name.lower(), name)
        self.check("country names France", "france" in country.lower(), country)


def chain(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and the exceptions behind it (cause, context, an exception group's members)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        todo.extend(getattr(e, "exceptions", ()) or ())


def error_kind(exc: BaseException, model: Iterable[str], sdk: Iterable[str] = ()) -> str:
    """``server`` if an SDK status error is anywhere in the chain; else the first exception
    (outermost first) whose class is a known ``sdk`` or ``model`` one; else ``other``."""
    excs = list(chain(exc))
    names = [{c.__name__ for c in type(e).__mro__} for e in excs]
    if any(n & SERVER_ERRORS for n in names):
        return "server"
    sdk_names, model_names = SDK_ERRORS | set(sdk), set(model)
    for n in names:
        if n & sdk_names:
            return "sdk"
        if n & model_names:
            return "model"
    return "other"


def versions(dists: Iterable[str]) -> dict[str, str]:
    out = {}
    for d in dists:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = "not installed"
    return out


def main(cases: dict[str, Callable[[argparse.Namespace, Run], Any]], dists: Iterable[str],
         model_errors: Iterable[str], sdk_errors: Iterable[str] = ()) -> int:
    """Parse the arguments, run the case (a function or a coroutine function), write the
    result file; exit 0 when it passed."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # run as python -m <module>
    ap = argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec else None)
    ap.add_argument("--case", required=True, choices=sorted(cases))
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=120.0, help="per HTTP request")
    ap.add_argument("--tool-choice", default="auto", choices=("auto", "required"),
                    help="the tool loops' first turn (required: a call is forced there, "
                         "then auto, so that the model can answer)")
    args = ap.parse_args()
    run = Run(args.case)
    error = None
    try:
        fn = cases[args.case]
        if inspect.iscoroutinefunction(fn):
            asyncio.run(fn(args, run))
        else:
            fn(args, run)
    except Exception as e:  # noqa: BLE001 - any failure is the result, classified below
        error = {"type": f"{type(e).__module__}.{type(e).__qualname__}",
                 "message": str(e)[:4000], "kind": error_kind(e, model_errors, sdk_errors),
                 "chain": [f"{type(x).__module__}.{type(x).__qualname__}: {str(x)[:500]}"
                           for x in list(chain(e))[1:6]],
                 "traceback": traceback.format_exc()[-6000:]}
    passed = error is None and bool(run.checks) and all(c["ok"] for c in run.checks)
    result = {"case": run.case, "library": versions(dists), "checks": run.checks,
              "tool_calls": run.tool_calls, "final": run.final, "notes": run.notes,
              "error": error, "passed": passed}
    tmp = args.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=repr)
    os.replace(tmp, args.result)
    print(json.dumps({"case": run.case, "passed": passed,
                      "error": error and error["type"]}), flush=True)
    return 0 if passed else 1

