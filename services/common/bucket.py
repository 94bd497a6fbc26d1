"""A token bucket: `rate` tokens a second, at most `burst` banked."""

import time
from collections.abc import Callable


class TokenBucket:
    """Starts full. take() refills by the time passed, then spends `cost` if
    that many are there; `tokens` is what is left (after the refill, when refused)."""

    __slots__ = ("at", "burst", "clock", "rate", "tokens")

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = burst, clock()

    def take(self, cost: float = 1.0) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens + 1e-9 >= cost:  # a refill by exactly the wait is enough, float error or not
            self.tokens -= cost
            return True
        return False
