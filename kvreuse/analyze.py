"""`kvreuse analyze`: why is the hit rate low? A diagnosis of a prompt log, without running the model.

It replays the prompts through the real cache manager (the same matching and eviction code the engine
runs, with no forward passes), so the predicted hit rates are what the engine would measure for those
prompts in that order (generated tokens aside). Then it looks for what breaks sharing, as the article's
troubleshooting section does: dynamic fields (timestamps, UUIDs, ids, numbers) inside otherwise equal
text, whitespace and full-width differences that `normalize_input` would remove, and where
near-duplicate prompts first diverge.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter

from kvreuse.config import Config
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.layout import resolve_layout
from kvreuse.kvcache.normalize import normalize_text
from kvreuse.kvcache.simulate import simulate
from kvreuse.kvcache.tokens import common_prefix_length
from kvreuse.model.args import ModelArgs
from kvreuse.weights.fingerprint import cached_sha256
from kvreuse.weights.loader import load_model_info, resolve_model_path
from kvreuse.weights.tokenizer import Tokenizer

DYNAMIC_FIELDS = {
    "timestamp": re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?\b"
                            r"|\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{2}:\d{2}\b|\b1[5-9]\d{8}(\d{3})?\b"),
    "uuid": re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    "id": re.compile(r"\b(?:user|session|request|trace|customer|order|account)[_ -]?id\s*[:=]?\s*[\w-]+",
                     re.IGNORECASE),
    "hex": re.compile(r"\b[0-9a-f]{16,}\b"),
    "number": re.compile(r"\b\d{4,}\b"),
}


def tokenize(tokenizer: Tokenizer, prompt: str | list[dict], normalize: bool) -> list[int]:
    """A prompt's tokens as the engine makes them: a text as a completion's, a conversation as chat's (whose template
    writes its own BOS: nothing added)."""
    if isinstance(prompt, str):
        return tokenizer.encode(render(tokenizer, prompt, normalize))
    fix = normalize_text if normalize else (lambda text: text)
    return tokenizer.encode_chat(tokenizer.render_chat([{**m, "content": fix(m.get("content") or "")}
                                                        for m in prompt]))


def render(tokenizer: Tokenizer, prompt: str | list[dict], normalize: bool) -> str:
    fix = normalize_text if normalize else (lambda text: text)
    if isinstance(prompt, str):
        return fix(prompt)
    return tokenizer.apply_chat_template([{**m, "content": fix(m.get("content") or "")} for m in prompt])


def replay(token_lists: list[list[int]], config: Config, fingerprint: str, segments: bool,
           args: ModelArgs | None = None) -> ReuseRecord:
    """The prompts through the engine's cache as configured (4096 blocks if the pool is sized by memory), over the
    pool layout the engine would use for a model of `args` (segment reuse: every layer's K/V)."""
    cache = config.cache.model_copy(update={"suffix": config.cache.suffix.model_copy(update={"enabled": segments})})
    layout = resolve_layout(args, cache) if args is not None else None
    return simulate(token_lists, config.cache, fingerprint, config.engine.num_kv_blocks or 4096,
                    enable_segments=segments, layout=layout)


def find_dynamic_fields(texts: list[str]) -> list[dict]:
    """Fields whose values differ across prompts, with where they sit (fraction of the prompt). Kinds are
    tried in order and a span claimed by one (a timestamp) is not reported again by a later one (a number)."""
    found = []
    claimed: list[list[tuple[int, int]]] = [[] for _ in texts]
    for kind, pattern in DYNAMIC_FIELDS.items():
        values: Counter[str] = Counter()
        offsets = []
        for text, spans in zip(texts, claimed, strict=True):
            for match in pattern.finditer(text):
                if any(match.start() < end and start < match.end() for start, end in spans):
                    continue
                spans.append(match.span())
                values[match.group(0)] += 1
                offsets.append(match.start() / max(1, len(text)))
        if len(values) >= 2 and len(offsets) >= 2:
            found.append({"field": kind, "distinct_values": len(values), "occurrences": sum(values.values()),
                          "examples": [v for v, _ in values.most_common(3)],
                          "median_position": round(statistics.median(offsets), 3)})
    return sorted(found, key=lambda f: f["median_position"])


def divergences(texts: list[str], tokenizer: Tokenizer) -> list[dict]:
    """For each prompt, the earlier prompt sharing the longest text prefix, and where they part."""
    rows = []
    for i, text in enumerate(texts[1:], start=1):
        j = max(range(i), key=lambda k: common_prefix_length(texts[k], text))
        at = common_prefix_length(texts[j], text)
        rows.append({"prompt": i, "closest_earlier": j, "diverges_at_char": at,
                     "diverges_at_token": len(tokenizer.encode(text[:at])),
                     "fraction": round(at / max(1, len(text)), 3),
                     "context": text[max(0, at - 30): at + 30]})
    return rows


def load_tokenizer(config: Config) -> tuple[Tokenizer, str]:
    """The configured model's tokenizer and a weights fingerprint for block keys, without loading weights."""
    model_path = resolve_model_path(config.model.path or None)
    fingerprint = cached_sha256([model_path] if model_path.is_file() else sorted(model_path.glob("*.safetensors")))
    return Tokenizer.load(model_path, fingerprint, config.model.chat_template or None), fingerprint


def analyze(prompts: list[str | list[dict]], config: Config) -> dict:
    tokenizer, fingerprint = load_tokenizer(config)
    normalize = config.cache.normalize_input
    texts = [render(tokenizer, p, normalize) for p in prompts]
    token_lists = [tokenize(tokenizer, p, normalize) for p in prompts]
    args = load_model_info(config.model.path or None).args
    as_configured = replay(token_lists, config, fingerprint, segments=config.cache.suffix.enabled, args=args)
    with_segments = replay(token_lists, config, fingerprint, segments=True, args=args)
    other = replay([tokenize(tokenizer, p, not normalize) for p in prompts], config, fingerprint,
                   segments=config.cache.suffix.enabled, args=args)
    normalized, raw = (as_configured, other) if normalize else (other, as_configured)
    fields = find_dynamic_fields(texts)
    splits = divergences(texts, tokenizer)
    report = {
        "prompts": len(prompts), "prompt_tokens": as_configured.prompt_tokens,
        "block_size": config.cache.block_size, "normalize_input": normalize,
        "segment_reuse": config.cache.suffix.enabled,
        "hit_rate": round(as_configured.hit_rate, 4),
        "segment_rate": round(as_configured.approximate_hit_rate, 4),
        "hit_rate_with_segment_reuse": round(with_segments.hit_rate + with_segments.approximate_hit_rate, 4),
        "hit_rate_normalized": round(normalized.hit_rate, 4), "hit_rate_raw": round(raw.hit_rate, 4),
        "dynamic_fields": fields,
        "median_divergence_fraction": statistics.median(r["fraction"] for r in splits) if splits else None,
        "divergences": sorted(splits, key=lambda r: r["fraction"])[:5],
    }
    report["advice"] = advice(report)
    return report


def advice(r: dict) -> list[str]:
    tips = []
    early = [f for f in r["dynamic_fields"] if f["median_position"] < 0.8]
    if early:
        names = ", ".join(f"{f['field']} (e.g. {f['examples'][0]!r}, at {f['median_position']:.0%} of the prompt)"
                          for f in early)
        tips.append(f"Dynamic fields break sharing before the end of the prompt: {names}. Move them to the "
                    "tail of the prompt (after the fixed instructions and documents), or drop them.")
    gain = r["hit_rate_normalized"] - r["hit_rate_raw"]
    if gain >= 0.02 and not r["normalize_input"]:
        tips.append(f"Whitespace, line endings or full-width characters differ between equal-looking prompts: "
                    f"cache.normalize_input = true would raise the hit rate from {r['hit_rate_raw']:.0%} to "
                    f"{r['hit_rate_normalized']:.0%}.")
    if r["median_divergence_fraction"] is not None and r["median_divergence_fraction"] < 0.2:
        tips.append(f"Near-duplicate prompts part early (median at {r['median_divergence_fraction']:.0%} of the "
                    "prompt): the template puts variable text first. Put the fixed system prompt, tool "
                    "descriptions and rubric first and the varying part last.")
    if r["hit_rate_with_segment_reuse"] - r["hit_rate"] >= 0.1 and not r["segment_reuse"]:
        tips.append(f"Shared text sits after varying text: segment reuse (cache.suffix.enabled = true) would reuse "
                    f"{r['hit_rate_with_segment_reuse']:.0%} of prompt tokens instead of {r['hit_rate']:.0%} "
                    "(approximate: see docs/features/segment-reuse.md), or reorder the prompt so it becomes a prefix.")
    if not tips:
        tips.append("No obvious problem: prompts share what they can at this block size.")
    return tips


def text_report(r: dict) -> str:
    lines = [f"{r['prompts']} prompts, {r['prompt_tokens']} tokens, block_size {r['block_size']}",
             f"exact prefix hit rate: {r['hit_rate']:.1%}" + (f"   segment reuse: {r['segment_rate']:.1%}"
                                                              if r["segment_reuse"] else ""),
             f"with normalize_input: {r['hit_rate_normalized']:.1%}   without: {r['hit_rate_raw']:.1%}",
             f"with segment reuse (exact + approximate): {r['hit_rate_with_segment_reuse']:.1%}", ""]
    if r["dynamic_fields"]:
        lines.append("fields that differ across prompts:")
        lines += [f"  {f['field']:<9} {f['distinct_values']} values, e.g. {', '.join(map(repr, f['examples']))}; "
                  f"median position {f['median_position']:.0%}" for f in r["dynamic_fields"]]
        lines.append("")
    if r["divergences"]:
        lines.append("earliest divergences from the closest earlier prompt:")
        lines += [f"  prompt {d['prompt']} vs {d['closest_earlier']}: token {d['diverges_at_token']} "
                  f"({d['fraction']:.0%}) ...{d['context']!r}..." for d in r["divergences"]]
        lines.append("")
    lines.append("advice:")
    lines += [f"  - {tip}" for tip in r["advice"]]
    return "\n".join(lines)
