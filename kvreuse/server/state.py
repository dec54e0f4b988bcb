"""What every route shares: the engine (an EngineClient), the metrics, the requests in flight, the preparation threads
and the settings.

One `ServerState` lives on `app.state.kvreuse`; routes reach it through the `get_state` dependency (tests can
swap it with `app.dependency_overrides[get_state]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from kvreuse.config import Config
from kvreuse.server.admission import Admissions
from kvreuse.server.engine_client import EngineClient
from kvreuse.server.metrics import Metrics
from kvreuse.server.preparation import Preparation
from kvreuse.server.protocol import now


@dataclass
class ServerState:
    engine: EngineClient
    metrics: Metrics
    model_name: str
    api_keys: dict[str, str] | None  # key -> tenant, admin keys included; None: no authentication
    admin_keys: dict[str, str] | None = None  # key -> name: the keys that may call the admin routes (auth.admin_only)
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish
    ready: bool = False     # the engine thread runs
    admissions: Admissions = field(default_factory=Admissions)  # sequences in flight, per tenant
    preparation: Preparation = field(default_factory=Preparation)  # the preparation threads, per tenant
    created: int = field(default_factory=now)

    @property
    def config(self) -> Config:
        return self.engine.front_end.config

    @property
    def num_tenants(self) -> int:
        """The tenants the API keys name, admins included (each has its share of the pins); 1 without keys."""
        return len(set(self.api_keys.values())) if self.api_keys else 1


async def get_state(request: Request) -> ServerState:
    """Dependency: the ServerState of the app serving this request."""
    return request.app.state.kvreuse


StateDep = Annotated[ServerState, Depends(get_state)]  # a route parameter of this type receives the state
