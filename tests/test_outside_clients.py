"""Outside clients against `kvreuse serve`, run as their users run them (their CLIs, in subprocesses): lm-evaluation-
harness 0.4.13 (`local-completions` multiple choice, scored from echoed prompt logprobs; `local-chat-completions`
generate_until; its `remote` tokenizer backend) and guidellm 0.8.1 (a short synthetic benchmark). What each client
sends and reads back is written down in docs/features/clients.md.

The clients are not kvreuse's dependencies: a test whose client is not importable is skipped, naming the pin to
install. Every test here runs the real SmolLM2-135M in fp32 (slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .server_process import REPO_ROOT, Server, http_client, start_server

pytestmark = pytest.mark.slow

LM_EVAL_PIN = "lm-eval[api]==0.4.13"
GUIDELLM_PIN = "guidellm==0.8.1"
CLIENT_TIMEOUT = 600  # seconds, for one client run: a bound, not an expectation (each takes well under a minute)
# Prefill work counters (the reuse record's invariant): tokens run through the model for prompts.
PREFILL_COUNTERS = ("kvreuse:computed_prompt_tokens_total", "kvreuse:recomputed_prompt_tokens_total",
                    "kvreuse:discarded_prompt_tokens_total")


def needs(module: str, pin: str) -> pytest.MarkDecorator:
    """Skip (before any server starts) when the client is not installed."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install '{pin}'): this test runs it against "
                                     f"kvreuse serve")


needs_lm_eval = needs("lm_eval", LM_EVAL_PIN)
needs_guidellm = needs("guidellm", GUIDELLM_PIN)


def client_env(tmp_path: Path) -> dict[str, str]:
    """The clients' environment: never the network (hub look-ups fail fast), never a proxy for 127.0.0.1, caches
    (datasets' arrow files, lm-eval's) in the test's own folder, no API key (the servers here run without auth)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"),
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", TOKENIZERS_PARALLELISM="false")
    return env


def run_client(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run `python -m ARGS` to completion (`env` on top of `client_env`); fail with its output's tail if it fails.
    Returns stdout + stderr."""
    done = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env={**client_env(tmp_path), **(env or {})},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{args[0]} exited with {done.returncode}:\n{output[-6000:]}"
    return output


def prefill_work(server: Server) -> float:
    scrape = server.metrics()
    return sum(scrape.get_or_zero(name, model_name=server.model) for name in PREFILL_COUNTERS)


