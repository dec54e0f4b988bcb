"""KV cache events in vLLM's wire format (``vllm/distributed/kv_events.py``, reproduced here, not imported), so
routers and indexers built for vLLM can follow which blocks a replica holds.

Wire format. A PUB socket bound at ``[events] endpoint`` sends one multipart message per batch:
``[topic, seq, payload]``: topic is ``[events] topic`` in UTF-8, seq an 8-byte big-endian counter from 0 (+1 per batch),
payload a msgpack ``KVEventBatch``, an array ``[ts, [event, ...]]`` whose events are arrays tagged by class name:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]`` and ``["AllBlocksCleared"]``. On a grouped pool (a sliding-window model
with ``cache.sliding_kv = window``) every event also names its layer group, in vLLM's later fields:
``BlockStored`` gains ``lora_name`` (None), ``extra_keys`` (None), ``group_idx``, ``kv_cache_spec_kind``
("full_attention" or "sliding_window") and ``kv_cache_spec_sliding_window`` (the window, or None), and
``BlockRemoved`` gains ``group_idx``. A sliding-window block carries its position's chain key and parent, as the
full-attention block there does: it is that block's window K/V, announced after it and removed no later. A subscriber
that reads only the first fields sees it as a second announcement of that key, so it should keep group 0's keys
(``group_idx`` absent or 0) for routing. A hash is the block's 32-byte sha256 chain
key (bytes; with ``int_hashes``, its low 64 bits as an int, as vLLM sends by default): it covers the block's tokens,
every token before it, the model fingerprint, the block size and the cache salt. ``parent_block_hash`` is the key of
the block before it (None: the first block of a sequence). ``medium`` is "GPU" or "CPU" for the pool.
A ROUTER socket at ``replay_endpoint`` answers a request whose last frame is an 8-byte big-endian seq with every
kept batch from that seq on, each ``[b"", seq, payload]``, then ``[b"", (-1 as 8 signed bytes), b""]``: a DEALER
sends ``[b"", start]`` (a REQ socket takes one reply per request, so it would see only the first batch). The last
``buffer_steps`` batches are kept; a request is answered within one flush interval.

A router subscribes to the topic and keeps, per replica, the set of keys: add on BlockStored, discard on BlockRemoved,
empty on AllBlocksCleared (sent when the engine starts, so a restarted replica starts empty). On a seq gap it replays
from its last seq + 1; if the first batch replayed is later than that, the gap is older than the buffer and it
empties its view of that replica. A request goes to the replica holding the longest leading run of its chain keys
(computed as ``hashing.sha256_block_key`` does, or matched by token_ids along the parent chain).

Events are not authenticated and carry every tenant's token ids: whoever can connect reads every prompt. Nothing
is bound unless configured; an endpoint beyond the loopback interface is logged as a warning at start.

The engine thread never waits: pool listeners put events into a bounded queue, and one publisher thread, the only
one that touches the sockets, sends what accumulated every ``flush_interval_s`` (or at once on ``flush``) as one
batch. Events that do not fit
are dropped and counted, and a later batch ends with AllBlocksCleared, so a subscriber's view stays a subset of the
truth: it may forget blocks, it never keeps one that is gone.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec

from kvreuse.config import EventsConfig
from kvreuse.extras import require
from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.block_pool import BlockPool

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def is_local(endpoint: str) -> bool:
    """Whether a bound ZMQ endpoint is reachable only from this machine: ipc, inproc, or tcp on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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


# A grouped pool's events: the same tags with vLLM's later fields (msgspec writes an array-like struct's defaults, so a
# one-group pool keeps the shorter structs above and its wire format).
class GroupBlockStored(BlockStored, tag="BlockStored"):
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"  # or "sliding_window"
    kv_cache_spec_sliding_window: int | None = None


class GroupBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    group_idx: int = 0


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def low64(key: bytes) -> int:
    """vLLM's int form of a hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): its last 8 bytes, big-endian."""
    return int.from_bytes(key[-8:], "big")


