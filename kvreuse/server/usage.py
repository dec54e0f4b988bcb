"""The `usage` object of a completion (and of the last chunk of a stream with `include_usage`)."""

from __future__ import annotations

from kvreuse.engine.output import RequestOutput
from kvreuse.kvcache.accounting import ReuseRecord


def usage(out: RequestOutput) -> dict:
    """OpenAI's token counts; `prompt_tokens_details` carries every field of the reuse record beside
    `cached_tokens` (exact prefix hits), whose origin `cached_tokens_details` splits (memory, disk, redis).
    `computed_prompt_tokens` also stays at the top, where clients read it. Behind `kvreuse serve --replicas N`,
    `replica` names the replica that computed the request."""
    u = out.usage
    details = {name: getattr(u, name) for name in ReuseRecord.field_names()
               if name not in ("prompt_tokens", "cached_tokens_disk", "cached_tokens_redis")}
    details["cached_tokens_details"] = u.cached_by_tier()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": details,
            "computed_prompt_tokens": u.computed_prompt_tokens, **({"replica": out.replica} if out.replica else {})}
