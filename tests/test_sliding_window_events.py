"""KV events of a grouped pool (kvcache/layout.py) in vLLM's later fields: every block names its layer group, kind and
window; a sliding-window block carries its position's chain key and parent. Decoded with an independent copy of
vLLM's current schema, and with the older six-field one, which still reads them."""

from __future__ import annotations

from typing import Any

import msgspec

from .helpers import greedy
from .test_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Subscriber
from .test_sliding_window_cache import BLOCK, WINDOW, engine, tokens


class GroupBlockStored(BlockStored, tag="BlockStored"):  # vLLM's BlockStored with its later fields
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class GroupBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class GroupKVEventBatch(EventBatch):
    events: list[GroupBlockStored | GroupBlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=GroupKVEventBatch)


def received(sub: Subscriber) -> tuple[list, list]:
    """The events sent since the subscriber last received, decoded with the six-field schema and with the group one."""
    first = sub.last_seq + 1
    old_schema = sub.receive()
    return old_schema, [e for seq in range(first, sub.last_seq + 1) for e in DECODER.decode(sub.payloads[seq]).events]


def test_a_grouped_pool_names_each_blocks_group_in_vllms_fields(grouped_gemma_dir, zmq_context):
    llm = engine(grouped_gemma_dir, events__endpoint="tcp://127.0.0.1:*")
    try:
        sub = Subscriber(zmq_context, llm.engine.events)
        sub.sync()
        prompt = tokens(7 * BLOCK + 3, 31)
        llm.generate(prompt, greedy(2))
        old_schema, events = received(sub)
        assert len(events) == len(old_schema)
        assert all(isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)) for e in old_schema)

        manager = llm.engine.kv_manager
        req = manager.new_request(prompt)
        keys = [manager._key(req, i) for i in range(len(prompt) // BLOCK)]
        stored = [e for e in events if isinstance(e, GroupBlockStored)]
        full = [e for e in stored if e.group_idx == 0]
        assert [e.block_hashes[0] for e in full] == keys
        assert all(e.kv_cache_spec_kind == "full_attention" and e.kv_cache_spec_sliding_window is None for e in full)
        windows = [e for e in stored if e.group_idx]
        assert {e.group_idx for e in windows} == {1, 2}
        assert all(e.kv_cache_spec_kind == "sliding_window" and e.kv_cache_spec_sliding_window == WINDOW
                   for e in windows)
        announced: set[bytes] = set()
        for e in stored:  # a window block: its position's key and parent, announced after that position's block
            (key,) = e.block_hashes
            i = keys.index(key)
            assert e.parent_block_hash == (keys[i - 1] if i else None)
            assert e.token_ids == prompt[i * BLOCK:(i + 1) * BLOCK]
            assert (key in announced) == bool(e.group_idx)
            announced.add(key)
        pool = {(b.block_key[:32], b.group) for b in manager.pool.key_to_block.values()}
        assert {(e.block_hashes[0], e.group_idx) for e in stored} == pool

        llm.engine.reset_prefix_cache()
        removed = [e for e in received(sub)[1] if isinstance(e, GroupBlockRemoved)]
        assert {(e.block_hashes[0], e.group_idx) for e in removed} == pool
    finally:
        llm.engine.close()
