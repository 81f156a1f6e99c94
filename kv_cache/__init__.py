"""kv_cache: prefix-cached paged KV block accounting (torch-free).

Nothing here imports torch, so that the scheduler and its tests run without it; the device tensors that hold
the KV pages live with the runner, in `engine.kv_store`.
"""

from kv_cache.block_pool import BlockPool
from kv_cache.hashing import HASH_ALGOS, BlockHash, BlockHasher, get_hash_fn, init_none_hash
from kv_cache.lookup import CacheRequest, ComputedBlocks, TailHit
from kv_cache.manager import KVCacheManager
from kv_cache.namespace import CacheNamespace, PublicPrefixes
from kv_cache.stats import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, PrefixCacheStats

__all__ = [
    "HASH_ALGOS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheNamespace",
    "CacheRequest",
    "ComputedBlocks",
    "KVCacheEvent",
    "KVCacheManager",
    "PrefixCacheStats",
    "PublicPrefixes",
    "TailHit",
    "get_hash_fn",
    "init_none_hash",
]
