"""Offline generation, shaped like vLLM's ``LLM``.

    from disagg import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", max_num_tokens=256)
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from disagg.config import build_engine_config
from disagg.engine.llm_engine import LLMEngine
from disagg.engine.outputs import CompletionOutput, RequestOutput
from disagg.request import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """``tensor_parallel_size`` / ``pipeline_parallel_size`` > 1 spawn rank processes: call
    ``shutdown()`` (or use ``with LLM(...) as llm``) to stop them and leave the process group;
    dropping the last reference (``del llm``) does the same, and so does exit. Another parallel
    LLM can then start in the same process. As with any ``spawn``, a script doing so needs an
    ``if __name__ == "__main__":`` guard."""

    def __init__(self, model: str, **engine_options: object) -> None:
        self.engine = LLMEngine(build_engine_config(model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); one RequestOutput per prompt, in order,
        with ``n`` completions each."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts"
                )

        # Each of the n completions is its own engine request; seeded ones get seed + i so the
        # samples differ yet stay reproducible.
        groups: list[list[str]] = []
        texts: list[str | None] = []
        for prompt, params in zip(prompts, params_list, strict=True):
            if isinstance(prompt, str):
                token_ids = self.tokenizer.encode(prompt)
                texts.append(prompt)
            else:
                token_ids = [int(t) for t in prompt]
                texts.append(None)
            ids = []
            for i in range(params.n):
                child = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + i
                )
                rid = f"offline-{next(self._counter)}"
                self.engine.add_request(rid, token_ids, child, prompt=texts[-1])
                ids.append(rid)
            groups.append(ids)

        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        results = []
        for ids, text in zip(groups, texts, strict=True):
            first = final[ids[0]]
            completions: list[CompletionOutput] = []
            for i, rid in enumerate(ids):
                comp = final[rid].outputs[0]
                completions.append(dataclasses.replace(comp, index=i))
            results.append(dataclasses.replace(first, outputs=completions, prompt=text))
        return results
