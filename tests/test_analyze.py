"""`kvreuse analyze`: it finds planted dynamic fields, and its predicted hit rate is what the engine measures."""

from __future__ import annotations

import json
import random

import pytest

from kvreuse.analyze import analyze, find_dynamic_fields
from kvreuse.cli import main
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

from .conftest import make_config

POLICY = "Policy: be polite, be brief, never promise refunds, and escalate every legal question. " * 5
QUESTIONS = ["Where is my order?", "How do I reset my password?", "Can I get a refund?", "Do you ship abroad?"]


def support_log(num: int, dynamic_first: bool, seed: int = 0) -> list[list[dict]]:
    """Support chats whose system prompt carries a timestamp and a user id, at its head or at its tail."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(num):
        stamp = f"[2026-11-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z] " \
                f"user_id={rng.randint(10000, 99999)}"
        system = f"{stamp}\nYou are the support assistant of ACME.\n{POLICY}" if dynamic_first \
            else f"You are the support assistant of ACME.\n{POLICY}\n{stamp}"
        question = rng.choice(QUESTIONS)
        conversations.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
    return conversations


def test_finds_the_planted_timestamp_and_user_id_and_advises_moving_them(tiny_model_dir):
    report = analyze(support_log(10, dynamic_first=True), make_config(model__path=tiny_model_dir))
    fields = {f["field"]: f for f in report["dynamic_fields"]}
    assert {"timestamp", "id"} <= set(fields)
    assert fields["timestamp"]["distinct_values"] == 10 and fields["timestamp"]["median_position"] < 0.1
    assert fields["id"]["examples"][0].startswith("user_id=")
    assert "number" not in fields  # the digits inside the timestamp and id are not reported twice
    assert report["hit_rate"] < 0.1
    assert any("Move them to the tail" in tip for tip in report["advice"])
    assert report["median_divergence_fraction"] < 0.1


@pytest.mark.parametrize(("dynamic_first", "block_size"), [(False, 16), (True, 8)])
def test_predicted_hit_rate_matches_what_the_engine_measures(tiny_model_dir, dynamic_first, block_size):
    log = support_log(12, dynamic_first)
    config = make_config(model__path=tiny_model_dir, cache__block_size=block_size, engine__num_kv_blocks=512)
    predicted = analyze(log, config)["hit_rate"]
    llm = LLM(config)
    for messages in log:
        llm.chat(messages, SamplingParams(max_tokens=1))
    measured = llm.engine.stats.reuse.hit_rate
    assert abs(predicted - measured) <= 0.03, (predicted, measured)
    if not dynamic_first:
        assert predicted > 0.5


def test_normalize_gain_is_reported(tiny_model_dir):
    # Every prompt spells the same instruction differently: full-width letters, runs of spaces, CRLF.
    spellings = ["Ｐｌｅａｓｅ" if i % 2 else "Please" for i in range(8)]
    log = [[{"role": "user", "content": f"{spellings[i]}{' ' * (i + 1)}summarise:\r\n{POLICY} Ticket {i}."}]
           for i in range(8)]
    report = analyze(log, make_config(model__path=tiny_model_dir))
    assert report["hit_rate_normalized"] > report["hit_rate_raw"] + 0.2
    assert any("normalize_input = true" in tip for tip in report["advice"])


def test_number_kinds_do_not_double_count():
    fields = find_dynamic_fields(["at 2026-01-02T03:04:05Z id 123456", "at 2026-02-03T04:05:06Z id 654321"])
    kinds = {f["field"]: f["distinct_values"] for f in fields}
    assert kinds == {"timestamp": 2, "number": 2}


def test_cli_json_and_bad_input(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m}) for m in support_log(4, dynamic_first=True)) + "\n")
    assert main(["analyze", str(path), "--model", tiny_model_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 4 and report["advice"]
    path.write_text('{"prompt": 3}\n')
    assert main(["analyze", str(path), "--model", tiny_model_dir]) == 2
    assert "line 1" in capsys.readouterr().err