class KVEventPublisher:
    def __init__(self, config: EventsConfig, block_size: int, medium: str, *, flush_interval_s: float = 0.01,
                 max_queue_events: int = 100_000, hwm: int = 100_000, int_hashes: bool = False,
                 windows: tuple[int | None, ...] = (None,)):
        self.block_size, self.medium = block_size, medium
        self.windows = windows  # of each layer group (None: full attention); one group sends no group fields
        self.flush_interval_s, self.max_queue_events = flush_interval_s, max_queue_events
        self._hash = low64 if int_hashes else bytes
        self.num_batches = self.num_events = self.num_dropped = 0
        self._topic = config.topic.encode()
        self._pending: deque[KVCacheEvent] = deque()        # engine threads append, the publisher pops
        # uid -> chain key and parent key of the blocks announced and not evicted
        self._keys: dict[int, tuple[bytes, bytes | None]] = {}
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # (seq, payload) for replay
        self._seq = 0
        self._drop_lock = threading.Lock()
        self._cond = threading.Condition()
        self._asked = self._done = 0                         # flush requests made / served
        self._closing, self._closed = False, False
        self._wake = threading.Event()                       # set by flush and close: send now
        zmq = require("zmq", "events", "events.endpoint")
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, where it was "*"
            self.replay_endpoint = ""
            if config.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            for endpoint in filter(None, (self.endpoint, self.replay_endpoint)):
                if not is_local(endpoint):
                    logger.warning("KV events bound at %s, beyond this machine's loopback: they carry every "
                                   "tenant's token ids, unauthenticated (bind tcp://127.0.0.1:PORT unless "
                                   "subscribers elsewhere need them)", endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvreuse-kv-events", daemon=True)
        self._thread.start()

    # --- producers: never block, never raise (attach and the listeners on the pool's thread, the rest any) -----
    def attach(self, pool: BlockPool) -> None:
        """Announce the pool's cached blocks (parents first) and follow its registrations and evictions."""
        for block in sorted(pool.key_to_block.values(), key=lambda b: b.uid):
            self._on_register(block)
        pool.on_register.append(self._on_register)
        pool.on_evict.append(self._on_evict)

    def _on_register(self, block: KVCacheBlock) -> None:
        if block.group:
            # A sliding-window group's block, found through the full-attention block of its position (its parent):
            # announced under that block's keys, with its group.
            anchor = self._keys.get(block.parent_uid)
            if anchor is None:
                return
            key, parent = anchor
        else:
            key, parent = block.block_key, None
            if block.parent_uid is not None:
                parent = self._keys.get(block.parent_uid, (None,))[0]
                if parent is None:
                    # Its predecessor was evicted before it was published (it continued a concurrent twin's chain): no
                    # prefix lookup can reach it, so it is not announced (nor its removal, nor its successors).
                    return
        self._keys[block.uid] = key, parent
        parent_hash = None if parent is None else self._hash(parent)
        fields = ([self._hash(key)], parent_hash, list(block.token_ids), self.block_size, None, self.medium)
        if len(self.windows) == 1:
            self._put(BlockStored(*fields))
            return
        window = self.windows[block.group]
        self._put(GroupBlockStored(*fields, group_idx=block.group, kv_cache_spec_sliding_window=window,
                                   kv_cache_spec_kind="full_attention" if window is None else "sliding_window"))

    def _on_evict(self, block: KVCacheBlock) -> None:
        announced = self._keys.pop(block.uid, None)
        if announced is None:
            return
        fields = ([self._hash(announced[0])], self.medium)
        grouped = len(self.windows) > 1
        self._put(GroupBlockRemoved(*fields, group_idx=block.group) if grouped else BlockRemoved(*fields))

    def all_cleared(self) -> None:
        """Tell subscribers to forget every block of this replica (engine start)."""
        self._put(AllBlocksCleared())

    def _put(self, event: KVCacheEvent) -> None:
        if len(self._pending) < self.max_queue_events and not self._closing:
            self._pending.append(event)
        else:
            with self._drop_lock:
                self.num_dropped += 1

    # --- control -------------------------------------------------------------------------------------
    def flush(self, timeout: float | None = 1.0) -> bool:
        """Send now, and wait until the events put so far are sent; False on timeout. Not for the engine's hot
        path: batches go out every `flush_interval_s` anyway."""
        with self._cond:
            self._asked += 1
            target = self._asked
            self._wake.set()
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread, close the sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the KV event publisher did not stop within %.1f s; its sockets stay open", timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def snapshot(self) -> dict[str, int]:
        return {"batches_sent": self.num_batches, "events_sent": self.num_events, "events_dropped": self.num_dropped,
                "events_queued": len(self._pending)}

    # --- the publisher thread ------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        dropped_seen = 0
        while True:
            try:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                with self._cond:
                    asked, closing = self._asked, self._closing
                dropped = self.num_dropped
                events = [self._pending.popleft() for _ in range(len(self._pending))]
                if dropped != dropped_seen:  # events were lost before this point: subscribers must forget
                    dropped_seen = dropped
                    events.append(AllBlocksCleared())
                if events:
                    self._send(encoder, events)
                with self._cond:
                    self._done = asked
                    self._cond.notify_all()
                if closing:
                    return
            except Exception:  # the engine must not notice; what was being sent is lost, so subscribers must forget
                logger.exception("the KV event publisher failed; continuing")
                with self._drop_lock:
                    self.num_dropped += 1
                time.sleep(self.flush_interval_s)

    def _send(self, encoder: msgspec.msgpack.Encoder, events: list[KVCacheEvent]) -> None:
        payload = encoder.encode(KVEventBatch(time.time(), events))
        seq, self._seq = self._seq, self._seq + 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))  # past the HWM a subscriber loses it
        self._buffer.append((seq, payload))
        self.num_batches += 1
        self.num_events += len(events)

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                logger.warning("invalid KV event replay request: %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
