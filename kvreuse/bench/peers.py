"""Peers for `kvreuse bench scenario`: Hugging Face transformers on the same weights as our engine.

`HFPeer` sends a scenario's conversations one after another, rendered with the tokenizer's own chat template,
and decodes greedily for exactly `max_tokens` tokens in an explicit forward loop so TTFT and TPOT are timed
the way our engine times them. With `prefix_reuse` it reuses earlier prompts' KV the way the transformers docs
show: deep-copy the `DynamicCache` of the earlier prompt with the longest common token prefix, crop it to
that prefix and prefill only the rest. Results use the keys of `scenario_bench.run_mode`.
llama-cpp-python is not a peer here: our package index has no prebuilt wheel of it (only a long C++ build).
"""

from __future__ import annotations

import copy
import inspect
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.bench.metrics import fidelity_metrics, reuse_metrics, serving_metrics
from kvreuse.bench.workloads import LiveReplies
from kvreuse.engine.stats import peak_rss_bytes
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.tokens import common_prefix_length
from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.loader import resolve_model_path

SYSTEM = "hf-transformers"


@dataclass
class HFOutput:
    """One request's result, with the fields the scenario bench compares (as our `RequestOutput` names them)."""
    token_ids: list[int]
    first_logits: torch.Tensor   # [vocab] fp32 on the CPU: the distribution of the first generated token
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int           # prompt tokens whose KV came from an earlier prompt's cache


def load_hf(model_path: str | Path | None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`(model, tokenizer)` from a .gguf file (dequantized by transformers, as our loader does) or an HF
    directory; None is our engine's default model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(str(model_path) if model_path else None)
    if path.is_file() and path.suffix == ".gguf":
        location, extra = str(path.parent), {"gguf_file": path.name}
    elif path.is_dir():
        location, extra = str(path), {}
    else:
        raise ModelLoadError(f"unsupported model path {path}: expected a .gguf file or a Hugging Face directory")
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **extra).to(device).eval()
    return model, AutoTokenizer.from_pretrained(location, **extra)


def cache_argument(model) -> str:
    """The name under which `model.forward` takes its KV cache: `cache` from transformers 5.2x on,
    `past_key_values` before (later versions still accept it, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_bytes(cache) -> int:
    # Storage, not view sizes: a cropped cache still holds the tensors it was sliced from.
    return sum(t.untyped_storage().nbytes() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


class HFPeer:
    """HF transformers holding one model and tokenizer; `run` sends a scenario's conversations through it."""

    def __init__(self, model_path: str | Path | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", max_cached_prompts: int = 8):
        self.model, self.tokenizer = load_hf(model_path, dtype, device)
        self.device = device
        self.cache_argument = cache_argument(self.model)
        self.max_cached_prompts = max_cached_prompts

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The prompt's token ids, from the tokenizer's own chat template (with the generation prompt)."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    @torch.inference_mode()
    def run(self, conversations: list[list[dict]], max_tokens: int, *, prefix_reuse: bool = False,
            exact: list | None = None) -> tuple[dict, list[HFOutput]]:
        """Send the conversations one after another, each decoded greedily for exactly `max_tokens` tokens.

        With `prefix_reuse`, each prompt starts from a copy of the cached prompt that shares the longest token
        prefix with it; the cache starts empty on every call. `exact` (our engine's no-cache outputs of the
        same conversations) adds top1_agreement, mean_kl and mean_match_len. Returns the result, keyed as
        `scenario_bench.run_mode`'s, and the per-request outputs."""
        prompt_caches: OrderedDict[tuple[int, ...], object] = OrderedDict()  # token ids -> their KV, oldest first
        outputs, peak_kv = [], 0
        start = time.perf_counter()
        replies = LiveReplies()
        for messages in conversations:
            prompt = self.encode_chat(replies.fill(messages))
            output, cache = self._generate(prompt, max_tokens, prompt_caches if prefix_reuse else None)
            replies.record(messages, self.tokenizer.decode(output.token_ids, skip_special_tokens=True))
            # KV of the running request only, like our engine's peak_kv_bytes (its cached blocks are not counted).
            peak_kv = max(peak_kv, _cache_bytes(cache))
            if prefix_reuse:
                # Kept with the generated tokens (all but the last, never fed back), as the transformers docs
                # keep a chat's cache: the next turn resends this reply, as our engine's cache allows too.
                key = tuple(prompt + output.token_ids[:-1])
                prompt_caches[key] = cache
                prompt_caches.move_to_end(key)
                while len(prompt_caches) > self.max_cached_prompts:
                    prompt_caches.popitem(last=False)
            outputs.append(output)
        duration = time.perf_counter() - start
        return _result(outputs, duration, peak_kv, exact), outputs

    def _generate(self, prompt: list[int], max_tokens: int, prompt_caches: dict | None) -> tuple[HFOutput, object]:
        from transformers import DynamicCache

        start = time.perf_counter()
        cache, reused = DynamicCache(config=self.model.config), 0
        if prompt_caches:
            best = max(prompt_caches, key=lambda ids: common_prefix_length(ids, prompt))
            # At least one prompt token is computed: its logits give the first output token.
            reused = min(common_prefix_length(best, prompt), len(prompt) - 1)
            if reused > 0:
                prompt_caches.move_to_end(best)
                cache = copy.deepcopy(prompt_caches[best])  # the stored cache must stay whole for later prompts
                cache.crop(reused - cache.get_seq_length())
        ids = torch.tensor([prompt[reused:]], device=self.device)  # [1, prompt tokens not cached]
        with_cache = {self.cache_argument: cache, "use_cache": True}
        logits = self.model(input_ids=ids, logits_to_keep=1, **with_cache).logits[0, -1]  # [vocab]
        first_logits = logits.float().cpu()
        token_ids = [int(logits.argmax())]  # .item() waits for the device, so the clock below is honest
        ttft = time.perf_counter() - start
        while len(token_ids) < max_tokens:
            ids = torch.tensor([[token_ids[-1]]], device=self.device)  # [1, 1]
            logits = self.model(input_ids=ids, **with_cache).logits[0, -1]  # [vocab]
            token_ids.append(int(logits.argmax()))
        total = time.perf_counter() - start
        return HFOutput(token_ids, first_logits, ttft, total, len(prompt), reused), cache


def _result(outputs: list[HFOutput], duration: float, peak_kv: int, exact: list | None) -> dict:
    # HF reuses exact prefixes only: no segments, no repair, no guard.
    reuse = sum((ReuseRecord.planned(o.prompt_tokens, o.cached_tokens) for o in outputs), ReuseRecord())
    result = {
        "system": SYSTEM,
        **serving_metrics([o.ttft_s for o in outputs], [o.total_s for o in outputs],
                          [len(o.token_ids) for o in outputs], duration, reuse.prompt_tokens),
        **reuse_metrics(reuse),
        "peak_kv_bytes": peak_kv, "peak_rss_bytes": peak_rss_bytes(),
    }
    if exact is not None:
        result.update(fidelity_metrics(outputs, exact))
    return result
