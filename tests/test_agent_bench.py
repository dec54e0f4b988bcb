"""`kvreuse bench agent`: the workload, the streamed-call reassembly, the token accounting and the report maths
without a server (a scripted client stands in for one), and one slow run of the CLI against a real `kvreuse serve`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from kvreuse.bench import agent_bench, agent_loop, agent_report, agent_stream, agent_systems
from kvreuse.bench import agent_workload as workload
from kvreuse.bench.agent_loop import Options, StepRecord
from tests.server_process import REPO_ROOT


def test_workload_is_deterministic_from_the_seed():
    first, again, other = (workload.make_sessions(6, seed) for seed in (0, 0, 1))
    assert first == again and first != other
    assert len({s.task for s in first}) == 6
    assert all(2 <= len(s.tools) <= 4 for s in first)
    assert len({s.messages()[0]["content"] for s in first}) == 1  # one system prompt for all
    names = [t["function"]["name"] for t in workload.TOOLS]
    assert all(t["function"]["parameters"]["type"] == "object" for t in workload.TOOLS)
    assert {"search_docs", "read_file", "run_tests", "get_weather"} <= set(names)


def test_more_sessions_than_tasks_keep_distinct_tasks():
    sessions = workload.make_sessions(len(workload.TASKS) + 3)
    assert len({s.task for s in sessions}) == len(sessions)


def test_tool_result_depends_on_the_call_and_seed_and_has_the_asked_size():
    result = workload.tool_result("read_file", '{"path": "src/io.py"}', seed=0, tokens=150)
    assert result == workload.tool_result("read_file", '{"path": "src/io.py"}', seed=0, tokens=150)
    assert result != workload.tool_result("read_file", '{"path": "src/cli.py"}', seed=0, tokens=150)
    assert result != workload.tool_result("read_file", '{"path": "src/io.py"}', seed=1, tokens=150)
    parsed = json.loads(result)
    assert parsed["tool"] == "read_file" and parsed["arguments"] == {"path": "src/io.py"}
    assert 150 * workload.CHARS_PER_TOKEN <= len(result) < 150 * workload.CHARS_PER_TOKEN + 200
    big = workload.tool_result("search_docs", "not json", tokens=400)
    assert json.loads(big)["arguments"] == {} and len(big) >= 400 * workload.CHARS_PER_TOKEN
    for tool in workload.TOOLS:
        assert json.loads(workload.tool_result(tool["function"]["name"], '{"target": "tests", "city": "Oslo"}'))


def call_delta(index: int, id: str | None = None, name: str | None = None, arguments: str | None = None) -> NS:
    return NS(index=index, id=id, type="function" if id else None, function=NS(name=name, arguments=arguments))


def test_streamed_call_deltas_are_reassembled_by_index():
    calls: dict = {}
    for delta in (call_delta(0, "call_a", "read_file", ""), call_delta(0, arguments='{"path": '),
                  call_delta(1, "call_b", "run_tests", '{"target"'), call_delta(0, arguments='"a.py"}'),
                  call_delta(1, arguments=': "tests"}')):
        agent_stream.add_call_delta(calls, delta)
    assert calls[0] == {"id": "call_a", "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    assert calls[1]["function"] == {"name": "run_tests", "arguments": '{"target": "tests"}'}


def test_usage_counts_prefer_the_servers_computed_tokens():
    ours = {"prompt_tokens": 500, "completion_tokens": 30, "computed_prompt_tokens": 120,
            "prompt_tokens_details": {"cached_tokens": 384}}
    assert agent_stream.usage_counts(ours) == (500, 384, 120, 30, "usage.computed_prompt_tokens")
    theirs = {"prompt_tokens": 500, "completion_tokens": 30, "prompt_tokens_details": {"cached_tokens": 400}}
    assert agent_stream.usage_counts(theirs) == (500, 400, 100, 30, "prompt_tokens - cached_tokens")
    # llama-server: the prompt tokens its slot processed, from the timings of the stream's last chunk.
    timings = {"cache_n": 400, "prompt_n": 101, "predicted_n": 30}
    assert agent_stream.usage_counts(theirs, timings) == (500, 400, 101, 30, "timings.prompt_n")
    assert agent_stream.usage_counts({"prompt_tokens": 500, "completion_tokens": 30}) == (
        500, None, 500, 30, "prompt_tokens - cached_tokens")
    assert agent_stream.usage_counts({}) == (None, None, None, None, None)


def record(step: int, prompt: int, cached: int, completion: int, ttft: float = 0.1, session: int = 0) -> StepRecord:
    return StepRecord(session, step, ttft_s=ttft, latency_s=ttft * 2, prompt_tokens=prompt, cached_tokens=cached,
                      computed_tokens=prompt - cached, completion_tokens=completion)


def test_new_tokens_are_the_prompt_beyond_the_previous_prompt_and_completion():
    records = [record(1, 400, 0, 30), record(2, 600, 416, 25), record(3, 790, 608, 40)]
    agent_loop.account_new_tokens(records)
    assert [r.new_tokens for r in records] == [400, 600 - 430, 790 - 625]
    unknown = [record(1, 400, 0, 30), StepRecord(0, 2, error="boom")]
    agent_loop.account_new_tokens(unknown)
    assert unknown[1].new_tokens is None


def two_sessions() -> list[StepRecord]:
    records = []
    for session, ttfts in ((0, (0.5, 0.1, 0.2)), (1, (0.7, 0.3, 0.4))):
        steps = [record(1, 400, 0, 30, ttfts[0], session), record(2, 600, 420, 25, ttfts[1], session),
                 record(3, 800, 630, 40, ttfts[2], session)]
        agent_loop.account_new_tokens(steps)
        records += steps
    return records


def test_per_step_rows_and_totals():
    rows = agent_report.per_step(two_sessions(), 4)
    assert [r["answered"] for r in rows] == [2, 2, 2, 0]
    assert rows[0]["median_ttft_ms"] == pytest.approx(600) and rows[1]["median_ttft_ms"] == pytest.approx(200)
    assert rows[1]["cached_share"] == pytest.approx(420 / 600)
    assert rows[1]["new_tokens"] == 2 * 170 and rows[1]["computed_tokens"] == 2 * 180
    assert rows[1]["computed_per_new"] == pytest.approx(180 / 170)
    assert rows[3]["median_ttft_ms"] is None and rows[3]["computed_per_new"] is None
    totals = agent_report.totals([*two_sessions(), StepRecord(1, 4, error="HTTP 500")], wall_s=3.5)
    assert totals["job_completion_s"] == 3.5 and totals["steps_answered"] == 6 and totals["steps_failed"] == 1
    assert totals["prompt_tokens"] == 2 * 1800 and totals["computed_tokens"] == 2 * (400 + 180 + 170)
    # Steps 2 and 3: computed 180 + 170 against new 170 + 175, per session.
    assert totals["later_computed_per_new"] == pytest.approx(350 / 345)


def test_job_ratios_are_the_reference_over_each_other():
    systems = {name: {"totals": {"job_completion_s": s}} for name, s in (("kvreuse", 2.0), ("llama-server", 5.0),
                                                                          ("kvreuse-nocache", 4.0))}
    assert agent_report.job_ratios(systems, "kvreuse") == {"kvreuse/llama-server": 0.4, "kvreuse/kvreuse-nocache": 0.5}


def report(tmp_systems: dict | None = None) -> dict:
    result = {"per_step": agent_report.per_step(two_sessions(), 3), "totals": agent_report.totals(two_sessions(), 2.0),
              "first_error": None}
    slow = {**result, "totals": {**result["totals"], "job_completion_s": 4.0}, "first_error": "HTTP 400: no tools"}
    systems = tmp_systems or {"kvreuse": result, "kvreuse-nocache": slow}
    return {"suite": "agent", "options": vars(Options(sessions=2, steps=3)), "systems": systems,
            "machine": {"cpu": "Test CPU", "flags": ["avx2"], "cores": 2}, "reference": "kvreuse",
            "ratios": agent_report.job_ratios(systems, "kvreuse")}


def test_markdown_has_a_row_per_system_and_step_and_the_totals(tmp_path):
    table = agent_report.markdown(report())
    assert "| kvreuse | 2 | 2 | 200 | 400 | 600 | 170 | 180 | 25 | 70.0% | 1.06 |" in table  # means per step
    assert "| kvreuse-nocache | 1 | 4.00 | 4.00 | 6 | 0 | 41.7% | 1.01 |" in table
    assert "Job completion time kvreuse/kvreuse-nocache: 0.50x." in table
    assert "First failure, kvreuse-nocache: HTTP 400" in table and "Test CPU (avx2)" in table
    png = agent_report.ttft_plot(report(), tmp_path / agent_report.TTFT_PNG)
    assert png.read_bytes().startswith(b"\x89PNG")


class ScriptedServer:
    """Stands in for AsyncOpenAI: answers each streamed request with a call (or text when tool_choice is none),
    reporting usage as if the previous turns were all cached; keeps the requests it got."""

    def __init__(self):
        self.requests: list[dict] = []
        self.chat = NS(completions=NS(create=self.create))

    async def create(self, **request):
        self.requests.append(request)
        prompt = 100 * len(request["messages"])
        usage = NS(model_dump=lambda: {"prompt_tokens": prompt, "completion_tokens": 20,
                                       "prompt_tokens_details": {"cached_tokens": max(0, prompt - 150)}})
        final = request["tool_choice"] == "none"
        n = len(self.requests)
        deltas = ([NS(content="Done.", tool_calls=None)] if final else
                  [NS(content=None, tool_calls=[call_delta(0, f"call_{n}", "read_file", '{"path": ')]),
                   NS(content=None, tool_calls=[call_delta(0, arguments=f'"f{n}.py"}}')])])

        async def chunks():
            for delta in deltas:
                yield NS(usage=None, choices=[NS(delta=delta, finish_reason=None)])
            yield NS(usage=None, choices=[NS(delta=NS(content=None, tool_calls=None),
                                             finish_reason="stop" if final else "tool_calls")])
            yield NS(usage=usage, choices=[])
        return chunks()


def test_a_session_echoes_each_call_and_appends_its_result():
    server, session = ScriptedServer(), workload.make_sessions(1)[0]
    options = Options(sessions=1, steps=3, tool_latency_s=0)
    records = asyncio.run(agent_loop.run_session(server, "m", session, options))
    assert [r.step for r in records] == [1, 2, 3] and not any(r.error for r in records)
    assert [r.tool_calls for r in records] == [1, 1, 0] and records[-1].finish_reason == "stop"
    assert [r.new_tokens for r in records] == [200, 180, 180]  # 2 messages, then +2 a step, less 20 completed
    assert [q["tool_choice"] for q in server.requests] == ["required", "required", "none"]
    assert server.requests[2]["extra_body"] == {"ignore_eos": True} and "extra_body" not in server.requests[0]
    assert server.requests[0]["parallel_tool_calls"] is False and "parallel_tool_calls" not in server.requests[2]
    last = server.requests[2]["messages"]
    assert last[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "f1.py"}'}}]}
    assert last[3]["role"] == "tool" and last[3]["tool_call_id"] == "call_1"
    assert last[3]["content"] == workload.tool_result("read_file", '{"path": "f1.py"}', 0, 150)
    assert len(last) == 6 and server.requests[0]["tools"] == session.tools
    assert not any("prompt_cache_key" in q for q in server.requests)
    hinted = ScriptedServer()
    asyncio.run(agent_loop.run_session(hinted, "m", session, Options(sessions=1, steps=3, tool_latency_s=0,
                                                                     session_hints=True)))
    assert [q["prompt_cache_key"] for q in hinted.requests] == ["agent-session-0"] * 3


def test_a_step_that_calls_no_tool_ends_the_session():
    class Texter(ScriptedServer):
        async def create(self, **request):
            return await super().create(**{**request, "tool_choice": "none"})

    records = asyncio.run(agent_loop.run_session(Texter(), "m", workload.make_sessions(1)[0],
                                                  Options(steps=4, tool_latency_s=0)))
    assert len(records) == 1 and records[0].error.startswith("no tool call in the answer")


def test_unknown_system_is_refused():
    with pytest.raises(ValueError, match="unknown system 'vllm'"):
        agent_systems.started_systems(["kvreuse", "vllm"], [])
    nocache = agent_systems.started_systems(["kvreuse-nocache"], ["--block-size", "4"])[0]
    assert nocache.server_args == ["--block-size", "4", "--set", "cache.enabled=false"]
    assert nocache.command is None and nocache.url is None


def fake_binary(tmp_path) -> str:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    return str(binary)


def test_llama_server_gets_the_same_gguf_and_template_as_kvreuse(tmp_path):
    from kvreuse.weights.loader import embedded_model_path

    binary = fake_binary(tmp_path)
    kvreuse, nocache, llama = agent_systems.started_systems(
        ["kvreuse", "kvreuse-nocache", "llama-server"], ["--block-size", "4"], sessions=4, llama_server=binary)
    template = str(agent_systems.CHAT_TEMPLATE)
    assert agent_systems.CHAT_TEMPLATE.is_file()
    assert kvreuse.server_args == ["--block-size", "4", "--chat-template", template]
    assert nocache.server_args == ["--block-size", "4", "--chat-template", template, "--set", "cache.enabled=false"]
    ctx = 4 * agent_systems.LLAMA_SERVER_CTX_PER_SLOT
    assert llama.command == [binary, "--model", str(embedded_model_path()), "--alias", "SmolLM2-135M-Instruct",
                             "--jinja", "--chat-template-file", template, "--ctx-size", str(ctx), "--parallel", "4"]
    # Without llama-server, kvreuse keeps the model's own template unless one is given.
    assert agent_systems.started_systems(["kvreuse"], [])[0].server_args == []
    given = agent_systems.started_systems(["kvreuse", "llama-server"], [], chat_template="t.jinja", sessions=2,
                                          llama_server=binary)
    assert given[0].server_args == ["--chat-template", "t.jinja"]
    assert given[1].command[given[1].command.index("--chat-template-file") + 1] == "t.jinja"
    assert given[1].command[-3:] == [str(2 * agent_systems.LLAMA_SERVER_CTX_PER_SLOT), "--parallel", "2"]


def test_a_missing_llama_server_names_the_build(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"llama-server not found .*make bench-peers"):
        agent_systems.started_systems(["llama-server"], [], llama_server=str(tmp_path / "absent"))
    monkeypatch.setattr(agent_systems.shutil, "which", lambda name: None)
    monkeypatch.setattr(agent_systems.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(FileNotFoundError, match="make bench-peers"):
        agent_systems.find_llama_server()
    (tmp_path / "llama-server").write_text("")
    assert agent_systems.find_llama_server() == tmp_path / "llama-server"  # beside the venv's Python
    with pytest.raises(ValueError, match="needs a GGUF file"):
        agent_systems.started_systems(["llama-server"], [], model=str(tmp_path), llama_server=fake_binary(tmp_path))


HEALTH_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_started_command_serves_until_the_block_ends_and_a_crash_is_reported(tmp_path):
    import httpx

    script = tmp_path / "health.py"
    script.write_text(HEALTH_SERVER)
    lines = []
    with agent_systems.served_command([sys.executable, str(script)], lines.append) as root:
        assert httpx.get(f"{root}/health", trust_env=False).status_code == 200
    assert root.startswith("http://127.0.0.1:") and "ready" in lines[0]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{root}/health", trust_env=False, timeout=2)  # stopped
    crash = [sys.executable, "-c", "import sys; print('bad model file'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3 before it was ready: bad model file"):
        with agent_systems.served_command(crash, lines.append):
            pass


@pytest.mark.slow
def test_cli_runs_the_agent_loop_against_kvreuse_serve(tmp_path):
    command = [sys.executable, "-m", "kvreuse", "bench", "agent", "--systems", "kvreuse", "--sessions", "2",
               "--steps", "3", "--tool-latency-s", "0", "--max-tokens", "48", "--answer-tokens", "8",
               "--tool-result-tokens", "60", "--block-size", "4", "--set", "engine.compile=off",
               "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| kvreuse | 3 | 2 |" in done.stdout and "steps 2+ computed/new" in done.stdout
    saved = json.loads((tmp_path / "agent.json").read_text())
    assert saved["systems"]["kvreuse"]["totals"]["steps_failed"] == 0
    assert (tmp_path / agent_report.TTFT_PNG).exists()


def test_a_system_that_fails_is_reported_beside_the_others_and_runs_interleave(monkeypatch):
    order = []

    def fake_run_system(url, options, model, api_key):
        order.append(url)
        if "bad" in url:
            raise RuntimeError("no agent step succeeded")
        return {"url": url, "model": "m", "records": two_sessions(), "wall_s": 2.0 if "ok" in url else 3.0 + len(order)}

    monkeypatch.setattr(agent_bench, "run_system", fake_run_system)
    systems = [agent_systems.System("llama-server", url="http://bad"), agent_systems.System("ours", url="http://ok"),
               agent_systems.System("peer", url="http://peer")]
    result = agent_bench.run(systems, Options(steps=3), progress=lambda line: None, repeats=2)
    # A B C, then A B C less the one that failed; every run is separate.
    assert order == ["http://bad", "http://ok", "http://peer", "http://ok", "http://peer"]
    assert list(result["systems"]) == ["ours", "peer"] and result["reference"] == "ours"
    assert result["failures"] == {"llama-server": "no agent step succeeded"}
    peer = result["systems"]["peer"]
    assert peer["runs"] == 2 and peer["job_completion_runs_s"] == [6.0, 8.0]
    assert peer["totals"]["job_completion_s"] == 7.0  # the median of the runs
    assert peer["per_step"][1]["answered"] == 4 and peer["totals"]["steps_answered"] == 12
    assert [r["run"] for r in peer["records"]] == [1] * 6 + [2] * 6
    assert result["ratios"] == {"ours/peer": pytest.approx(2 / 7)}
    assert result["round_ratios"] == {"ours/peer": [pytest.approx(2 / 6), pytest.approx(2 / 8)]}
    table = agent_report.markdown(result)
    assert "llama-server did not run: no agent step succeeded" in table
    assert "Job completion time ours/peer: 0.29x (per round: 0.33, 0.25)." in table
    assert "| peer | 2 | 7.00 | 6.00, 8.00 | 12 | 0 |" in table
    assert "Computed prompt tokens from" not in table  # the test records name no source


def test_an_unreachable_server_alone_fails_the_bench():
    with pytest.raises(RuntimeError, match="gone: cannot reach the server"):
        agent_bench.run([agent_systems.System("gone", url="http://127.0.0.1:9")], Options(), progress=lambda line: None)


def test_cli_pairs_urls_with_labels_and_refuses_bad_input(monkeypatch, capsys):
    from kvreuse.cli import main

    chosen = {}
    monkeypatch.setattr(agent_bench, "run", lambda systems, options, **kw: chosen.update(
        systems=systems, options=options, repeats=kw["repeats"]) or report())
    assert main(["bench", "agent", "--systems", "kvreuse", "--block-size", "4", "--url", "http://a:8080",
                 "--name", "llama-server", "--url", "http://b", "--sessions", "3", "--tool-latency-s", "0",
                 "--repeats", "2"]) == 0
    assert [(s.name, s.url) for s in chosen["systems"]] == [("kvreuse", None), ("llama-server", "http://a:8080"),
                                                          ("server-2", "http://b")]
    assert chosen["systems"][0].server_args == ["--block-size", "4"]
    assert chosen["options"].sessions == 3 and chosen["options"].tool_latency_s == 0 and chosen["repeats"] == 2
    assert "| system | step |" in capsys.readouterr().out
    assert main(["bench", "agent", "--url", "http://a", "--name", "x", "--name", "y"]) == 2
    assert main(["bench", "agent", "--systems", "vllm"]) == 2
    assert main(["bench", "agent", "--url", "http://a", "--url", "http://b", "--name", "server-2"]) == 2
    assert main(["bench", "agent", "--systems"]) == 2
    assert "nothing to measure" in capsys.readouterr().err
    assert main(["bench", "agent", "--systems", "llama-server", "--llama-server", "/nonexistent/llama-server"]) == 2
    assert "make bench-peers" in capsys.readouterr().err


def test_a_live_run_records_a_transcript_that_round_trips(tmp_path):
    from kvreuse.bench.agent_replay import Transcript

    server, session = ScriptedServer(), workload.make_sessions(1)[0]
    options = Options(sessions=1, steps=3, tool_latency_s=0)
    transcript = Transcript(vars(options))
    asyncio.run(agent_loop.run_session(server, "m", session, options, transcript))
    recorded = transcript.sessions[0]
    assert recorded.index == 0 and recorded.tools == session.tools
    assert [s.messages for s in recorded.steps] == [q["messages"] for q in server.requests]
    assert [(s.max_tokens, s.completion_tokens, s.final) for s in recorded.steps] == [(96, 20, False), (96, 20, False),
                                                                                      (64, 20, True)]
    assert recorded.steps[2].messages[2]["tool_calls"][0]["id"] == "call_1"  # the call turn as the server sent it
    again = Transcript.load(transcript.save(tmp_path / "t.json"))
    assert again == transcript and again.replay_options().steps == 3
    with pytest.raises(ValueError, match="not an agent transcript"):
        Transcript.from_json({"sessions": []})


def test_a_replay_sends_the_recorded_messages_with_no_call_and_the_recorded_lengths(monkeypatch):
    from kvreuse.bench import agent_replay
    from kvreuse.bench.agent_replay import SessionTranscript, Transcript, TranscriptStep

    steps = [TranscriptStep([{"role": "user", "content": "a"}], 96, 17),
             TranscriptStep([{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [{"id": "c1"}]}], 96, None),
             TranscriptStep([{"role": "user", "content": "b"}], 64, 64, final=True)]
    transcript = Transcript(vars(Options(sessions=1, steps=3, tool_latency_s=0)), {"system": "kvreuse"},
                            [SessionTranscript(0, [workload.TOOLS[0]], steps)])
    server = ScriptedServer()
    records = asyncio.run(agent_replay.replay_session(server, "m", transcript.sessions[0],
                                                      transcript.replay_options()))
    assert [q["messages"] for q in server.requests] == [s.messages for s in steps]
    assert [q["max_tokens"] for q in server.requests] == [17, 96, 64]  # the recorded completion, else max_tokens
    assert all(q["tool_choice"] == "none" and q["extra_body"] == {"ignore_eos": True}
               and q["tools"] == [workload.TOOLS[0]] for q in server.requests)
    assert not any(r.error for r in records)
    assert [r.new_tokens for r in records] == [100, 100, -100]  # prompt minus the previous prompt only
    assert transcript.summary()["replayed_tokens"] == [[17, 96, 64]]

    seen = []

    async def fake_replay_loop(url, replay, model, api_key):
        seen.append(url)
        return "m", two_sessions(), 1.5

    monkeypatch.setattr(agent_bench, "replay_loop", fake_replay_loop)
    result = agent_bench.run([agent_systems.System("kvreuse", url="http://a"),
                              agent_systems.System("llama-server", url="http://b")], Options(sessions=9),
                             progress=lambda line: None, repeats=2, replay=transcript)
    assert seen == ["http://a", "http://b"] * 2 and result["mode"] == "replay"
    assert result["options"]["sessions"] == 1 and result["ratios"] == {"kvreuse/llama-server": 1.0}
    assert "Replay of the conversations recorded against kvreuse" in agent_report.markdown(result)
