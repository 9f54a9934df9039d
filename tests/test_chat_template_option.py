"""``--chat-template FILE|TEMPLATE`` (YAML ``chat_template``) and the packaged tool-aware
template of SmolLM2 (``disagg/chat_templates/smollm2_tools.jinja``).

The option: a file is read, Jinja text is the template, anything else (or a template that does
not compile) is a start-up error naming ``chat_template``; the worker renders with it; the
router's token-aware policies render the YAML's template as the workers do; ``disagg launch``
passes a file on as an absolute path and ``disagg deploy`` puts its text into the YAMLs (the
pods and nodes do not have the file). The SmolLM2 template: every message kind renders, its
tool calls parse back with the hermes parser, a chat without tools renders exactly as
SmolLM2's own template, and the packaged ``smollm2`` gets it (with ``tool_call_parser:
hermes``) from ``disagg launch`` / ``deploy`` unless the YAML says otherwise.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
import pytest
import tomllib
import yaml
from server_fixtures import (
    free_port,
    serve_in_thread,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
)

from disagg.chat_templates import MODEL_DEFAULTS, SMOLLM2_TOOLS
from disagg.contracts import protocol as P
from disagg.contracts.cluster import PolicyConfig, RouterConfigError, parse_cluster_config
from disagg.deploy.plan import DeployError
from disagg.deploy.plan import build_plan as deploy_plan
from disagg.launch import LaunchError, build_plan
from disagg.router.prompt_tokens import CHAT, PromptTokens
from disagg.server.tool_calls import parse_hermes
from disagg.tokenizer import ChatTemplateError, load_tokenizer, read_chat_template

ROOT = Path(__file__).resolve().parent.parent
# A template whose prompt no checkpoint template writes: the rendered text shows which ran.
MARKED = ("{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<<assistant>>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}}}}]


def marked(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<<{m['role']}>> {m['content']}\n" for m in messages) + "<<assistant>>"


# ---- the option's value ---------------------------------------------------------------------


def test_read_chat_template(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(MARKED)
    assert read_chat_template(str(f)) == MARKED
    assert read_chat_template(MARKED) == MARKED  # the text itself
    cases = [
        ("missing.jinja", "chat_template: 'missing.jinja': no such file"),
        ("chatml", "no such file"),
        ("{% for m in messages %}", "the template does not compile"),
        ("{{ messages | no_such_filter }}", "the template does not compile"),
        ("   ", "chat_template: expected a template file or the template text"),
    ]
    for value, words in cases:
        with pytest.raises(ChatTemplateError, match=re.escape(words)):
            read_chat_template(value)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if x %}\nno end")
    with pytest.raises(ChatTemplateError, match=rf"chat_template: {re.escape(str(broken))}: "
                                                r"the template does not compile \(line 2\)"):
        read_chat_template(str(broken))
    (tmp_path / "empty.jinja").write_text("")
    with pytest.raises(ChatTemplateError, match="empty template"):
        read_chat_template(str(tmp_path / "empty.jinja"))


def test_serve_refuses_a_bad_template_at_start_up(model_dir: str, tmp_path: Path) -> None:
    """Exit 2 naming the option before the model is loaded: a flag and the worker YAML key."""
    worker_yaml = tmp_path / "w.yaml"
    worker_yaml.write_text(yaml.safe_dump({"chat_template": "{% if %}"}))
    cases = [(["--chat-template", "no/such/file.jinja"], "no such file"),
             (["--config", str(worker_yaml)], "does not compile")]
    for args, words in cases:
        w = start_worker_proc(tmp_path, model_dir, "bad", args, {}, port=free_port())
        try:
            assert w.proc.wait(60) == 2
        finally:
            stop_all([w])
        log = w.log.read_text()
        assert "disagg serve: error: chat_template:" in log and words in log, log
        assert "loading" not in log, log


@pytest.fixture(scope="module")
def template_worker(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``disagg serve --chat-template FILE`` (a subprocess: the flag's whole way)."""
    tmp = tmp_path_factory.mktemp("template-worker")
    (tmp / "marked.jinja").write_text(MARKED)
    w = start_worker_proc(tmp, model_dir, "marked", [
        "--chat-template", str(tmp / "marked.jinja"), "--served-model-name", "tiny",
        "--kv-cache-tokens", "2048", "--max-model-len", "256", "--log-level", "info"], {})
    try:
        wait_all_healthy([w], 120.0)
        yield w.url
    finally:
        stop_all([w])


