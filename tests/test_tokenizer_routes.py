"""Tokenizer discovery for outside clients (lm-evaluation-harness, guidellm, inference-perf): `GET /v1/models/{id}`,
`GET /tokenizer_info`, `/tokenize`'s vLLM fields, and `kvreuse tokenizer export DIR`.

One `kvreuse serve` subprocess of the tiny random-weight model (with the real SmolLM2 tokenizer) behind API keys,
under a model id holding a slash, as Hugging Face ids do. The export runs on the embedded model's GGUF without
loading its weights (the conftest guard fails any test here that would).
"""

from __future__ import annotations

import copy

import httpx
import jinja2
import openai
import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from kvreuse.cli import main
from kvreuse.weights.tokenizer import Tokenizer

from .helpers import server_args
from .server_process import Server, http_client, start_server

MODEL_ID = "acme/tiny-llama"
KEY = "key-tok-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! Ünïcødé 東京"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]

# Special-token text, partial markers, non-ASCII scripts, emoji sequences, combining marks, whitespace runs,
# control characters, code and a long run.
VARIED = [
    "", "Hello, world!", "   leading and trailing spaces   ", "tabs\t\tand\nnew\n\nlines\r\n",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>",
    "text<|im_end|>more<repo_name>x<file_sep>", "<|im_start", "<|IM_END|> is not special", "Ünïcødé ﬁ ligature",
    "e\u0301 combining vs \u00e9 precomposed", "東京タワーは高い。", "Здравствуйте, мир", "مرحبا بالعالم",
    "🚀 👩‍👩‍👧 🇫🇷", "\x01\x07\x7f control bytes", "def f(x):\n    return x ** 2  # code",
    "1234567890 3.14159 -0.5e10", "\u00a0non-breaking\u2009thin\u3000ideographic spaces", "ab" * 400,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("tokenizer-routes")
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY} alpha\n")
    with start_server(*server_args(tiny_model_dir), "--served-model-name", MODEL_ID,
                      "--api-keys", str(keys), log_path=tmp / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def http():
    with http_client(60.0, headers=AUTH) as client:
        yield client


def tokenize(http: httpx.Client, server: Server, **body) -> dict:
    r = http.post(f"{server.root}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(response: httpx.Response, status: int, needle: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
    return error


# --- /v1/models/{model_id} ---------------------------------------------------------------------------------------
def test_model_retrieve_is_the_list_entry_and_takes_slashes(server, http):
    listed = http.get(f"{server.base_url}/models").json()["data"]
    r = http.get(f"{server.base_url}/models/{MODEL_ID}")
    assert r.status_code == 200, r.text
    assert [r.json()] == listed and listed[0]["id"] == MODEL_ID and listed[0]["max_model_len"] == 2048
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0,
                           http_client=openai.DefaultHttpxClient(trust_env=False))
    model = client.models.retrieve(MODEL_ID)
    assert (model.id, model.owned_by, model.object) == (MODEL_ID, "kvreuse", "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("acme/other")


@pytest.mark.parametrize("model_id", ["acme", "acme/tiny-llama/extra", "other", "ACME/TINY-LLAMA"])
def test_model_retrieve_of_another_id_is_a_404_in_openais_shape(server, http, model_id):
    error = assert_error(http.get(f"{server.base_url}/models/{model_id}"), 404, repr(model_id))
    assert (error["param"], error["code"]) == ("model", "model_not_found")


# --- /tokenizer_info ---------------------------------------------------------------------------------------------
def test_tokenizer_info_has_what_vllm_and_lm_eval_read(server, http, real_tokenizer):
    r = http.get(f"{server.root}/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    hf = real_tokenizer.hf
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == (
        hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>",
                                                                    "<|endoftext|>")
    assert info["model_max_length"] == tokenize(http, server, prompt="x")["max_model_len"] == 2048
    assert info["chat_template"] == hf.chat_template
    # vLLM's form: id (a JSON key) -> the token's text.
    assert info["added_tokens_decoder"] == {str(i): t.content for i, t in hf.added_tokens_decoder.items()}
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>"
    assert info["name_or_path"] == MODEL_ID


def test_tokenizer_info_chat_template_renders_like_ours(server, http, real_tokenizer):
    """Rendered as lm-eval's remote tokenizer renders it (plain jinja2, StrictUndefined), it is our prompt."""
    template = http.get(f"{server.root}/tokenizer_info").json()["chat_template"]
    env = jinja2.Environment(loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    for messages in (MESSAGES, MESSAGES[1:2]):
        rendered = env.from_string(template).render(messages=messages, add_generation_prompt=True)
        assert rendered == real_tokenizer.apply_chat_template(messages)
        assert tokenize(http, server, messages=messages)["tokens"] == real_tokenizer.encode(rendered)


def test_lm_eval_remote_tokenizer_calls(server, http, real_tokenizer):
    """What lm-eval's RemoteTokenizer does: eos/bos ids as the first token of their text under
    add_special_tokens=false, encode without additions, decode through /detokenize."""
    info = http.get(f"{server.root}/tokenizer_info").json()
    assert tokenize(http, server, prompt=info["eos_token"], add_special_tokens=False)["tokens"] == [2]
    assert tokenize(http, server, prompt=info["bos_token"], add_special_tokens=False)["tokens"] == [1]
    text = "Question: what is 2+2?\nAnswer: 4<|im_end|>"
    tokens = tokenize(http, server, prompt=text, add_special_tokens=False)["tokens"]
    assert tokens == real_tokenizer.encode(text)
    assert http.post(f"{server.root}/detokenize", json={"tokens": tokens}).json() == {"prompt": text}


def test_tokenizer_routes_need_the_key(server):
    with http_client(10.0) as anonymous:
        for method, path in (("GET", "/tokenizer_info"), ("GET", f"/v1/models/{MODEL_ID}"), ("GET", "/v1/models"),
                             ("POST", "/tokenize")):
            r = anonymous.request(method, f"{server.root}{path}", json={"prompt": "hi"})
            assert_error(r, 401, "API key")
        wrong = anonymous.get(f"{server.root}/tokenizer_info", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, "API key")


# --- /tokenize: add_special_tokens, return_token_strs --------------------------------------------------------------
def test_tokenize_add_special_tokens_and_token_strs(server, http, real_tokenizer):
    text = "<|im_start|>Paged attention 東京 🚀"
    default = tokenize(http, server, prompt=text)
    assert default["tokens"] == real_tokenizer.encode(text) and default["token_strs"] is None
    # SmolLM2's post-processing adds no BOS/EOS, so both settings give the same tokens, special tokens included.
    for add in (True, False):
        body = tokenize(http, server, prompt=text, add_special_tokens=add, return_token_strs=True)
        assert body["tokens"] == default["tokens"] and body["count"] == len(body["tokens"])
        assert body["token_strs"] == real_tokenizer.hf.convert_ids_to_tokens(body["tokens"])
        assert body["token_strs"][0] == "<|im_start|>"
    chat = tokenize(http, server, messages=MESSAGES)
    for add in (True, False):
        assert tokenize(http, server, messages=MESSAGES, add_special_tokens=add)["tokens"] == chat["tokens"]
    r = http.post(f"{server.root}/tokenize", json={"prompt": "x", "add_special_tokens": "sometimes"})
    assert_error(r, 400, "add_special_tokens")


@pytest.fixture(scope="module")
def bos_eos_tokenizer(real_tokenizer) -> Tokenizer:
    """The SmolLM2 tokenizer with post-processing that wraps a text in <|endoftext|> ... <|im_end|>, as a Llama-style
    tokenizer adds a BOS (and some an EOS)."""
    hf = copy.deepcopy(real_tokenizer.hf)
    hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>", special_tokens=[("<|endoftext|>", 0), ("<|im_end|>", 2)])
    return Tokenizer(hf)


def test_without_additions_is_add_special_tokens_false(bos_eos_tokenizer):
    assert bos_eos_tokenizer.post_processor_additions() == ([0], [2])
    backend = bos_eos_tokenizer.hf.backend_tokenizer
    for text in ("plain text", "<|endoftext|>starts with the BOS text", "ends with the EOS text<|im_end|>", ""):
        with_additions = bos_eos_tokenizer.encode(text)
        assert with_additions[0] == 0 and with_additions[-1] == 2
        assert bos_eos_tokenizer.without_additions(with_additions) == backend.encode(text,
                                                                                     add_special_tokens=False).ids
    # Chat tokens are the template's alone, as HF and vLLM tokenize a conversation: no BOS or EOS added.
    rendered = bos_eos_tokenizer.render_chat(MESSAGES)
    assert bos_eos_tokenizer.encode_chat(rendered) == backend.encode(rendered.text, add_special_tokens=False).ids


def test_real_tokenizer_adds_nothing(real_tokenizer):
    assert real_tokenizer.post_processor_additions() == ([], [])
    assert real_tokenizer.without_additions([1, 2, 3]) == [1, 2, 3]


# --- kvreuse tokenizer export ---------------------------------------------------------------------------------------
def assert_same_tokenizer(directory, ours: Tokenizer) -> None:
    theirs = AutoTokenizer.from_pretrained(str(directory))
    for text in VARIED:
        assert theirs.encode(text) == ours.encode(text), text
        assert theirs(text)["input_ids"] == ours.encode(text), text
        assert theirs.decode(ours.encode(text)) == ours.decode(ours.encode(text), False), text
    assert theirs.chat_template == ours.hf.chat_template
    assert theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(MESSAGES)
    assert (theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.unk_token) == (
        ours.hf.bos_token, ours.hf.eos_token, ours.hf.pad_token, ours.hf.unk_token)
    assert theirs.eos_token_id in ours.eos_token_ids and len(theirs) == len(ours.hf)


def test_export_round_trip_of_the_embedded_model(tmp_path, real_tokenizer, capsys):
    out = tmp_path / "exported"
    assert main(["tokenizer", "export", str(out)]) == 0
    assert "tokenizer_config.json" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert '"chat_template"' in (out / "tokenizer_config.json").read_text()
    assert AutoTokenizer.from_pretrained(str(out)).model_max_length == 2048  # what `kvreuse serve` reports
    assert_same_tokenizer(out, real_tokenizer)


def test_export_keeps_bos_eos_post_processing(tmp_path, bos_eos_tokenizer):
    bos_eos_tokenizer.export(tmp_path, 4096)
    assert_same_tokenizer(tmp_path, bos_eos_tokenizer)
    ids = AutoTokenizer.from_pretrained(str(tmp_path)).encode("hi")
    assert (ids[0], ids[-1]) == (0, 2)


def test_export_refuses_a_non_empty_dir_unless_forced(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["tokenizer", "export", str(out), "--model", tiny_model_dir]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not empty" in err and "--force" in err
    assert main(["tokenizer", "export", str(out), "--model", tiny_model_dir, "--force", "--max-model-len", "512"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert AutoTokenizer.from_pretrained(str(out)).model_max_length == 512
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["tokenizer", "export", str(a_file)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["tokenizer", "export", str(tmp_path / "new"), "--model", str(tmp_path / "nope.gguf")]) == 1
