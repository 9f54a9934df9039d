"""RequestState.output builds its RequestOutput positionally (it runs once per request and step):
every field must land where its name says, finished or not."""

from __future__ import annotations

from disagg.contracts.kv_mode import LOCAL
from disagg.engine.outputs import CompletionOutput, RequestOutput
from disagg.engine.request_state import RequestState
from disagg.kv_connector.errors import KVTransferError
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.tokenizer import load_tokenizer


def _state(tiny_llama: str) -> RequestState:
    req = Request(request_id="r-1", prompt_token_ids=[11, 12, 13],
                  sampling_params=SamplingParams(logprobs=1, prompt_logprobs=1, max_tokens=9))
    st = RequestState.new(req, load_tokenizer(tiny_llama), "the prompt", None, LOCAL)
    req.num_cached_tokens = 2
    req.stop_reason = "stop!"
    req.error = "an error"
    st.disagg_out = {"lease": "x"}
    st.kv_error = KVTransferError("pull failed")
    st.prompt_lps = [None, {12: -0.5}, {13: -0.25}]
    st.prompt_ranks = [None, 1, 2]
    return st


def test_output_fields_land_in_place(tiny_llama: str) -> None:
    st = _state(tiny_llama)
    req = st.request
    for tok, lp in ((70, {70: -0.1}), (71, {71: -0.2}), (72, {72: -0.3})):
        req.output_token_ids.append(tok)
        st.logprobs.append(lp)
        st.detok.update(tok)
    first = st.output("d1", finished=False)
    assert first == RequestOutput(
        request_id="r-1", prompt_token_ids=[11, 12, 13],
        outputs=[CompletionOutput(index=0, text=st.detok.text, token_ids=[70, 71, 72],
                                  delta_text="d1", delta_token_ids=[70, 71, 72],
                                  logprobs=[{70: -0.1}, {71: -0.2}, {72: -0.3}],
                                  delta_logprobs=[{70: -0.1}, {71: -0.2}, {72: -0.3}],
                                  finish_reason=None, stop_reason=None)],
        finished=False, num_cached_tokens=2, metrics=st.metrics, error=None,
        prompt="the prompt", disaggregated_params=None, kv_transfer_error=None,
        prompt_logprobs=[None, {12: -0.5}, {13: -0.25}], prompt_logprob_ranks=[None, 1, 2])
    assert st.metrics.finished_time is None

    req.output_token_ids.append(73)
    st.logprobs.append({73: -0.4})
    req.status = RequestStatus.FINISHED_STOPPED
    last = st.output("d2", finished=True)
    assert last == RequestOutput(
        request_id="r-1", prompt_token_ids=[11, 12, 13],
        outputs=[CompletionOutput(index=0, text=st.detok.text, token_ids=[70, 71, 72, 73],
                                  delta_text="d2", delta_token_ids=[73],
                                  logprobs=[{70: -0.1}, {71: -0.2}, {72: -0.3}, {73: -0.4}],
                                  delta_logprobs=[{73: -0.4}],
                                  finish_reason="stop", stop_reason="stop!")],
        finished=True, num_cached_tokens=2, metrics=st.metrics, error="an error",
        prompt="the prompt", disaggregated_params={"lease": "x"}, kv_transfer_error=st.kv_error,
        prompt_logprobs=[None, {12: -0.5}, {13: -0.25}], prompt_logprob_ranks=[None, 1, 2])
    assert st.metrics.finished_time is not None
    # snapshots: later tokens do not change an output already handed out
    req.output_token_ids.append(74)
    st.logprobs.append({74: -0.5})
    assert first.outputs[0].token_ids == [70, 71, 72]
    assert len(first.outputs[0].logprobs) == 3


def test_uncached_prompt_reports_zero_cached_tokens(tiny_llama: str) -> None:
    st = _state(tiny_llama)
    st.request.num_cached_tokens = -1  # not looked up yet
    assert st.output("", finished=False).num_cached_tokens == 0
