"""The disk tier: one file per entry under a directory, bounded by `max_bytes`, least recently used evicted first.

Layout: `<path>/<first 2 hex chars of the key>/<key hex>.kvb` (the fan-out keeps each directory small). Entries
are opaque bytes; `max_bytes` bounds the sum of their lengths (not the blocks the filesystem rounds them up to).
Private to the user running the server, whatever the umask: the directories are 0700 (`path` itself made so at
start), the files 0600. K/V gives away the prompt to anyone with the model's weights.

Atomicity: an entry is written to `.<key hex>.<pid>.<thread id>.tmp` in its final directory, fsynced, then renamed
over its final name (`os.replace`, atomic on POSIX) and the directory fsynced. A crash mid-write leaves at worst a
`*.tmp` file, which no scan takes for an entry and the next start deletes (unless its writing process still runs:
`kvreuse cache stats` beside a live server must not break the server's writes in progress).

LRU: the index is an OrderedDict `key -> size`, least recently used first; `get` moves a hit to the end. Every write
and hit also stamps the file's mtime with a strictly increasing time in ns (the kernel's own mtime is coarse, so
entries written within the same tick would tie), and a start rebuilds the index from the files, oldest mtime first:
the LRU order survives restarts.

Faults (a full disk, EIO, EROFS) never raise: the entry is dropped or missed, `counters.errors` counts it, and one
warning is logged per incident (until a write succeeds again).

Every unlink happens under the lock, and an entry enters the index only after its file is in place, so the index
and the files agree whenever the lock is free and no write is in flight (`check_integrity`). An entry whose file
cannot be removed (a read-only filesystem) stays indexed, as it stays on disk: eviction skips it from then on, and
`clear` says how many it left.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvreuse.kvcache.tiers.base import TierCounters, TierUsage

logger = logging.getLogger(__name__)

_DIR = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"((?:[0-9a-f]{2})+)\.kvb")
DIR_MODE, FILE_MODE = 0o700, 0o600


class DiskTier:
    name = "disk"

    def __init__(self, path: str | os.PathLike, max_bytes: int):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.counters = TierCounters()
        self.num_bytes = 0                       # sum of the sizes in the index
        self.closed = False
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, int] = {}     # keys being written -> the bytes they reserve
        self._num_reserved = 0                   # sum of those
        self._stuck: set[bytes] = set()          # indexed keys whose file could not be removed
        self._lock = threading.Lock()
        self._failing = False                    # inside a fault incident: logged once, until a write succeeds
        self._last_stamp = 0
        self.path.mkdir(DIR_MODE, parents=True, exist_ok=True)
        for directory in [self.path, *(d for d in self.path.iterdir() if _DIR.fullmatch(d.name) and d.is_dir())]:
            _make_private(directory)             # also those an older version made 0755
        found, temps = self._scan()
        for temp in temps:                       # left by a writer that crashed mid-write
            try:
                temp.unlink(missing_ok=True)
            except OSError as exc:
                self._fault("unlink", temp, exc)
        for mtime_ns, key, size in sorted(found):
            self._index[key] = size
            self.num_bytes += size
            self._last_stamp = max(self._last_stamp, mtime_ns)
        with self._lock:                         # max_bytes may be lower than last time
            self._evict_for(0)
        if found or temps:
            logger.info("disk tier %s: %d entries, %d bytes, %d temp files removed", self.path, len(self._index),
                        self.num_bytes, len(temps))

    # --- the protocol --------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            with self._lock:
                if key not in self._index:
                    out.append(None)
                    continue
                self._index.move_to_end(key)
                stamp = self._stamp()
            file = self._file(key)
            try:
                data = file.read_bytes()
            except OSError as exc:
                with self._lock:
                    # Under the lock an indexed file is missing only if someone else removed it; a read error
                    # drops the entry too (it would only fail again).
                    if key in self._index and (not isinstance(exc, FileNotFoundError) or not file.exists()):
                        self._drop(key)
                    if not isinstance(exc, FileNotFoundError):
                        self._fault("read", file, exc)
                out.append(None)
                continue
            try:
                os.utime(file, ns=(stamp, stamp))
            except OSError:
                pass                             # only the LRU order after a restart suffers
            with self._lock:
                self.counters.entries_read += 1
                self.counters.bytes_read += len(data)
            out.append(data)
        return out

    def put(self, entries: Sequence[tuple[bytes, bytes]]) -> int:
        return sum(self._put_one(key, entry) for key, entry in entries)

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                if key in self._index and self._drop(key):
                    self.counters.entries_deleted += 1

    def clear(self) -> int:
        """Remove every entry it can; those whose file cannot be removed stay indexed (and are logged)."""
        with self._lock:
            removed = sum(self._drop(key) for key in list(self._index))
            self.counters.entries_deleted += removed
            left = len(self._index)
        if left:
            logger.warning("disk tier %s: cleared %d entries, %d could not be removed and are still held",
                           self.path, removed, left)
        return removed

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.name, len(self._index), self.num_bytes, self.max_bytes, available=True,
                             detail=str(self.path))

    def check_integrity(self) -> None:
        with self._lock:
            on_disk = {key: size for _, key, size in self._scan()[0]}
            assert on_disk.keys() == self._index.keys(), \
                f"{len(on_disk.keys() - self._index.keys())} files not indexed, " \
                f"{len(self._index.keys() - on_disk.keys())} indexed keys without a file"
            for key, size in self._index.items():
                assert on_disk[key] == size, f"{key.hex()}: indexed as {size} bytes, the file has {on_disk[key]}"
            assert self.num_bytes == sum(self._index.values()), "num_bytes != the sum of the indexed sizes"
            assert self._stuck <= self._index.keys(), "a stuck key that is not indexed"
            assert self.num_bytes <= self.max_bytes or self._stuck, \
                f"{self.num_bytes} bytes over max_bytes {self.max_bytes}"

    def close(self) -> None:
        self.closed = True

    # --- internals -----------------------------------------------------------------------------------
    def _put_one(self, key: bytes, entry: bytes) -> bool:
        size = len(entry)
        with self._lock:
            if key in self._index or key in self._pending:
                return False                     # same key, same contents
            if size <= self.max_bytes:
                self._evict_for(size)
            if self.num_bytes + self._num_reserved + size > self.max_bytes:
                # Bigger than the whole tier, or no room beside the writes in flight: dropped to stay within
                # the limit, which is what `evictions` counts.
                self.counters.evictions += 1
                self.counters.entries_dropped += 1
                return False
            self._pending[key] = size
            self._num_reserved += size
            stamp = self._stamp()
        file = self._file(key)
        temp = file.with_name(f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            _make_dir(file.parent)
            with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
                os.fchmod(f.fileno(), FILE_MODE)  # whatever the umask
                f.write(entry)
                f.flush()
                os.fsync(f.fileno())
            os.utime(temp, ns=(stamp, stamp))
            os.replace(temp, file)
        except OSError as exc:
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass                             # the next start removes it
            with self._lock:
                self._num_reserved -= self._pending.pop(key)
                self.counters.entries_dropped += 1
                self._fault("write", file, exc)
            return False
        self._fsync_dir(file.parent)
        with self._lock:
            self._num_reserved -= self._pending.pop(key)
            self._index[key] = size
            self.num_bytes += size
            self.counters.entries_written += 1
            self.counters.bytes_written += size
            if self._failing:
                self._failing = False
                logger.info("disk tier %s: writes succeed again", self.path)
        return True

    def _evict_for(self, size: int) -> None:
        """Under the lock: drop least recently used entries until `size` more bytes (and those being written)
        fit."""
        while self.num_bytes + self._num_reserved + size > self.max_bytes:
            victim = next((key for key in self._index if key not in self._stuck), None)
            if victim is None:
                return                           # only entries it cannot remove are left
            if self._drop(victim):
                self.counters.evictions += 1

    def _drop(self, key: bytes) -> bool:
        """Under the lock (so a concurrent put of the same key cannot have its new file unlinked): remove the entry's
        file, then unindex it; a file that cannot be removed stays indexed and stuck. Whether it went."""
        try:
            self._file(key).unlink(missing_ok=True)
        except OSError as exc:
            self._stuck.add(key)
            self._fault("unlink", self._file(key), exc)
            return False
        self.num_bytes -= self._index.pop(key)
        self._stuck.discard(key)
        return True

    def _fault(self, op: str, file: Path, exc: OSError) -> None:
        """Under the lock."""
        self.counters.errors += 1
        if not self._failing:
            self._failing = True
            logger.warning("disk tier %s: %s of %s failed (%s); such entries are dropped or missed until writes "
                           "succeed again", self.path, op, file.name, exc)

    def _stamp(self) -> int:
        """Under the lock: an mtime later than every one given before, in ns."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _file(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.path / hexkey[:2] / f"{hexkey}.kvb"

    def _scan(self) -> tuple[list[tuple[int, bytes, int]], list[Path]]:
        """The entry files as (mtime_ns, key, size), and the temp files, in the fan-out directories."""
        found, temps = [], []
        for sub in self.path.iterdir():
            if not (_DIR.fullmatch(sub.name) and sub.is_dir()):
                continue
            for file in sub.iterdir():
                match = _ENTRY.fullmatch(file.name)
                try:
                    if match and match.group(1).startswith(sub.name) and file.is_file():
                        st = file.stat()
                        found.append((st.st_mtime_ns, bytes.fromhex(match.group(1)), st.st_size))
                    elif file.name.endswith(".tmp") and not _writer_alive(file):
                        temps.append(file)
                except FileNotFoundError:
                    pass                         # removed while we looked
        return found, temps

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        """Make the rename durable (best effort: not every platform can open a directory)."""
        try:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass


def _make_dir(directory: Path) -> None:
    """`directory`, created 0700 if absent (whatever the umask)."""
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(directory, DIR_MODE)


def _make_private(directory: Path) -> None:
    """Make an existing directory of the tier 0700; a warning if it cannot be (owned by someone else)."""
    try:
        if directory.stat().st_mode & 0o777 != DIR_MODE:
            os.chmod(directory, DIR_MODE)
    except OSError as exc:
        logger.warning("disk tier: cannot make %s private (mode 0700): %s; other users may read its entries",
                       directory, exc)


def _writer_alive(temp: Path) -> bool:
    """Whether another process that still runs is writing `temp` (named `.<key hex>.<pid>.<thread id>.tmp`)."""
    parts = temp.name.split(".")
    if len(parts) != 5 or not parts[2].isdigit() or int(parts[2]) == os.getpid():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True
