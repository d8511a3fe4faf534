"""Where a prefix run's state may come from, nearest first: the board's own context (no copy), its
RAM (no network), the cache box (over the link). One contract (``base.Tier``: lookup, restore,
keep), one module per tier; ``restore_nearest_first`` and ``keep_nearest_first`` walk them in the
order ``PrefixServing.tiers`` lists them.

The board's flash (its own disk, ``flash``) sits between its RAM and the cache box when
``EDGECACHE_FLASH_TIER_MB`` sizes it. A new tier is a module here whose class has a ``label``
(a new ``breakdown.Tier`` word) and ``lookup``, ``restore`` and ``keep`` as ``base`` describes,
plus its place in ``PrefixServing.tiers`` (and the setting that sizes it).
"""

from .base import Computed, Held, Tier, TierRun, keep_nearest_first, restore_nearest_first
from .cachebox import CacheBoxTier
from .context import ContextTier
from .flash import FlashTier
from .ram import RamTier

__all__ = [
    "CacheBoxTier",
    "Computed",
    "ContextTier",
    "FlashTier",
    "Held",
    "RamTier",
    "Tier",
    "TierRun",
    "keep_nearest_first",
    "restore_nearest_first",
]