# --- servers and the tokenizer directory -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cached_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server-logs") / "cached.log"
    with start_server("--dtype", "fp32", log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """The served tokenizer as a Hugging Face directory, made by `kvreuse tokenizer export DIR`: what lm-eval's
    `tokenizer=DIR` and guidellm's `--tokenizer kind=hf_auto,model=DIR` load (neither can reach the hub)."""
    path = tmp_path_factory.mktemp("tokenizer") / "smollm2"
    subprocess.run([sys.executable, "-m", "kvreuse", "tokenizer", "export", str(path)], cwd=REPO_ROOT, check=True,
                   stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    return str(path)


# --- lm-eval's tasks: written by the test, with their data -------------------------------------------------------
NAMES = ["Aldous", "Brenna", "Corwin", "Delia", "Emrys", "Fiona", "Gareth", "Helga", "Idris", "Jora", "Kestrel",
         "Lyra", "Madoc", "Nerys", "Osric", "Perrin"]
TOWNS = ["Port Elling", "Harrow Cross", "Wenlow", "Stavebridge", "Mirefold", "Ashcombe", "Dunmere", "Fallowmead"]
TRADES = ["baker", "smith", "weaver", "carpenter", "fisher", "potter", "miller", "cooper"]
SPOTS = ["well", "bridge", "chapel", "gate"]


def multiple_choice_rows() -> list[dict]:
    """8 questions, each over its own ~330-token town record (shared by its 4 choices: what a prefix cache serves)."""
    rows = []
    for q, town in enumerate(TOWNS):
        people = [NAMES[(q * 3 + i * 5) % len(NAMES)] for i in range(5)]
        trades = [TRADES[(q + i * 3) % len(TRADES)] for i in range(5)]
        record = [f"This is the record of the town of {town}, kept by the council for the year of the long winter."]
        for i, (person, trade) in enumerate(zip(people, trades, strict=True)):
            record.append(f"{person} works as the {trade} of {town}, and has done so for {3 + 7 * i + q} years. "
                          f"Every market day {person} sets up a stall near the {SPOTS[(q + i) % len(SPOTS)]} and "
                          f"sells what the {trade}'s craft has made, trading with travellers from the coast and from "
                          f"the hills beyond the river.")
        record.append(f"The council meets in the hall of {town} on the first day of each month.")
        target = q % 5
        choices = [p for i, p in enumerate(people) if i != target][:3]
        choices.insert(q % 4, people[target])
        rows.append({"context": " ".join(record), "question": f"Who works as the {trades[target]} of {town}?",
                     "choices": choices, "answer": q % 4})
    return rows


GENERATE_ROWS = [{"question": "What is the capital of France?", "answer": "Paris"},
                 {"question": "How many legs does a spider have?", "answer": "eight"},
                 {"question": "What colour is the sky on a clear day?", "answer": "blue"}]
GENERATE_PROMPT = "Answer in one word. {question}"
GENERATE_STOP = ["\n\n", "."]
GENERATE_MAX_TOKENS = 16


def write_task(folder: Path, name: str, rows: list[dict], body: str) -> None:
    """An lm-eval task YAML over a local jsonl file (`dataset_path: json`), in `folder` (lm-eval's --include_path)."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        + body)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    write_task(folder, "kvreuse_mc", multiple_choice_rows(),
               "output_type: multiple_choice\n"
               'doc_to_text: "{{context}}\\nQuestion: {{question}}\\nAnswer:"\n'
               'doc_to_choice: "{{choices}}"\n'
               "doc_to_target: answer\n"
               "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    write_task(folder, "kvreuse_gen", GENERATE_ROWS,
               "output_type: generate_until\n"
               f'doc_to_text: "{GENERATE_PROMPT.replace("{question}", "{{question}}")}"\n'
               "doc_to_target: answer\n"
               f"generation_kwargs:\n  until: {json.dumps(GENERATE_STOP)}\n  max_gen_toks: {GENERATE_MAX_TOKENS}\n"
               "  do_sample: false\n  temperature: 0\n"
               "metric_list:\n  - metric: exact_match\n    ignore_case: true\n")
    return folder


def lm_eval(server: Server, task_dir: Path, tmp_path: Path, task: str, model: str, model_args: dict,
            *extra: str) -> tuple[dict, list[dict]]:
    """Run `lm-eval run` on one task against `server`; returns (the task's results, its samples in doc order).
    max_retries=1: a refused request fails the run at once, the server's answer in lm-eval's log."""
    endpoint = "chat/completions" if model == "local-chat-completions" else "completions"
    args = {"model": server.model, "base_url": f"{server.base_url}/{endpoint}", "max_retries": 1, **model_args}
    out = tmp_path / f"out-{task}-{len(list(tmp_path.glob('out-*')))}"
    run_client(["lm_eval", "run", "--model", model, "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
                "--tasks", task, "--include_path", str(task_dir), "--output_path", str(out), "--log_samples",
                *extra], tmp_path)
    [results_file] = out.rglob("results_*.json")
    [samples_file] = out.rglob(f"samples_{task}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    return json.loads(results_file.read_text())["results"][task], samples


def choice_loglikelihoods(samples: list[dict]) -> list[float]:
    # filtered_resps of a multiple-choice doc: one (loglikelihood, is_greedy) per choice; flat, in doc order.
    return [float(ll) for sample in samples for ll, _greedy in sample["filtered_resps"]]


# --- lm-eval ----------------------------------------------------------------------------------------------------
@needs_lm_eval
def test_lm_eval_multiple_choice_same_scores_with_and_without_cache(cached_server, tokenizer_dir, task_dir,
                                                                     tmp_path, tmp_path_factory):
    """8 questions x 4 choices through `local-completions` (token-id prompts, echo + logprobs + max_tokens=1): the
    same scores from a caching server, in batches of 1 and of 4 prompts, and from a server without prefix caching
    (lm-eval cannot add `use_cache: false` to a loglikelihood body); the caching server computes far fewer prompt
    tokens, since the 4 choices of a question share its ~330-token record."""
    args = {"tokenizer_backend": "huggingface", "tokenizer": tokenizer_dir}

    before = prefill_work(cached_server)
    cached, cached_samples = lm_eval(cached_server, task_dir, tmp_path, "kvreuse_mc", "local-completions", args)
    cached_work = prefill_work(cached_server) - before
    batched, batched_samples = lm_eval(cached_server, task_dir, tmp_path, "kvreuse_mc", "local-completions", args,
                                       "--batch_size", "4")
    log = tmp_path_factory.mktemp("server-logs") / "uncached.log"
    with start_server("--dtype", "fp32", "--no-enable-prefix-caching", log_path=log) as uncached_server:
        before = prefill_work(uncached_server)
        plain, plain_samples = lm_eval(uncached_server, task_dir, tmp_path, "kvreuse_mc", "local-completions", args)
        plain_work = prefill_work(uncached_server) - before

    assert len(cached_samples) == 8 and all(len(s["filtered_resps"]) == 4 for s in cached_samples)
    for results in (batched, plain):
        assert results["acc,none"] == cached["acc,none"] and results["acc_norm,none"] == cached["acc_norm,none"]
    expected = choice_loglikelihoods(plain_samples)
    for samples in (cached_samples, batched_samples):
        # Same tokens, same model: reusing cached K/V or batching changes the arithmetic's order, no more.
        assert choice_loglikelihoods(samples) == pytest.approx(expected, abs=1e-3)
    assert all(ll < 0 for ll in expected)
    # Without the cache every prompt is computed whole; with it, each question's record about once.
    print(f"lm-eval multiple choice: acc {cached['acc,none']}, prefill work {cached_work:.0f} tokens with the cache, "
          f"{plain_work:.0f} without")
    assert plain_work >= 32 * 330
    assert cached_work < 0.5 * plain_work, (cached_work, plain_work)


@needs_lm_eval
def test_lm_eval_remote_tokenizer_matches_exported(cached_server, tokenizer_dir):
    """`tokenizer_backend=auto` (local-completions' default) finds the server's /tokenizer_info and /tokenize and
    uses them: the same token ids, EOS and decoding as the exported tokenizer directory."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    lm = LocalCompletionsAPI(model=cached_server.model, base_url=f"{cached_server.base_url}/completions")
    assert lm.tokenizer_backend == "remote"
    exported = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = [multiple_choice_rows()[0]["context"] + "\nAnswer:", " Gareth", "naïve café — 東京 <|im_end|>"]
    for text in texts:
        assert lm.tok_encode(text) == exported(text, add_special_tokens=False).input_ids
    assert lm.eos_string == exported.eos_token and lm.eot_token_id == exported.eos_token_id
    ids = exported(texts[0], add_special_tokens=False).input_ids
    assert lm.decode_batch([ids]) == [exported.decode(ids)]


@needs_lm_eval
def test_lm_eval_generate_until_chat(cached_server, task_dir, tmp_path):
    """`local-chat-completions` with --apply_chat_template: one chat request per question (messages, max_tokens,
    temperature 0, stop, seed); its answers are the server's greedy answers to those requests."""
    _results, samples = lm_eval(cached_server, task_dir, tmp_path, "kvreuse_gen", "local-chat-completions", {},
                                "--apply_chat_template")
    answers = [sample["filtered_resps"][0] for sample in samples]
    with http_client(120.0) as client:
        for row, answer in zip(GENERATE_ROWS, answers, strict=True):
            body = {"model": cached_server.model, "max_tokens": GENERATE_MAX_TOKENS, "temperature": 0,
                    "stop": GENERATE_STOP, "seed": 1234,
                    "messages": [{"role": "user", "content": GENERATE_PROMPT.format(**row)}]}
            response = client.post(f"{cached_server.base_url}/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert answer == response.json()["choices"][0]["message"]["content"]
            assert answer.strip()


# --- guidellm ---------------------------------------------------------------------------------------------------
# guidellm 0.8.1's coordinator can drop the last request's completion: its receive thread runs the callback that sets
# the shutdown event, then puts the update in the buffer the benchmark reads; a read that times out in between sees
# the shutdown and stops, and the report has 9 of 10 requests. A one-second poll (its default is 0.1 s) makes that
# timeout 10x rarer. Reproduced by holding the receive thread 0.5 s after that callback: 9 of 10 with the default
# poll, 10 of 10 with this one.
GUIDELLM_ENV = {"GUIDELLM__MP_POLL_INTERVAL": "1.0"}
@needs_guidellm
def test_guidellm_synthetic_benchmark(cached_server, tokenizer_dir, tmp_path):
    """guidellm's synthetic benchmark with a shared prefix (10 streamed chat requests, a 512-token prefix common to all
    + 64 tokens of their own, 16 output tokens, one at a time) completes without an error; its report has TTFT and
    throughput, and the server served the prefix from its cache. (docs/bench/guidellm.md: a longer run, caching on
    and off.)"""
    report = tmp_path / "guidellm.json"
    hits_before = cached_server.metrics().get_or_zero("vllm:prefix_cache_hits_total", model_name=cached_server.model)
    run_client(["guidellm", "run", "--backend", f"kind=openai_http,target={cached_server.root}",
                "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=10",
                "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16,prefix_tokens=512,prefix_count=1",
                "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
                "--output", f"kind=json,path={report}", "--disable-console-interactive"], tmp_path, GUIDELLM_ENV)
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    assert benchmark["scheduler_metrics"]["requests_made"] == {"successful": 10, "errored": 0, "incomplete": 0,
                                                               "total": 10}
    metrics = benchmark["metrics"]
    ttft_ms = metrics["time_to_first_token_ms"]["successful"]
    output_tps = metrics["output_tokens_per_second"]["successful"]["mean"]
    assert ttft_ms["count"] == 10 and 0 < ttft_ms["median"] < 60_000
    assert output_tps > 0
    # ignore_eos: every request generates exactly its 16 tokens.
    assert metrics["output_token_count"]["successful"]["total_sum"] == 160
    hits = cached_server.metrics().get_or_zero("vllm:prefix_cache_hits_total", model_name=cached_server.model)
    assert hits - hits_before >= 9 * 496  # every request after the first: the prefix's full blocks
    print(f"guidellm: TTFT median {ttft_ms['median']:.0f} ms, p95 {ttft_ms['percentiles']['p95']:.0f} ms, "
          f"output {output_tps:.1f} tok/s, {metrics['requests_per_second']['successful']['mean']:.2f} req/s")
