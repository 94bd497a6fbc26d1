"""The caller's tier: who a request is for. One type in every service; on the
wire the proto enum infermesh.common.v1.Tier, whose values these are."""

import enum


class Tier(enum.IntEnum):
    """A higher tier is served first (strict priority, non-preemptive)."""

    STANDARD = 0
    VIP = 1

    @property
    def label(self) -> str:
        """Its name in headers, registries, messages and metric labels."""
        return self.name.lower()

    @classmethod
    def of(cls, value: int) -> "Tier | None":
        """The tier a wire value names, or None for a value no tier has."""
        try:
            return cls(value)
        except ValueError:
            return None


TIERS = tuple(Tier)  # lowest first
BY_LABEL = {tier.label: tier for tier in Tier}  # "standard", "vip"
