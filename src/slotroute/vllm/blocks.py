"""The block watcher: slotroute's view of vLLM's KV block pool
(``vllm/v1/core/block_pool.py`` ``BlockPool``), the same on every generation.

A block the pool hands out for new data (``get_new_blocks``, which drops its cached
hash) is reported to the routing that watches the pool, which invalidates its rows in
step order; a failed step's blocks leave the prefix cache through vLLM's own
``evict_blocks``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from slotroute.vllm.patches import Patch

__all__ = ["BLOCK_POOL_PATCHES", "watch"]

BLOCK_POOL = "vllm.v1.core.block_pool"
# The attribute slotroute sets on a BlockPool it watches (vLLM's object, not ours).
WATCHER_ATTR = "_slotroute_on_new_blocks"


def watch(block_pool, on_new_blocks: Callable[[Iterable], None]) -> Callable[[set], None]:
    """Report every block ``block_pool`` hands out for new data to ``on_new_blocks``;
    returns the pool's ``evict_blocks`` (block ids -> out of its prefix cache)."""
    setattr(block_pool, WATCHER_ATTR, on_new_blocks)
    return block_pool.evict_blocks


def _make_get_new_blocks(original):
    """Wraps ``BlockPool.get_new_blocks``: the one place a free block is handed out for
    new data (dropping its cached hash)."""

    def get_new_blocks(self, num_blocks):
        blocks = original(self, num_blocks)
        watcher = self.__dict__.get(WATCHER_ATTR)
        if watcher is not None:
            watcher(blocks)
        return blocks

    return get_new_blocks


# Both scheduler patch sets install these. evict_blocks is verified only: what a
# failed step's blocks leave the prefix cache through (vLLM's own use: blocks whose
# KV load failed).
BLOCK_POOL_PATCHES = (
    Patch(BLOCK_POOL, "BlockPool.get_new_blocks", ("self", "num_blocks"),
          ("free_block_queue.popleft_n", "_maybe_evict_cached_block"), _make_get_new_blocks),
    Patch(BLOCK_POOL, "BlockPool.evict_blocks", ("self", "block_ids"),
          ("self._maybe_evict_cached_block(block)",), None),
)
