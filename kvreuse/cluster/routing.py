"""Which replica a request goes to: the decision alone, without Ray or a model (router.py adapts it to Ray Serve).

`cache_aware` is SGLang's router policy on our own block keys. Each replica's holdings are known approximately: the
chain keys of the prompts this router sent it (a bounded LRU per replica, updated on every routing), corrected by
what the replica reports (`Holdings`: the keys its pool holds, as of a time): a key sent before that report and
absent from it was evicted. A request goes to the replica holding its longest cached prefix when that prefix is at
least `cache_threshold` of its blocks, unless the load is unbalanced (max - min in flight > `balance_abs` and
max > `balance_rel` x min); otherwise to the least loaded replica (ties: the one holding fewest blocks, so new
conversations spread out). A request that names its session (`prompt_cache_key`, within its salt) goes where the
session's last request went, unless the load is unbalanced or that replica is gone: its retained blocks are there
(kvcache/retention.py), and a session whose prompt starts like every other's (one agent's tools) is not sent where
the shared prefix happens to be. Keys are shortened to KEY_BYTES: a collision only misroutes, it never serves wrong
KV (the replica's pool confirms every hit by its tokens).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.kvcache.hashing import extend_chain, extra_keys

KEY_BYTES = 8
# A key sent less than this long before a replica's report may belong to a request that had not yet computed its
# prompt when the report was taken: its absence from the report is no evidence of eviction.
REPORT_SLACK_S = 10.0


def session_of(salt: str | None, session_key: str | None) -> str | None:
    """A request's session as the router keys it: its prompt_cache_key within its salt (None: it names none)."""
    return None if session_key is None else f"{salt or ''}\x00{session_key}"


def chain_keys(token_ids: Sequence[int], fingerprint: str, block_size: int, salt: str | None) -> list[bytes]:
    """The (shortened) chain keys of the full blocks of a prompt: the engine's keys, salt included."""
    extra = extra_keys(fingerprint, block_size, salt)
    keys = extend_chain([], token_ids, block_size, extra, len(token_ids) // block_size)
    return [key[:KEY_BYTES] for key in keys]


@dataclass(frozen=True)
class Holdings:
    """What a replica reported holding: the shortened keys of its pool's registered blocks, as of `time`."""
    keys: frozenset[bytes]
    time: float

    @classmethod
    def from_stats(cls, stats: dict | None) -> Holdings | None:
        """From a replica's routing stats (EngineReplica.record_routing_stats); None if it reported none."""
        if not stats or "keys" not in stats:
            return None
        blob = stats["keys"]
        return cls(frozenset(blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)), float(stats["time"]))


def imbalanced(loads: dict[str, int], balance_abs: int, balance_rel: float) -> bool:
    """SGLang's test: the busiest replica has more than `balance_abs` requests more than the idlest, and more
    than `balance_rel` times as many."""
    most, least = max(loads.values()), min(loads.values())
    return most - least > balance_abs and most > balance_rel * least


class CacheAwarePolicy:
    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 max_keys_per_replica: int = 100_000, max_sessions: int = 100_000):
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.max_keys, self.max_sessions = max_keys_per_replica, max_sessions
        self.sent: dict[str, OrderedDict[bytes, float]] = {}  # replica -> key -> when last sent there
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session -> the replica of its last request

    def choose(self, keys: list[bytes], loads: dict[str, int], reports: dict[str, Holdings | None],
               session: str | None = None) -> str:
        """The replica for a request with chain `keys` (and `session`, see session_of) among `loads` (replica ->
        requests in flight); `reports` holds each replica's last report, if any. Pure: `record` the choice once the
        request is sent."""
        names = sorted(loads)
        least = min(names, key=lambda n: (loads[n], self._size(n, reports.get(n)), n))
        if imbalanced(loads, self.balance_abs, self.balance_rel):
            return least
        home = self.sessions.get(session)
        if home in loads:
            return home
        if not keys:
            return least
        matched = {n: self.matched(n, keys, reports.get(n)) for n in names}
        best = max(names, key=lambda n: (matched[n], -loads[n]))
        return best if matched[best] / len(keys) >= self.cache_threshold and matched[best] > 0 else least

    def matched(self, name: str, keys: list[bytes], report: Holdings | None) -> int:
        """How many leading blocks of `keys` replica `name` is believed to hold."""
        sent = self.sent.get(name, {})
        count = 0
        for key in keys:
            when = sent.get(key)
            recent = when is not None and (report is None or when >= report.time - REPORT_SLACK_S)
            if not (recent or (report is not None and key in report.keys)):
                break
            count += 1
        return count

    def record(self, name: str, keys: list[bytes], now: float | None = None, session: str | None = None) -> None:
        """Replica `name` was sent a request with chain `keys` (and `session`): it will hold them."""
        now = time.time() if now is None else now
        if session is not None:
            self.sessions[session] = name
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        sent = self.sent.setdefault(name, OrderedDict())
        for key in keys:
            sent[key] = now
            sent.move_to_end(key)
        while len(sent) > self.max_keys:
            sent.popitem(last=False)

    def forget(self, live: set[str]) -> None:
        """Drop what is known of replicas no longer among `live` (stopped or replaced)."""
        for name in set(self.sent) - live:
            del self.sent[name]
        for session in [s for s, name in self.sessions.items() if name not in live]:
            del self.sessions[session]

    def _size(self, name: str, report: Holdings | None) -> int:
        return len(report.keys) if report is not None else len(self.sent.get(name, ()))


class RoundRobinPolicy:
    """Each request to the next replica in name order: the baseline that ignores the cache."""

    def __init__(self):
        self.turn = 0

    def choose(self, keys: list[bytes], loads: dict[str, int], reports: dict[str, Holdings | None],
               session: str | None = None) -> str:
        names = sorted(loads)
        name = names[self.turn % len(names)]
        self.turn += 1
        return name

    def record(self, name: str, keys: list[bytes], now: float | None = None, session: str | None = None) -> None:
        pass

    def forget(self, live: set[str]) -> None:
        pass


def make_policy(routing: str, **settings) -> CacheAwarePolicy | RoundRobinPolicy:
    """The policy `cluster.routing` names, with the `cluster.*` thresholds for cache_aware."""
    if routing == "round_robin":
        return RoundRobinPolicy()
    if routing == "cache_aware":
        return CacheAwarePolicy(**settings)
    raise ValueError(f"cluster.routing = {routing!r} has no policy here")