def test_worker_renders_with_the_option(template_worker: str, model_dir: str) -> None:
    tok = load_tokenizer(model_dir)
    assert tok.chat_template != MARKED  # the checkpoint's own template is another one
    want = tok.encode(marked(MESSAGES), add_special_tokens=False)
    r = httpx.post(template_worker + "/tokenize", timeout=30,
                   json={"model": "tiny", "messages": MESSAGES})
    assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    r = httpx.post(template_worker + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text


# ---- the router renders as its workers do ---------------------------------------------------


def _kv_aware(model_dir: str, **section: Any) -> dict[str, Any]:
    return {"model": model_dir, "generation_servers": {
        "urls": ["127.0.0.1:9"], "router": {"type": "kv_cache_aware"}, **section}}


def _policies() -> MappingProxyType[str, PolicyConfig]:
    return MappingProxyType({r: PolicyConfig("kv_cache_aware") for r in ("context",
                                                                            "generation")})


def test_router_tokenizes_with_the_yaml_template(model_dir: str, tmp_path: Path) -> None:
    f = tmp_path / "marked.jinja"
    f.write_text(MARKED)
    tok = load_tokenizer(model_dir)
    want = tok.encode(marked(MESSAGES), add_special_tokens=False)
    body = {"model": "tiny", "messages": MESSAGES}
    for value in (str(f), MARKED):
        cfg = parse_cluster_config(_kv_aware(model_dir, chat_template=value), "c.yaml")
        tokens = PromptTokens(cfg, _policies(), need_tokens=True)
        assert tokens.tokenizer.chat_template == MARKED
        assert tokens.route_request(CHAT, body).prompt.token_ids == want
        # a worker found later (no model in the YAML) gets the same template
        cfg = parse_cluster_config({"generation_servers": {
            "urls": ["127.0.0.1:9"], "chat_template": value,
            "router": {"type": "kv_cache_aware"}}}, "c.yaml")
        later = PromptTokens(cfg, _policies(), need_tokens=True)
        later._set(model_dir)
        assert later.route_request(CHAT, body).prompt.token_ids == want
    # without one: the checkpoint's
    cfg = parse_cluster_config(_kv_aware(model_dir), "c.yaml")
    own = PromptTokens(cfg, _policies(), need_tokens=True)
    assert own.route_request(CHAT, body).prompt.token_ids != want
    cfg = parse_cluster_config(_kv_aware(model_dir, chat_template="gone.jinja"), "c.yaml")
    with pytest.raises(RouterConfigError,
                       match=r"c.yaml: generation_servers.chat_template: 'gone.jinja'"):
        PromptTokens(cfg, _policies(), need_tokens=True)


# ---- disagg launch and disagg deploy pass it on ----------------------------------------------


def _cluster(gen: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A launch YAML: ``top`` its top-level keys, ``gen`` its generation section's."""
    return {"hostname": "127.0.0.1", "port": 0, **top,
            "generation_servers": {"urls": [f"127.0.0.1:{free_port()}"], **(gen or {})}}


def _launch(tmp_path: Path, data: dict[str, Any], **kw: Any) -> tuple[Any, dict[str, Any]]:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    plan = build_plan(str(path), tmp_path / "logs", **kw)
    return plan, yaml.safe_load((tmp_path / "logs" / "gen0.yaml").read_text())


def test_launch_passes_the_template_on(tmp_path: Path, tiny_llama: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t.jinja").write_text(MARKED)
    monkeypatch.chdir(tmp_path)  # a relative file, as a YAML next to it names it
    _, worker = _launch(tmp_path, _cluster(model=tiny_llama, chat_template="t.jinja"))
    assert worker["chat_template"] == str(tmp_path / "t.jinja")  # absolute for the workers
    _, worker = _launch(tmp_path, _cluster(model=tiny_llama, gen={"chat_template": MARKED}))
    assert worker["chat_template"] == MARKED
    for value, words in (("nope.jinja", "no such file"), ("{% if %}", "does not compile")):
        with pytest.raises(LaunchError, match=rf"chat_template: .*{words}"):
            _launch(tmp_path, _cluster(model=tiny_llama, chat_template=value))


def _fake_smollm2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: str) -> None:
    from disagg.model import gguf

    monkeypatch.setattr(gguf, "fetch_model", lambda name, weights: model_dir)


def test_launch_gives_smollm2_its_tool_template(tmp_path: Path, tiny_llama: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smollm2(monkeypatch, tmp_path, tiny_llama)
    defaults = {"chat_template": SMOLLM2_TOOLS, "tool_call_parser": "hermes"}
    for data, kw in ((_cluster(model="smollm2"), {}),
                     (_cluster(model=tiny_llama), {"model_override": "smollm2"})):
        plan, worker = _launch(tmp_path, data, **kw)
        assert {k: worker[k] for k in defaults} == defaults
        (note,) = [n for n in plan.notes if "chat_template" in n]
        assert "smollm2_tools.jinja" in note and "tool_call_parser hermes" in note
        cluster = yaml.safe_load(plan.cluster_yaml.read_text())  # the router's: the same
        assert cluster["generation_servers"]["chat_template"] == SMOLLM2_TOOLS
    # the YAML's own choice wins: no defaults at all
    for own in ({"tool_call_parser": "llama3_json"}, {"chat_template": MARKED},
                {"gen": {"tool_call_parser": "mistral"}}):
        plan, worker = _launch(tmp_path, _cluster(model="smollm2", **own))
        assert worker.get("chat_template") in (None, MARKED)
        assert worker.get("tool_call_parser") in (None, "llama3_json", "mistral")
        assert not [n for n in plan.notes if "chat_template" in n]
    _, worker = _launch(tmp_path, _cluster(model=tiny_llama))  # another model: nothing
    assert "chat_template" not in worker and "tool_call_parser" not in worker


def test_demo_cluster_gets_the_tool_template(tmp_path: Path, tiny_llama: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``disagg launch`` without -c (the demo's YAML), SmolLM2 chosen."""
    from disagg.launch import demo_config

    _fake_smollm2(monkeypatch, tmp_path, tiny_llama)
    plan = build_plan(None, tmp_path / "logs", raw=demo_config("smollm2"))
    for name in ("ctx0", "gen0"):
        worker = yaml.safe_load((tmp_path / "logs" / f"{name}.yaml").read_text())
        assert worker["chat_template"] == SMOLLM2_TOOLS
        assert worker["tool_call_parser"] == "hermes"
    assert any("smollm2_tools.jinja" in n for n in plan.notes)


def _deploy(tmp_path: Path, data: dict[str, Any], **kw: Any) -> Any:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return deploy_plan(str(path), models_dir="/models", absolute_only=False,
                       minimal_instances="one", **kw)


def test_deploy_puts_the_template_text_into_the_yamls(tmp_path: Path) -> None:
    from disagg.deploy import k8s, slurm
    from disagg.deploy.plan import dump_yaml

    (tmp_path / "t.jinja").write_text(MARKED)
    data = {"port": 8000, "model": "tiny", "chat_template": str(tmp_path / "t.jinja"),
            "context_servers": {"urls": ["h:8001"]},
            "generation_servers": {"urls": ["h:8002"], "router": {"type": "kv_cache_aware"}}}
    plan = _deploy(tmp_path, data)
    for g in plan.groups:
        assert g.options["chat_template"] == MARKED
        assert yaml.safe_load(dump_yaml(g.options))["chat_template"] == MARKED
    router = yaml.safe_load(dump_yaml(plan.router_options))
    assert "chat_template" not in router  # per section, as the workers got it
    for section in ("context_servers", "generation_servers"):
        assert router[section]["chat_template"] == MARKED
    parse_cluster_config(router, "router.yaml")  # the deployed router reads it
    # the rendered files carry the text: the Kubernetes ConfigMap, the Slurm script's heredocs
    out = k8s.write(plan, k8s.K8sOptions(), tmp_path / "k8s", "disagg deploy k8s")
    configmap = next(yaml.safe_load(p.read_text()) for p in out if "config" in p.name)
    assert yaml.safe_load(configmap["data"]["generation.yaml"])["chat_template"] == MARKED
    script = slurm.write(plan, slurm.SlurmOptions(), tmp_path / "job.sbatch",
                         "disagg deploy slurm").read_text()
    heredoc = re.search(r"cat > generation.yaml <<'DISAGG_EOF'\n(.*?)\nDISAGG_EOF", script,
                        re.S)
    assert heredoc and yaml.safe_load(heredoc.group(1))["chat_template"] == MARKED
    with pytest.raises(DeployError, match=r"context_servers.chat_template: .*no such file"):
        _deploy(tmp_path, {**data, "chat_template": "gone.jinja"})


def test_deploy_gives_smollm2_its_tool_template(tmp_path: Path) -> None:
    data = {"port": 8000, "model": "smollm2", "generation_servers": {"urls": ["h:8002"]}}
    (g,) = _deploy(tmp_path, data).groups
    assert g.options["chat_template"] == Path(SMOLLM2_TOOLS).read_text()
    assert g.options["tool_call_parser"] == "hermes"
    (g,) = _deploy(tmp_path, {**data, "tool_call_parser": "llama3_json"}).groups
    assert "chat_template" not in g.options and g.options["tool_call_parser"] == "llama3_json"


# ---- the SmolLM2 tool template ----------------------------------------------------------------


def test_the_template_is_package_data() -> None:
    packaged = importlib.resources.files("disagg.chat_templates") / "smollm2_tools.jinja"
    assert packaged.is_file() and str(packaged) == SMOLLM2_TOOLS
    with open(ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "*.jinja" in data["disagg.chat_templates"]
    assert MODEL_DEFAULTS["smollm2"] == {"chat_template": SMOLLM2_TOOLS,
                                         "tool_call_parser": "hermes"}


@pytest.fixture(scope="module")
def tools_template() -> str:
    return read_chat_template(SMOLLM2_TOOLS)


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Any:
    return load_tokenizer(model_dir)


def render(tok: Any, template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    """As the worker renders a request's messages (protocol.plain_messages first)."""
    plain = P.plain_messages([P.ChatMessage.model_validate(m) for m in messages])
    return tok.apply_chat_template(plain, chat_template=template, **kw)


CALLS = [{"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}},
    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
TOOL_CHAT = [
    {"role": "developer", "content": "Answer with tools."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo,"},
                                 {"type": "text", "text": "and the time?"}]},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "Rainy, 12 C; it is 14:05."},
    {"role": "user", "content": "Thanks"},
]


def test_tool_template_renders_every_message_kind(tok: Any, tools_template: str) -> None:
    text = render(tok, tools_template, TOOL_CHAT, tools=TOOLS)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nAnswer with tools.\n\n")  # the developer's
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.S)
    assert listed and [json.loads(line) for line in listed.group(1).split("\n")] == [
        t["function"] for t in TOOLS]
    assert "<tool_call>" in system and '"arguments"' in system  # the call format, explained
    assert rest == (
        "<|im_start|>user\nWeather in Oslo,\nand the time?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n12 C, rain\n</tool_response>\n"
        "<tool_response>\n14:05\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nRainy, 12 C; it is 14:05.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    # content beside the calls; a missing content; no system message: SmolLM2's default one
    text = render(tok, tools_template, [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "call_1"}], tools=TOOLS, add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(
        "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n\n</tool_response><|im_end|>\n")


def test_tool_calls_parse_back(tok: Any, tools_template: str) -> None:
    """What the template writes for an assistant's calls is what the hermes parser reads
    (the model is shown its own format): same names, same arguments."""
    for calls in (CALLS, CALLS[:1], [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(
                {"city": "Zürich \"old town\"", "days": [1, 2], "unit": None})}}]):
        text = render(tok, tools_template, [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": None, "tool_calls": calls}],
            tools=TOOLS, add_generation_prompt=False)
        turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
        parsed = parse_hermes(turn)
        assert parsed.content == ""
        assert [(c.name, json.loads(c.args), c.complete) for c in parsed.calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"]), True)
            for c in calls]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """SmolLM2's tokenizer (its own chat template); skipped when it cannot be fetched."""
    from disagg.model.gguf import FetchError, GGUFError, fetch_model

    try:
        return load_tokenizer(fetch_model("smollm2"))
    except (FetchError, GGUFError, OSError) as e:
        pytest.skip(f"SmolLM2 cannot be fetched: {e}")


def test_plain_chat_renders_as_smollm2s_own_template(smollm2: Any, tools_template: str) -> None:
    own = smollm2.chat_template
    assert "tool" not in own  # (what this template adds)
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
    ]
    for chat in chats:
        for gen in (True, False):
            for tools in (None, []):
                assert render(smollm2, tools_template, chat, add_generation_prompt=gen,
                              tools=tools) == render(smollm2, own, chat,
                                                     add_generation_prompt=gen), chat


def test_smollm2_answers_tool_requests(smollm2: Any, tools_template: str) -> None:
    """SmolLM2 served with the template and the hermes parser: tool_choice auto, and the
    conversation after a call (an assistant message with null content and tool results,
    which SmolLM2's own template cannot render) are answered."""
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    model_dir = smollm2.name_or_path
    engine = AsyncLLM.from_options(model_dir, kv_cache_tokens=2048, max_model_len=1024)
    settings = ServerSettings(model_dir=model_dir, served_model_name="smollm2",
                              chat_template=tools_template, tool_call_parser="hermes")
    with serve_in_thread(build_app(engine, settings)) as url:
        weather = [{"role": "user", "content": "What is the weather in Oslo?"}]
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "messages": weather, "tools": TOOLS, "max_tokens": 40,
            "temperature": 0})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        for call in message.get("tool_calls") or []:  # whatever it chose, it parses
            assert call["function"]["name"] in ("get_weather", "now")
            json.loads(call["function"]["arguments"])
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "tools": TOOLS, "max_tokens": 16, "temperature": 0,
            "messages": [*weather, {"role": "assistant", "content": None,
                                    "tool_calls": CALLS[:1]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]})
        assert r.status_code == 200, r.text
        with pytest.raises(ChatTemplateError):  # SmolLM2's own: content null breaks it
            smollm2.apply_chat_template([{"role": "assistant", "content": None}, {
                "role": "user", "content": "x"}], chat_template=smollm2.chat_template)
