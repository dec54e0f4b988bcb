"""Scenario presets (`cache.preset`, `--preset`): `[cache]` keys set first, as INI text, before the file's and
`--set`'s own; and what each preset is for, shown in docs/configuration.md."""

from __future__ import annotations

# The article's scenario advice as presets (chat, eval and agent are its advice; rag is ours). A preset sets these
# keys first; keys written explicitly (in the file or with --set) override it, wherever they appear.
# Segment reuse is on where the scenario bench (docs/benchmarks.md, "Scenarios") shows it pays within the fidelity
# thresholds (top-1 >= 0.9, KL <= 0.03): on the eval rubric the guard never changed an answer and only added
# work, so it is off there; agent steps are cheap to repair (recompute 10%), RAG documents need 30%.
# The policy is measured, not the article's (lru for chat, lfu for eval): docs/bench/preset-policies.md.
PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    "chat": {"block_size": "16", "policy": "learned"},
    "eval": {"block_size": "32", "policy": "learned", "suffix.enabled": "true", "suffix.guard_margin": "0"},
    "agent": {"block_size": "16", "policy": "learned", "normalize_input": "true", "suffix.enabled": "true",
              "suffix.recompute_ratio": "0.1"},
    "rag": {"block_size": "16", "policy": "learned", "suffix.enabled": "true", "suffix.recompute_ratio": "0.3"},
}
# What each preset is for (docs/configuration.md shows these beside the keys).
PRESET_DESCRIPTIONS: dict[str, str] = {
    "none": "No preset: every key keeps its default.",
    "chat": "Multi-turn chat: short repeated turns with recent hot spots; the shared part is a prefix, so segment "
            "reuse stays off.",
    "eval": "Batch evaluation: a long fixed rubric after varying text, a fixed hot spot reached only by segment "
            "reuse; the guard is off, since on this workload it never changed an answer and only added work.",
    "agent": "Agent steps: tool output with formatting noise before fixed tool rules; segment reuse recomputing 10%.",
    "rag": "RAG: the same documents in varying positions; segment reuse recomputing 30%.",
}
