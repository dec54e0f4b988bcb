"""The command line's parser, config building and prompt files; nothing here loads a model."""

from __future__ import annotations

import json

import pytest

from kvreuse.bench.commands import scenario_config
from kvreuse.bench.engine_bench import Target
from kvreuse.bench.engine_sizes import Sizes
from kvreuse.bench.fidelity import fidelity_config
from kvreuse.cli import build_config, build_parser, config_overrides, main
from kvreuse.prompts_file import PromptRecord, PromptsFileError, read_prompts_file


def usage_error(argv: list[str], capsys) -> str:
    """argparse's message for `argv`, which must exit with code 2."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# --- bench subcommands: each takes only its own flags --------------------------------------------------------------
def test_bench_needs_a_known_subcommand(capsys):
    assert "required: SUITE" in usage_error(["bench"], capsys)
    assert "invalid choice: 'url'" in usage_error(["bench", "url"], capsys)


@pytest.mark.parametrize("argv,flag", [
    (["bench", "engine", "--url", "http://x"], "--url"),
    (["bench", "engine", "--preset", "chat"], "--preset"),
    (["bench", "prefix", "--no-bf16"], "--no-bf16"),
    (["bench", "replay", "http://x", "--quick"], "--quick"),
    (["bench", "replay", "http://x", "--set", "cache.block_size=8"], "--set"),
    # "=": a value given apart would be taken for a SCENARIO name (argparse's rule for unknown options).
    (["bench", "scenario", "--request-rate=2"], "--request-rate"),
    (["bench", "scenario", "chat", "--repeats=2"], "--repeats"),
])
def test_a_flag_of_another_subcommand_is_rejected(argv, flag, capsys):
    assert f"unrecognized arguments: {flag}" in usage_error(argv, capsys)


def test_bench_scenario_names_and_counts_are_checked(capsys):
    assert "invalid choice: 'chatt'" in usage_error(["bench", "scenario", "chatt"], capsys)
    assert "argument --concurrency: expected an integer >= 1, got '0'" in usage_error(
        ["bench", "scenario", "--concurrency", "0"], capsys)
    assert "the following arguments are required: URL" in usage_error(["bench", "replay"], capsys)


def test_bench_parses_each_subcommand():
    parse = build_parser().parse_args
    scenario = parse(["bench", "scenario", "eval", "chat", "--quick", "--preset", "rag", "--no-peers"])
    assert (scenario.scenarios, scenario.quick, scenario.preset, scenario.no_peers) == (["eval", "chat"], True,
                                                                                        "rag", True)
    assert parse(["bench", "scenario"]).scenarios == []  # all of them
    replay = parse(["bench", "replay", "http://h:1", "agent", "--request-rate", "2.5", "--api-key", "k"])
    assert (replay.url, replay.scenarios, replay.request_rate, replay.api_key, replay.requests) == (
        "http://h:1", ["agent"], 2.5, "k", 24)
    assert parse(["bench", "engine", "--no-bf16", "--repeats", "2"]).no_bf16
    assert parse(["bench", "prefix", "--out", "d"]).out == "d"


def test_fidelity_takes_the_common_flags_with_its_own_settings_between_file_and_flags(tmp_path):
    path = tmp_path / "f.ini"
    path.write_text("[cache]\nblock_size = 32\nsuffix.enabled = false\n[model]\ndtype = bf16\n")
    args = build_parser().parse_args(["fidelity", "--config", str(path), "--block-size", "8", "--set",
                                      "cache.suffix.recompute_ratio=0.3", "--log-level", "INFO"])
    assert config_overrides(args) == ["cache.suffix.recompute_ratio=0.3", "cache.block_size=8"]
    config = fidelity_config(config_overrides(args), args.config)
    # fidelity turns segment reuse on and pins fp32 over the file; the flags win over both.
    assert config.cache.suffix.enabled and config.model.dtype == "fp32"
    assert (config.cache.block_size, config.cache.suffix.recompute_ratio) == (8, 0.3)


# --- shorthand flags: flag > --set > file > defaults ---------------------------------------------------------------
@pytest.fixture
def ini(tmp_path) -> str:
    path = tmp_path / "kvreuse.ini"
    path.write_text("[cache]\nblock_size = 8\n[server]\nport = 9001\nhost = 0.0.0.0\n")
    return str(path)


def config_of(argv: list[str]):
    return build_config(build_parser().parse_args(argv))


@pytest.mark.parametrize("command", [["generate"], ["analyze", "log.jsonl"], ["bench", "scenario"]])
def test_block_size_precedence(command, ini):
    assert config_of(command).cache.block_size == 16
    assert config_of([*command, "--config", ini]).cache.block_size == 8
    assert config_of([*command, "--config", ini, "--set", "cache.block_size=32"]).cache.block_size == 32
    flagged = [*command, "--config", ini, "--set", "cache.block_size=32", "--block-size", "64"]
    assert config_of(flagged).cache.block_size == 64


def test_serve_shorthands_precedence(ini, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-1 alice\n")
    config = config_of(["serve", "--config", ini, "--set", "server.port=9002", "--api-keys", str(keys)])
    assert (config.server.port, config.server.host, config.server.api_keys_file) == (9002, "0.0.0.0", str(keys))
    config = config_of(["serve", "--config", ini, "--set", "server.port=9002", "--port", "9003", "--host", "::1"])
    assert (config.server.port, config.server.host) == (9003, "::1")
    config = config_of(["serve", "--set", "model.served_name=a", "--served-model-name", "acme/b"])
    assert config.model.served_name == "acme/b"


def test_every_shorthand_maps_to_its_key():
    config = config_of(["serve", "--model", "m.gguf", "--device", "cpu", "--dtype", "bf16", "--max-model-len", "512",
                        "--no-enable-prefix-caching", "--preset", "eval"])
    assert (config.model.path, config.model.device, config.model.dtype) == ("m.gguf", "cpu", "bf16")
    assert (config.server.max_tokens, config.cache.enabled, config.cache.preset) == (512, False, "eval")
    assert config.cache.policy == "learned"  # from the preset


def test_building_the_config_leaves_the_arguments_alone():
    args = build_parser().parse_args(["serve", "--port", "9003", "--set", "cache.block_size=32"])
    assert config_overrides(args) == config_overrides(args) == ["cache.block_size=32", "server.port=9003"]
    assert args.overrides == ["cache.block_size=32"]


def test_scenario_config_takes_the_scenario_preset_unless_one_is_chosen(ini):
    args = build_parser().parse_args(["bench", "scenario"])
    assert scenario_config("eval", None, config_overrides(args)).cache.block_size == 32  # the eval preset
    assert scenario_config("prefix", None, config_overrides(args)).cache.preset == "none"
    chosen = build_parser().parse_args(["bench", "scenario", "--preset", "chat"])
    assert scenario_config("eval", None, config_overrides(chosen)).cache.block_size == 16  # chat's, not eval's
    explicit = build_parser().parse_args(["bench", "scenario", "--block-size", "64"])
    assert scenario_config("eval", ini, config_overrides(explicit)).cache.block_size == 64


# --- prompt files: one reader for generate --input and analyze ------------------------------------------------------
def write_lines(tmp_path, *lines: str) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_prompt_file_records(tmp_path):
    messages = [{"role": "user", "content": "Hi", "name": "u1"}]
    path = write_lines(tmp_path, json.dumps({"prompt": "one", "max_tokens": 4, "temperature": 0.5}), "",
                       json.dumps({"messages": messages, "temperature": 1}))
    assert read_prompts_file(path) == [PromptRecord(line=1, prompt="one", max_tokens=4, temperature=0.5),
                                       PromptRecord(line=3, messages=messages, temperature=1)]
    assert [r.text_or_messages for r in read_prompts_file(path)] == ["one", messages]


@pytest.mark.parametrize("line,message", [
    ("just a plain prompt", "line 2: not valid JSON"),
    ('{"prompt": 3}', 'line 2: "prompt" must be a non-empty string'),
    ('{"prompt": "a", "messages": []}', 'line 2: expected an object with exactly one of "prompt" or "messages"'),
    ('["a"]', 'line 2: expected an object with exactly one of "prompt" or "messages"'),
    ('{"messages": [{"role": "user"}]}', 'line 2: "messages" must be a non-empty list'),
    ('{"prompt": "a", "max_token": 3}', "line 2: unknown field(s) max_token; allowed: prompt, messages"),
    ('{"prompt": "a", "max_tokens": true}', 'line 2: "max_tokens" must be an integer, got True'),
    ('{"prompt": "a", "temperature": "hot"}', "line 2: \"temperature\" must be a number, got 'hot'"),
])
def test_a_bad_prompt_line_is_named(tmp_path, line, message):
    path = write_lines(tmp_path, '{"prompt": "fine"}', line)
    with pytest.raises(PromptsFileError) as exc:
        read_prompts_file(path)
    assert str(exc.value).startswith(f"{path}, {message}")


@pytest.mark.parametrize("command", [["generate", "--input"], ["analyze"]])
def test_generate_and_analyze_report_the_same_bad_line(command, tmp_path, capsys):
    path = write_lines(tmp_path, '{"prompt": "fine"}', "not json")
    assert main([*command, path]) == 2
    assert f"kvreuse: {path}, line 2: not valid JSON" in capsys.readouterr().err
    assert main([*command, str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


# --- bench engine / prefix: the suite's run, its table on stdout, --out files ---------------------------------------
@pytest.mark.parametrize("suite,argv,expected_kwargs", [
    ("engine", ["--no-bf16", "--repeats", "2"],
     {"repeats": 2, "include_bf16": False, "target": Target(), "systems": None}),
    ("engine", ["--model", "m", "--device", "cpu", "--systems", "hf-fp32", "kvreuse-fp32", "--prefill-lengths", "64",
                "--decode-batches", "1", "4", "--decode-tokens", "8"],
     {"repeats": 3, "include_bf16": True, "target": Target("m", "cpu", Sizes((64,), 128, 8, (1, 4))),
      "systems": ["hf-fp32", "kvreuse-fp32"]}),
    ("prefix", [], {"repeats": 3, "model": None, "sets": []}),
    ("prefix", ["--model", "gemma3-270m", "--set", "cache.sliding_kv=full"],
     {"repeats": 3, "model": "gemma3-270m", "sets": ["cache.sliding_kv=full"]}),
])
def test_bench_suite_runs_and_writes_its_report(suite, argv, expected_kwargs, monkeypatch, tmp_path, capsys):
    import importlib

    module = importlib.import_module(f"kvreuse.bench.{suite}_bench")
    calls = []

    def fake_run(progress, **kwargs):
        calls.append(kwargs)
        return {"suite": suite}

    monkeypatch.setattr(module, "run", fake_run)
    monkeypatch.setattr(module, "markdown", lambda report: f"| {report['suite']} |")
    assert main(["bench", suite, *argv, "--out", str(tmp_path)]) == 0
    assert calls == [expected_kwargs]
    assert capsys.readouterr().out == f"| {suite} |\n"
    assert json.loads((tmp_path / f"{suite}.json").read_text()) == {"suite": suite}
    assert (tmp_path / f"{suite}.md").read_text() == f"| {suite} |\n"


@pytest.mark.parametrize("argv,message", [
    (["--systems", "kvreuse-fp64"], "unknown system 'kvreuse-fp64'; choose from kvreuse-fp32, "),
    (["--decode-tokens", "1"], "--decode-tokens must be at least 2"),
])
def test_bench_engine_refuses_what_it_cannot_time(argv, message, capsys):
    assert main(["bench", "engine", *argv]) == 2
    assert message in capsys.readouterr().err
