"""Agent frameworks against `kvreuse serve`, as their users run them: the OpenAI Agents SDK (`openai-agents`) runs a
two-tool agent on its Chat Completions model to its final answer, with the real SmolLM2-135M (fp32, slow).

The SDK is a test dependency (pyproject's test extra); without it the test is skipped, naming the pin."""

from __future__ import annotations

import importlib.util

import pytest

from .server_process import start_server

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("agents") is None,
                                                   reason="openai-agents is not installed "
                                                          "(pip install 'openai-agents==0.24.0')")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server-logs") / "agents.log"
    with start_server("--dtype", "fp32", "--set", "engine.num_kv_blocks=1024", log_path=log) as server:
        yield server


def test_the_openai_agents_sdk_runs_a_two_tool_agent_to_its_final_answer(server):
    import httpx
    from agents import (
        Agent,
        AgentHooks,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    called: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city today."""
        called.append(("get_weather", city))
        return f"It is 21 C and sunny in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        called.append(("get_time", city))
        return f"It is 14:05 in {city}."

    class Plan(AgentHooks):
        """Which tool each turn may call: the weather, then the time, then none (a text answer). SmolLM2-135M, left
        at `auto`, calls the same tool again at every turn; the SDK's loop, the calls and the answer are real."""
        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = agent.model_settings.resolve(
                ModelSettings(tool_choice="get_time" if len(called) == 1 else "none"))

    client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                         http_client=httpx.AsyncClient(trust_env=False, timeout=300.0))
    agent = Agent(name="assistant", instructions="Answer questions about cities with the tools, briefly.",
                  tools=[get_weather, get_time], model=OpenAIChatCompletionsModel(server.model, client),
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=48,
                                               parallel_tool_calls=False),
                  reset_tool_choice=False, hooks=Plan())
    result = Runner.run_sync(agent, "What is the weather and the time in Paris?", max_turns=4)
    assert [name for name, _ in called] == ["get_weather", "get_time"] and all(city for _, city in called)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    usages = [response.usage for response in result.raw_responses]
    assert len(usages) == 3
    assert all(u.input_tokens_details.cached_tokens > 0 for u in usages[1:])  # each tool turn hit the cache
