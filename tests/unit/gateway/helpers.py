"""Gateways on in-memory stores for unit tests, with a clock the test moves."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.gateway.config import GatewaySettings
from pipeline.gateway.gateway import Gateway
from pipeline.gateway.keys import KeyManager, MemoryKeyStore
from pipeline.gateway.limits import MemoryLimiter


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    gateway: Gateway
    keys: KeyManager
    limiter: MemoryLimiter
    clock: Clock


def rig(**gateway_settings: object) -> Rig:
    settings = replace(GatewaySettings(auth_required=True, key_cache_s=0.0), **gateway_settings)  # type: ignore[arg-type]
    clock = Clock()
    store = MemoryKeyStore(clock)
    limiter = MemoryLimiter(settings.window_s, clock)
    gateway = Gateway(settings, store, limiter, clock=clock)
    return Rig(gateway, KeyManager(store, rotate_overlap_s=settings.rotate_overlap_s, clock=clock), limiter, clock)
