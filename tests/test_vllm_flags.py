"""`metrale serve`'s flags as vLLM users type them: --served-model-name, --chat-template, --generation-config,
--version, -h, and help text on every option of every command. The HTTP ones run on a real frontend with a fake
engine core (test_frontend_server)."""

from __future__ import annotations

import json
import shutil

import click
import pytest
from click.testing import CliRunner

from metrale.cli import main
from metrale.config import EngineArgs, ServeConfig
from metrale.frontend.chat import ChatTemplate, ChatTemplateError, chat_template_source
from metrale.frontend.client import Client
from metrale.model_facts import ModelError, generation_defaults
from metrale.supervisor import StartupError, Supervisor

from test_api_key import http
from test_frontend_server import WAIT_S, running_stack

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
GENERATION = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
              "eos_token_id": 2}


def commands(group: click.Group, path: str = "metrale"):
    """Every (path, command) under group, group included."""
    yield path, group
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, f"{path} {name}")
        else:
            yield f"{path} {name}", cmd


def test_every_option_has_help():
    missing = [f"{path} {opt.opts[0]}" for path, cmd in commands(main) for opt in cmd.params
               if isinstance(opt, click.Option) and not (opt.help or "").strip()]
    assert missing == [], f"options without help text: {missing}"
    assert {path for path, _ in commands(main)} >= {"metrale serve", "metrale worker kill", "metrale status"}


def test_version_and_dash_h():
    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and out.output.startswith("metrale, version ")
    for args in (["-h"], ["serve", "-h"], ["worker", "kill", "-h"]):
        out = CliRunner().invoke(main, args)
        assert out.exit_code == 0 and "Usage:" in out.output, args
    serve_help = CliRunner().invoke(main, ["serve", "-h"]).output
    for flag in ("--served-model-name", "--chat-template", "--generation-config", "--api-key", "--max-model-len",
                 "--disable-log-requests", "--enable-admin"):
        assert flag in serve_help


def test_served_model_names_are_what_models_lists_and_requests_name(tiny_model_dir):
    with running_stack(tiny_model_dir("llama"), served_model_names=["alpha", "beta"], http_port=0) as s:
        base = s.server.http_endpoint
        status, models = http(base + "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["alpha", "beta"]
        for name in ("alpha", "beta", None):
            body = {"prompt": "Once", "max_tokens": 2, "temperature": 0, **({"model": name} if name else {})}
            status, reply = http(base + "/v1/completions", body)
            assert status == 200 and reply["model"] == "alpha", name
        folder = tiny_model_dir("llama")
        for other in (folder.name, str(folder), "gamma"):
            status, reply = http(base + "/v1/completions", {"prompt": "Once", "max_tokens": 2, "model": other})
            assert status == 404 and reply["error"]["code"] == "model_not_found", other
        assert s.client.model_info().model == "alpha"


def test_without_served_names_the_folder_name_and_path_are_accepted(tiny_model_dir):
    folder = tiny_model_dir("llama")
    with running_stack(folder, http_port=0) as s:
        for name in (folder.name, str(folder)):
            status, _ = http(s.server.http_endpoint + "/v1/completions", {"prompt": "Once", "max_tokens": 2, "model": name})
            assert status == 200, name


@pytest.mark.parametrize("as_file", [False, True])
def test_chat_template_from_a_file_or_inline_renders_every_chat(tiny_model_dir, tmp_path, as_file):
    value = TEMPLATE
    if as_file:
        value = str(tmp_path / "t.jinja")
        (tmp_path / "t.jinja").write_text(TEMPLATE)
    with running_stack(tiny_model_dir("llama"), chat_template=value, http_port=0) as s:
        messages = [{"role": "user", "content": "Hi there"}]
        status, reply = http(s.server.http_endpoint + "/v1/chat/completions",
                             {"messages": messages, "max_tokens": 2, "temperature": 0})
        assert status == 200, reply
        prompt = ChatTemplate.from_source(TEMPLATE).render(messages)
        assert prompt == "[user] Hi there\n[assistant]"
        assert s.engine.add_for_prompt(s.tok.encode(prompt, add_special_tokens=False)) is not None
        assert s.client.model_info().chat_template == TEMPLATE


def test_a_bad_chat_template_is_a_start_up_error(tiny_model_dir, tmp_path):
    with pytest.raises(ChatTemplateError, match="no such file"):
        chat_template_source(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        chat_template_source("{% for m in messages %}")
    config = ServeConfig(engine=EngineArgs(model=str(tiny_model_dir("llama"))), chat_template="nope.jinja")
    with pytest.raises(StartupError, match="--chat-template"):
        Supervisor(config)


@pytest.fixture
def model_with_generation_config(tiny_model_dir, tmp_path):
    folder = tmp_path / "with-generation"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return folder


def test_generation_config_sources(model_with_generation_config, tiny_model_dir, tmp_path):
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    assert generation_defaults(model_with_generation_config) == want
    assert generation_defaults(model_with_generation_config, "vllm") == {}
    assert generation_defaults(tiny_model_dir("llama"), str(model_with_generation_config)) == want
    with pytest.raises(ModelError, match="no generation_config.json"):
        generation_defaults(model_with_generation_config, str(tmp_path / "nowhere"))


@pytest.mark.parametrize("source", ["auto", "vllm"])
def test_generation_config_defaults_what_an_http_request_leaves_out(model_with_generation_config, source):
    with running_stack(model_with_generation_config, generation_config=source, http_port=0) as s:
        url = s.server.http_endpoint + "/v1/completions"
        assert http(url, {"prompt": "Once upon", "max_tokens": 2})[0] == 200
        assert http(url, {"prompt": "Once upon a", "max_tokens": 2, "temperature": 0.0, "top_k": 5})[0] == 200
        left_out = s.engine.add_for_prompt(s.tok.encode("Once upon")).params
        given = s.engine.add_for_prompt(s.tok.encode("Once upon a")).params
    if source == "auto":
        assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.6, 0.9, 20, 1.05)
        assert (given.temperature, given.top_k, given.top_p) == (0.0, 5, 0.9), "what a request gives wins"
    else:
        assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (1.0, 1.0, 0, 1.0)
