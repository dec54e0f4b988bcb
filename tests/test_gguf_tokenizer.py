"""A GGUF's tokenizer, converted from gguf_metadata's fields, is the one transformers' AutoTokenizer converts
(token for token), and is converted once per fingerprint."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from kvreuse.weights import gguf_tokenizer
from kvreuse.weights.gguf_tokenizer import SPECIAL_TOKENS, cache_dir, convert_gguf, load_gguf_tokenizer
from kvreuse.weights.loader import embedded_model_path
from kvreuse.weights.named_models import resolve_named_model
from kvreuse.weights.tokenizer import Tokenizer

TEXTS = ["Hello world", "héllo 日本語 🙂 naïve café", "  two leading spaces\n\ttab\r\nCRLF", "12345 3.14159 1e-6",
         "", "a" * 300, "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos>",
         "<think>x</think>", "   ", "\u2581word"]


def assert_same_as_auto_tokenizer(path):
    ours = convert_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert {name: getattr(ours, name) for name in SPECIAL_TOKENS} == \
        {name: getattr(theirs, name) for name in SPECIAL_TOKENS}
    assert ours.chat_template == theirs.chat_template
    assert len(ours) == len(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text


@pytest.mark.slow  # AutoTokenizer's side reads the metadata with GGUFReader: ~5 s
def test_the_embedded_models_tokenizer_is_transformers_conversion():
    assert_same_as_auto_tokenizer(embedded_model_path())


@pytest.mark.slow  # AutoTokenizer's side takes ~15 s on the 262k-token vocabulary
def test_gemma3s_tokenizer_is_transformers_conversion():
    assert_same_as_auto_tokenizer(resolve_named_model("gemma3-270m"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    return cache_dir("f" * 64)


def test_a_converted_tokenizer_is_cached_and_loads_as_converted(cache, monkeypatch):
    path = embedded_model_path()
    first = load_gguf_tokenizer(path, "f" * 64)
    assert (cache / "tokenizer.json").is_file() and "transformers" in cache.name
    monkeypatch.setattr(gguf_tokenizer, "convert_gguf", lambda path: pytest.fail("converted again"))
    second = load_gguf_tokenizer(path, "f" * 64)
    assert second.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    assert second.chat_template == first.chat_template and second.chat_template
    assert {name: getattr(second, name) for name in SPECIAL_TOKENS} == \
        {name: getattr(first, name) for name in SPECIAL_TOKENS}
    assert [second.encode(t) for t in TEXTS] == [first.encode(t) for t in TEXTS]


def test_a_corrupt_cache_is_converted_again(cache, caplog):
    path = embedded_model_path()
    expected = load_gguf_tokenizer(path, "f" * 64).backend_tokenizer.to_str()
    (cache / "tokenizer.json").write_text("{not json")
    assert load_gguf_tokenizer(path, "f" * 64).backend_tokenizer.to_str() == expected
    assert "ignoring tokenizer cache" in caplog.text
    assert json.loads((cache / "tokenizer.json").read_text())  # rewritten


def test_tokenizer_load_uses_the_cache_and_a_template_file(cache, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    tokenizer = Tokenizer.load(embedded_model_path(), "f" * 64, template)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
    assert Tokenizer.load(embedded_model_path(), "f" * 64).hf.chat_template != tokenizer.hf.chat_template


def test_what_is_computed_from_the_whole_vocabulary_is_kept_beside_the_cache(cache):
    computed = Tokenizer.load(embedded_model_path(), "f" * 64).max_token_chars
    facts = cache / "facts.json"
    assert json.loads(facts.read_text()) == {"max_token_chars": computed} and computed > 1
    facts.write_text(json.dumps({"max_token_chars": computed + 7}))  # read back, not computed again
    assert Tokenizer.load(embedded_model_path(), "f" * 64).max_token_chars == computed + 7
    facts.write_text("{not json")  # computed again and rewritten
    assert Tokenizer.load(embedded_model_path(), "f" * 64).max_token_chars == computed
    assert json.loads(facts.read_text()) == {"max_token_chars": computed}
