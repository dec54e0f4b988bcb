"""`--chat-template FILE` (`model.chat_template`): checked when the config loads, used instead of the model's own;
without any template a chat request gets 400 naming the flag, and the server keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvreuse.cli import build_parser
from kvreuse.cli.common import build_config
from kvreuse.config import ConfigError
from kvreuse.engine.front_end import RequestError
from kvreuse.weights.chat_template import NoChatTemplate
from kvreuse.weights.tokenizer import Tokenizer

from .helpers import app_server, make_config, tiny_engine
from .server_process import http_client

TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
            "<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with no chat template in its files, as a base model's."""
    path = tmp_path_factory.mktemp("tiny-base") / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_flag_sets_the_key(command, template_file):
    config = build_config(build_parser().parse_args([command, "--chat-template", str(template_file)]))
    assert config.model.chat_template == str(template_file)


def test_a_template_file_is_checked_when_the_config_loads(tmp_path, template_file):
    assert make_config(model__chat_template=str(template_file)).model.chat_template == str(template_file)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match=r"config key 'model.chat_template': the chat template file .*bad\.jinja is "
                                          r"not a valid Jinja template \(line 1: "):
        make_config(model__chat_template=str(bad))
    with pytest.raises(ConfigError, match=r"'model.chat_template': cannot read the chat template file .*missing"):
        make_config(model__chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(ConfigError, match=r"'model.chat_template': the chat template file .*empty\.jinja is empty"):
        make_config(model__chat_template=str(tmp_path / "empty.jinja"))


def test_the_file_replaces_the_models_own_template(tiny_model_dir, template_file):
    own = Tokenizer.load(Path(tiny_model_dir), "unused")
    given = Tokenizer.load(Path(tiny_model_dir), "unused", template_file)
    assert own.apply_chat_template(MESSAGES) != given.apply_chat_template(MESSAGES)
    assert given.apply_chat_template(MESSAGES) == "<|im_start|>user: Hi there<|im_end|>\n<|im_start|>assistant: "


def test_without_a_template_a_conversation_is_refused_naming_the_flag(base_model_dir, template_file):
    with pytest.raises(NoChatTemplate, match="no chat template"):
        Tokenizer.load(Path(base_model_dir), "unused").apply_chat_template(MESSAGES)
    front = tiny_engine(base_model_dir).front_end
    with pytest.raises(RequestError, match="--chat-template FILE") as refused:
        front.tokenize_chat(MESSAGES)
    assert (refused.value.field, refused.value.code) == ("messages", "no_chat_template")
    given = tiny_engine(base_model_dir, model__chat_template=str(template_file)).front_end
    assert given.tokenize_chat(MESSAGES) == given.tokenizer.encode(given.tokenizer.apply_chat_template(MESSAGES))


def test_the_server_answers_400_without_a_template_and_keeps_serving(base_model_dir):
    with app_server(tiny_engine(base_model_dir)) as (_, root), http_client(30.0) as http:
        chat = http.post(f"{root}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
        assert chat.status_code == 400, chat.text
        error = chat.json()["error"]
        assert "no chat template" in error["message"] and "--chat-template FILE" in error["message"]
        assert (error["param"], error["code"], error["type"]) == ("messages", "no_chat_template",
                                                                  "invalid_request_error")
        tokenize = http.post(f"{root}/tokenize", json={"model": "tiny", "messages": MESSAGES})
        assert tokenize.status_code == 400 and "--chat-template" in tokenize.text
        completion = http.post(f"{root}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text


def test_the_server_chats_with_a_template_file_and_refuses_what_it_raises_on(base_model_dir, template_file):
    engine = tiny_engine(base_model_dir, model__chat_template=str(template_file))
    with app_server(engine) as (_, root), http_client(30.0) as http:
        chat = http.post(f"{root}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                              "ignore_eos": True})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2, chat.text
        system = [{"role": "system", "content": "Be brief"}, *MESSAGES]
        refused = http.post(f"{root}/v1/chat/completions", json={"model": "tiny", "messages": system, "max_tokens": 2})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "messages"
        assert "the chat template refused the conversation: no system role here" in refused.json()["error"]["message"]


# A template that loads another one cannot render in the sandbox (it has none to load): refused by name, not a 500.
LOADING = {"include": "{% include 'header.jinja' %}", "import": "{% import 'macros.jinja' as m %}",
           "from ... import": "{% from 'macros.jinja' import turn %}", "extends": "{% extends 'base.jinja' %}"}


@pytest.mark.parametrize("tag", list(LOADING))
def test_a_template_file_that_loads_another_is_refused_when_the_config_loads(tmp_path, tag):
    path = tmp_path / "loads.jinja"
    path.write_text("{# the header #}\n" + LOADING[tag] + TEMPLATE)
    with pytest.raises(ConfigError, match=rf"'model.chat_template': the chat template file .*loads\.jinja uses "
                                          rf"\{{% {tag} %\}} on line 2, which kvreuse cannot render: a chat template "
                                          rf"must be self-contained"):
        make_config(model__chat_template=str(path))


@pytest.mark.parametrize("tag", list(LOADING))
def test_the_server_answers_400_to_a_models_own_template_that_loads_another(tmp_path, base_model_dir, tag):
    path = tmp_path / "model"
    shutil.copytree(base_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LOADING[tag] + TEMPLATE}))
    with app_server(tiny_engine(str(path))) as (_, root), http_client(30.0) as http:
        for route in ("/v1/chat/completions", "/tokenize"):
            refused = http.post(f"{root}{route}", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["param"], error["code"]) == ("messages", "unsupported_chat_template")
            assert error["message"].startswith(f"messages: the chat template uses {{% {tag} %}} on line 1, which "
                                               f"kvreuse cannot render")
        completion = http.post(f"{root}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
