"""When a request arrived, drew its first token and finished (time.perf_counter seconds), and how long its cached
prefix took to load from the lower tiers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Timings:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None  # when its first token was appended (the scheduler's postprocess)
    finish: float | None = None       # when it finished, however it did
    tier_load_s: float = 0.0          # its admission's read of its cached prefix from lower tiers (0: it loaded none)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def total_s(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival
