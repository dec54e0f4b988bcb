"""KV cache events (kvreuse/kvcache/events.py) over real ZMQ sockets on 127.0.0.1, decoded with an independent copy
of vLLM's schema: what a KVCacheManager registers and evicts, seq numbers and replay, topics, and an engine thread
that never waits."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from kvreuse.config import EventsConfig
from kvreuse.kvcache.block_pool import BlockPool
from kvreuse.kvcache.events import KVEventPublisher, low64
from kvreuse.kvcache.manager import KVCacheManager


# vLLM's schema, as its example subscriber (examples/online_serving/kv_events_subscriber.py) copies it, with the hash
# type of vLLM's ExternalBlockHash (bytes | int); independent of kvreuse's structs, to prove wire compatibility.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The older example subscriber's hash type: integers only (vLLM's default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
class IntBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class IntKVEventBatch(EventBatch):
    events: list[IntBlockStored | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BS = 4
WAIT_MS = 5000  # bound on any one wait for a message that must come


@pytest.fixture
def make_publisher():
    made: list[KVEventPublisher] = []

    def make(replay: bool = True, topic: str = "kv-events", buffer_steps: int = 10_000, **kwargs) -> KVEventPublisher:
        config = EventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*" if replay else "",
                              topic=topic, buffer_steps=buffer_steps)
        made.append(KVEventPublisher(config, BS, "CPU", **kwargs))
        return made[-1]

    yield make
    for publisher in made:
        publisher.close()


class Subscriber:
    """A SUB socket that follows one publisher, checks seq numbers and keeps the view a router would."""

    def __init__(self, zmq_context: zmq.Context, publisher: KVEventPublisher, topic: str = "kv-events"):
        self.sock = zmq_context.socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(publisher.endpoint)
        self.publisher, self.topic = publisher, topic.encode()
        self.last_seq = -1
        self.view: set[bytes | int] = set()
        self.payloads: dict[int, bytes] = {}

    def sync(self) -> None:
        """Wait until the subscription is in place (ZMQ's slow joiner), as the engine's start does: AllBlocksCleared
        until one arrives."""
        deadline = time.monotonic() + WAIT_MS / 1000
        while not self.sock.poll(50):
            assert time.monotonic() < deadline, "the subscription never took"
            self.publisher.all_cleared()
            assert self.publisher.flush()
        self.last_seq = self._recv()[0]
        self.receive()

    def _recv(self) -> tuple[int, bytes]:
        topic, seq_bytes, payload = self.sock.recv_multipart()
        assert topic == self.topic and len(seq_bytes) == 8
        return int.from_bytes(seq_bytes, "big"), payload

    def receive(self) -> list[Any]:
        """Every event sent so far, in order; seq numbers go up by exactly 1 per batch."""
        assert self.publisher.flush()
        events = []
        while self.last_seq < self.publisher.num_batches - 1:
            assert self.sock.poll(WAIT_MS), f"batch {self.last_seq + 1} never came"
            seq, payload = self._recv()
            assert seq == self.last_seq + 1
            self.last_seq = seq
            self.payloads[seq] = payload
            batch = DECODER.decode(payload)
            assert abs(batch.ts - time.time()) < 60
            events += batch.events
        for event in events:
            if isinstance(event, BlockStored):
                self.view.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.view.difference_update(event.block_hashes)
            else:
                self.view.clear()
        return events


def admit_and_compute(mgr: KVCacheManager, tokens) -> Any:
    req = mgr.new_request(list(tokens))
    match = mgr.match(req)
    mgr.admit(req, match, req.num_tokens - match.num_cached_tokens)
    mgr.update(req, req.num_tokens)
    return req


def stored(keys: list[bytes], parent: bytes | None, tokens: list[int]) -> BlockStored:
    return BlockStored(keys, parent, tokens, BS, None, "CPU")


# --------------------------------------------------------------------------------------------------------


def test_manager_blocks_are_stored_chained_and_removed(make_publisher, zmq_context):
    mgr = KVCacheManager(8, BS)
    publisher = make_publisher()
    publisher.attach(mgr.pool)
    sub = Subscriber(zmq_context, publisher)
    sub.sync()

    first = admit_and_compute(mgr, range(1, 14))               # 13 tokens: 3 full blocks
    k = first.tables.block_keys
    assert sub.receive() == [stored([k[0]], None, [1, 2, 3, 4]), stored([k[1]], k[0], [5, 6, 7, 8]),
                             stored([k[2]], k[1], [9, 10, 11, 12])]
    second = admit_and_compute(mgr, list(range(1, 9)) + [50, 51, 52, 53, 54])  # shares 2 blocks, then its own
    assert second.tables.block_keys[:2] == k[:2]
    assert sub.receive() == [stored([second.tables.block_keys[2]], k[1], [50, 51, 52, 53])]
    assert sub.view == set(mgr.pool.key_to_block)

    # The raw layout, without any schema: [ts, [[tag, fields...], ...]].
    ts, raw = msgspec.msgpack.decode(sub.payloads[sub.last_seq])
    assert isinstance(ts, float) and raw == [["BlockStored", [second.tables.block_keys[2]], k[1], [50, 51, 52, 53], BS,
                                              None, "CPU"]]

    mgr.free(first)
    mgr.free(second)
    assert sub.receive() == []                                 # cached, not evicted: nothing to say
    third = admit_and_compute(mgr, range(100, 130))            # 30 tokens: the whole pool, evicting all 4
    events = sub.receive()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted([*k[:3], second.tables.block_keys[2]])
    assert all(e.medium == "CPU" and len(e.block_hashes) == 1 for e in removed)
    third_keys = third.tables.block_keys
    assert [e for e in events if isinstance(e, BlockStored)] == [
        stored([third_keys[i]], third_keys[i - 1] if i else None, list(range(100 + 4 * i, 104 + 4 * i)))
        for i in range(7)]
    assert sub.view == set(mgr.pool.key_to_block) == set(third.tables.block_keys[:7])

    mgr.free(third)
    assert mgr.pool.reset_cache() == 7
    events = sub.receive()
    assert events == [BlockRemoved([key], "CPU") for key in reversed(third.tables.block_keys[:7])]  # tail first
    assert sub.view == set(mgr.pool.key_to_block) == set()
    assert publisher.num_dropped == 0
    assert publisher.snapshot() == {"batches_sent": sub.last_seq + 1, "events_sent": publisher.num_events,
                                    "events_dropped": 0, "events_queued": 0}


def test_unreachable_blocks_are_not_announced(make_publisher, zmq_context):
    """A block that continues a concurrent twin's chain after the twin was evicted can never be found by a prefix
    lookup: it is not announced, nor is its removal."""
    mgr = KVCacheManager(32, BS)
    publisher = make_publisher()
    publisher.attach(mgr.pool)
    sub = Subscriber(zmq_context, publisher)
    sub.sync()
    s1, s2 = mgr.new_request(list(range(1, 10))), mgr.new_request(list(range(1, 10)))
    for req in (s1, s2):
        mgr.admit(req, mgr.match(req), req.num_tokens)
    for req in (s1, s2):
        mgr.update(req, req.num_tokens)
    assert len(sub.receive()) == 2                               # s1's two blocks; s2's are private twins
    mgr.free(s1)
    mgr.pool.reset_cache()                                       # s1's blocks go; s2 still chains on their uids
    assert len(sub.receive()) == 2 and sub.view == set()
    s2.token_ids += [10, 11, 12]
    mgr.allocate(s2, s2.num_tokens)
    mgr.update(s2, s2.num_tokens)
    assert set(mgr.pool.key_to_block) == {s2.tables.block_keys[2]}     # registered under a dead parent uid...
    assert mgr.match_prefix(mgr.new_request(list(range(1, 14)))) == []  # ...so unreachable
    assert sub.receive() == [] and sub.view == set()
    mgr.free(s2)
    mgr.pool.reset_cache()
    assert sub.receive() == [] and not mgr.pool.key_to_block


def test_seq_numbers_and_replay(make_publisher, zmq_context):
    publisher = make_publisher()
    pool = BlockPool(8)
    publisher.attach(pool)
    live = Subscriber(zmq_context, publisher)
    live.sync()
    for i, block_id in enumerate(pool.allocate(5)):             # one batch per block
        pool.register(block_id, bytes([i]) * 32, [i] * BS, None)
        assert len(live.receive()) == 1
    total = publisher.num_batches
    assert live.last_seq == total - 1 and len(live.payloads) >= 5

    late = zmq_context.socket(zmq.DEALER)
    late.connect(publisher.replay_endpoint)

    def replay(start: int) -> list[tuple[int, bytes]]:
        late.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert late.poll(WAIT_MS), "the replay never ended"
            empty, seq_bytes, payload = late.recv_multipart()
            assert empty == b""
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                return got
            got.append((int.from_bytes(seq_bytes, "big"), payload))

    everything = replay(0)
    assert [seq for seq, _ in everything] == list(range(total))
    for seq, payload in everything:
        if seq in live.payloads:
            assert payload == live.payloads[seq]                 # the very bytes the live subscriber got
    assert [e.block_hashes for _, p in everything[-5:] for e in DECODER.decode(p).events] == [
        [bytes([i]) * 32] for i in range(5)]
    assert [seq for seq, _ in replay(total - 2)] == [total - 2, total - 1]
    assert replay(total) == []

    # A REQ socket (as vLLM's example subscriber uses) sends the same request; it takes the first reply only.
    req = zmq_context.socket(zmq.REQ)
    req.connect(publisher.replay_endpoint)
    req.send((total - 1).to_bytes(8, "big"))
    assert req.poll(WAIT_MS) and req.recv_multipart() == [(total - 1).to_bytes(8, "big"), live.payloads[total - 1]]


def test_replay_keeps_the_last_buffer_steps_batches(make_publisher, zmq_context):
    publisher = make_publisher(buffer_steps=3)
    for _ in range(6):
        publisher.all_cleared()
        assert publisher.flush()
    assert publisher.num_batches == 6
    late = zmq_context.socket(zmq.DEALER)
    late.connect(publisher.replay_endpoint)
    late.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    for _ in range(4):
        assert late.poll(WAIT_MS)
        seqs.append(int.from_bytes(late.recv_multipart()[1], "big", signed=True))
    assert seqs == [3, 4, 5, -1]                                 # a router sees 3 > 0: the gap is lost, it resets


def test_engine_thread_never_waits_and_drops_are_counted(make_publisher):
    """No subscriber, a queue of 10 events, no flush for a minute: 20,000 registrations return at once, 19,990
    events are dropped, and the batch that finally goes out ends with AllBlocksCleared."""
    publisher = make_publisher(replay=False, max_queue_events=10, flush_interval_s=60)
    pool = BlockPool(20_000)
    publisher.attach(pool)
    began = time.perf_counter()
    for i, block_id in enumerate(pool.allocate(20_000)):
        pool.register(block_id, i.to_bytes(32, "big"), [i] * BS, None)
    assert time.perf_counter() - began < 2.0
    assert publisher.num_dropped == 19_990 and publisher.num_batches == 0
    began = time.perf_counter()
    publisher.close()
    assert time.perf_counter() - began < 2.0
    assert publisher.num_batches == 1 and publisher.num_events == 11
    pool.free([1])  # the first block allocated (0 is the null block)
    assert pool.reset_cache() == 1                              # an eviction after close: dropped, never raised
    publisher.all_cleared()
    assert publisher.num_dropped == 19_992 and publisher.num_batches == 1


def test_drops_end_in_all_blocks_cleared(make_publisher, zmq_context):
    publisher = make_publisher(replay=False, max_queue_events=3, flush_interval_s=60)
    pool = BlockPool(10)
    publisher.attach(pool)
    sub = Subscriber(zmq_context, publisher)
    sub.sync()
    ids = pool.allocate(10)
    for i, block_id in enumerate(ids[:5]):
        pool.register(block_id, bytes([i]) * 32, [i] * BS, None)
    events = sub.receive()
    assert [type(e) for e in events] == [BlockStored] * 3 + [AllBlocksCleared]
    assert publisher.num_dropped == 2
    assert sub.view == set() and sub.view <= set(pool.key_to_block)   # it forgot; it never keeps what is gone
    pool.register(ids[5], bytes([5]) * 32, [5] * BS, None)
    assert sub.receive() == [stored([bytes([5]) * 32], None, [5] * BS)]


def test_topic_filtering(make_publisher, zmq_context):
    publisher = make_publisher(topic="replica-a")
    right = Subscriber(zmq_context, publisher, "replica-a")
    wrong = Subscriber(zmq_context, publisher, "replica-b")
    everything = zmq_context.socket(zmq.SUB)
    everything.setsockopt(zmq.SUBSCRIBE, b"")
    everything.connect(publisher.endpoint)
    time.sleep(0.2)                                              # the three subscriptions travel together
    right.sync()
    publisher.all_cleared()
    assert right.receive() == [AllBlocksCleared()]
    assert everything.poll(WAIT_MS) and everything.recv_multipart()[0] == b"replica-a"
    assert not wrong.sock.poll(300)


def test_int_hashes_and_attach(make_publisher, zmq_context):
    """`int_hashes` sends vLLM's default int hashes, which the older integer-only schema decodes; `attach` announces
    the blocks already cached, parents first."""
    pool = BlockPool(4)
    ids = pool.allocate(3)
    keys = [bytes(range(i, i + 32)) for i in range(3)]
    uid = None
    for block_id, key, n in zip(ids, keys, range(3), strict=True):
        uid = pool.register(block_id, key, [n] * BS, uid)
    publisher = make_publisher(int_hashes=True, flush_interval_s=60)  # a batch goes out on flush only
    sub = Subscriber(zmq_context, publisher)
    sub.sync()
    publisher.attach(pool)
    h = [low64(key) for key in keys]
    assert h[0] == int.from_bytes(keys[0], "big") & (2**64 - 1)       # vLLM's maybe_convert_block_hash
    assert sub.receive() == [BlockStored([h[0]], None, [0] * BS, BS, None, "CPU"),
                             BlockStored([h[1]], h[0], [1] * BS, BS, None, "CPU"),
                             BlockStored([h[2]], h[1], [2] * BS, BS, None, "CPU")]
    batch = msgspec.msgpack.Decoder(type=IntKVEventBatch).decode(sub.payloads[sub.last_seq])
    assert [e.block_hashes for e in batch.events] == [[h[0]], [h[1]], [h[2]]]


def test_an_engine_publishes_its_pool(tiny_model_dir, zmq_context):
    """The engine with `[events] endpoint`: a subscriber's view is the pool's registered keys, chained as computed."""
    from kvreuse.sampling_params import SamplingParams

    from .helpers import tiny_llm

    llm = tiny_llm(tiny_model_dir, engine__num_kv_blocks=64,
                   events__endpoint="tcp://127.0.0.1:*", events__replay_endpoint="tcp://127.0.0.1:*")
    publisher = llm.engine.events
    try:
        sub = Subscriber(zmq_context, publisher)
        sub.sync()
        prompt = "Every harbour keeps a log of the ships that enter and the cargo they carry. " * 6
        llm.generate(prompt, SamplingParams(max_tokens=4))
        events = sub.receive()
        manager = llm.engine.kv_manager
        req = manager.new_request(llm.tokenizer.encode(prompt))
        keys = [manager._key(req, i) for i in range(req.num_tokens // manager.block_size)]
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes][:len(keys)] == keys
        assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == keys[0]
        assert sub.view == set(manager.pool.key_to_block)
        llm.engine.reset_prefix_cache()
        sub.receive()
        assert sub.view == set(manager.pool.key_to_block) == set()
        assert llm.engine.stats_snapshot().events["events_dropped"] == 0
    finally:
        llm.engine.close()
