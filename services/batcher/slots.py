"""The slot pool: the right to send a model's batch, general or reserved for VIP work."""

import asyncio
from collections.abc import Callable

from services.common.tier import TIERS, Tier


class SlotPool:
    """The right to send one model's batch: `general` slots for any batch, plus
    `reserved` ones that only VIP work may take, so that VIP work is never held
    back by standard batches merely for the right to be sent. How many there
    are is the backend's to say (Backend.slots), and changes: a model server
    lends its VIP-only instances to standard batches while no VIP work comes."""

    def __init__(self, sizes: Callable[[], tuple[int, int, int]]):
        self.sizes = sizes  # () -> (general, reserved, general ones VIP work reaches) now
        self.taken = {"general": 0, "reserved": 0}
        self._changed = asyncio.Event()

    async def acquire(
        self, has_vip: Callable[[], bool], has_standard: Callable[[], bool]
    ) -> tuple[str, tuple[Tier, ...]]:
        """A slot, and the tiers whose requests its batch may carry. A reserved
        slot while VIP requests wait and one is free (it carries a VIP-led
        batch), else a general one. A general slot carries VIP requests only
        where VIP batches can reach the replicas it counts (or VIP work has no
        slots of its own): under a VIP-pool route a VIP batch on the standard
        pool's slot would wait for its own pool while holding the slot, and the
        standard replica would idle. With no general slots at all (no ready
        replica, or none that standard work may reach) a general one at once,
        unless VIP work waits for a reserved one: the backend then answers
        UNAVAILABLE, on which the router falls back or fails fast, rather than
        the requests waiting out their deadlines here."""
        while True:
            general, reserved, vip_general = self.sizes()
            vip_waits = has_vip() and reserved > 0
            if vip_waits and self.taken["reserved"] < reserved:
                self.taken["reserved"] += 1
                return "reserved", (Tier.VIP,)
            tiers = TIERS if vip_general > 0 or reserved == 0 or general == 0 else (Tier.STANDARD,)
            if (self.taken["general"] < general or (general == 0 and not vip_waits)) and (
                Tier.VIP in tiers or has_standard()
            ):
                self.taken["general"] += 1
                return "general", tiers
            self._changed.clear()
            await self._changed.wait()

    def release(self, kind: str) -> None:
        self.taken[kind] -= 1
        self._changed.set()

    def poke(self) -> None:
        """Something waiters decide on changed (a VIP request arrived)."""
        self._changed.set()
