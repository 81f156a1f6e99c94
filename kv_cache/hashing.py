"""Block hashing for automatic prefix caching: the chained hash of every full block of a request.

A block's hash is `hash_fn((parent_hash, token_ids, extra_keys))`, where `parent_hash` is the previous block's
hash (a per-process seed, `init_none_hash`, for block 0), `token_ids` are the block's `block_size` tokens and
`extra_keys` is a tuple of typed keys or None. Because each hash covers its parent, equal hashes mean equal
prefixes (up to collisions of the hash function), and anything mixed into block 0 (the cache salt) is inherited
by every later block.

Extra keys are tagged tuples, so that keys of different kinds can never collide with each other: the
request's namespace (`kv_cache.namespace.CacheNamespace.keys()`: `("tenant", id)`, `("gateway", value)`,
`("cache_salt", salt)`, and the LoRA adapter's `("lora", name, fingerprint)`) on its first private block only;
every other block has none (Brine takes no multimodal inputs, so there are no keys of that kind; a new kind is
one more tag). The first private block is block 0, unless the prompt starts with a declared public prefix
(and the request runs no LoRA adapter, whose blocks are all its own: KVCacheManager.make_hasher): then its
`num_public_blocks` full blocks carry no namespace (every namespace shares them) and the namespace goes into the
block right after them.

`BlockHash` is always `bytes`: 32 bytes for sha256, 16 bytes (xxh3-128) for xxhash.

Tail keys (`BlockHasher.tail_key`): `hash_fn((parent_hash, "tail", extra_keys))`, block i's hash with its tokens
left out. Blocks filed under one tail key follow the same prefix in the same namespace, so the KV of any
tokens they share with a request's next block is the KV that request would compute (the manager reuses a
partial block's leading tokens that way). The string item keeps a tail key from ever equalling a block hash,
whose second item is a sequence of token ids.

Algorithms (`get_hash_fn(name)`):
- `sha256` (default) and `sha256_cbor`: collision-resistant; safe when tenants are untrusted.
- `xxhash` and `xxhash_cbor`: faster (xxh3-128), but NOT collision-resistant: a tenant who can choose
  prompts can craft a collision and read another tenant's KV blocks (or poison the cache), salt or not. Use
  them only when every client is trusted.
The plain variants hash `encode(obj)` (below; BlockHasher builds that encoding from precomputed pieces, the
fastest path); the `_cbor` variants hash canonical CBOR (`cbor2`), a standard encoding other languages can
reproduce, at several times the cost per block. `benchmarks/kv_cache_bench.py` measures them.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence

import xxhash

from kv_cache.namespace import CacheNamespace

BlockHash = bytes
HashFn = Callable[[object], BlockHash]
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
ExtraKeys = tuple[tuple[object, ...], ...]

_LEN = struct.Struct("<Q").pack
# Items that can never be packed as int64: lets encode() skip a doomed pack attempt (and its exception) for
# the (parent, tokens, extra keys) tuple of every block.
_NOT_INT = (bytes, str, tuple, list, type(None))
_KEY_HEAD = b"t" + _LEN(3) + b"b"  # encode() of a 3-tuple whose first item is bytes, up to that item's length
_TAIL = "tail"  # the middle item of a tail key (see the module docstring)


def _pack_ints(seq: Sequence[object]) -> bytes | None:
    """`seq` as little-endian int64s, or None unless every item is an int (or __index__) that fits."""
    try:
        return struct.pack(f"<{len(seq)}q", *seq)
    except struct.error:
        return None


def encode(obj: object) -> bytes:
    """Deterministic, injective byte encoding of None / int / str / bytes / tuple / list trees.

    Every item is a one-byte tag plus a length prefix, so no two different trees share an encoding, and the
    bytes depend only on the values (unlike pickle, whose memo makes them depend on object identity). A
    sequence whose items are all ints that fit in int64 (token ids) is packed in one C call, 8 little-endian
    bytes each. Lists and tuples encode alike; bools encode as the ints they equal.
    """
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


def _encode(obj: object, out: list[bytes]) -> None:
    if isinstance(obj, (tuple, list)):
        packed = _pack_ints(obj) if not obj or not isinstance(obj[0], _NOT_INT) else None
        if packed is not None:
            out += (b"i", _LEN(len(obj)), packed)
            return
        out += (b"t", _LEN(len(obj)))
        for item in obj:
            _encode(item, out)
    elif isinstance(obj, bytes):
        out += (b"b", _LEN(len(obj)), obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        out += (b"s", _LEN(len(data)), data)
    elif obj is None:
        out.append(b"n")
    elif isinstance(obj, int):
        data = obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True)
        out += (b"z", _LEN(len(data)), data)
    else:
        raise TypeError(f"cannot hash a {type(obj).__name__} for the prefix cache")


def get_hash_fn(name: str) -> HashFn:
    """The hash function called `name` (one of HASH_ALGOS); ValueError for any other name."""
    if name == "sha256":
        return _sha256
    if name == "sha256_cbor":
        return _sha256_cbor
    if name == "xxhash":
        return _xxhash
    if name == "xxhash_cbor":
        return _xxhash_cbor
    raise ValueError(
        f"unknown prefix caching hash algorithm {name!r}; expected one of {', '.join(HASH_ALGOS)}"
    )


def _sha256(obj: object) -> BlockHash:
    return hashlib.sha256(encode(obj)).digest()


def _sha256_cbor(obj: object) -> BlockHash:
    import cbor2  # only the cbor variants need it

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: object) -> BlockHash:
    return xxhash.xxh3_128_digest(encode(obj))


def _xxhash_cbor(obj: object) -> BlockHash:
    import cbor2

    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def _sha256_digest(data: bytes) -> BlockHash:
    return hashlib.sha256(data).digest()


def _raw_digest(hash_fn: HashFn) -> Callable[[bytes], BlockHash] | None:
    """`digest` such that hash_fn(obj) == digest(encode(obj)) for every obj, for the plain algorithms: lets
    BlockHasher encode its (parent, tokens, extra keys) tuples itself, from precomputed pieces."""
    if hash_fn is _sha256:
        return _sha256_digest
    if hash_fn is _xxhash:
        return xxhash.xxh3_128_digest
    return None


def init_none_hash(hash_fn: HashFn) -> BlockHash:
    """The parent hash of block 0.

    Random (fresh on every call) unless PYTHONHASHSEED is set to a value other than "random"; then it is
    derived from that value, so block hashes (and the events an external router sees) are the same across
    restarts. Callers keep the value they get: one per manager.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return os.urandom(32)
    return hash_fn(("brine_none_hash", seed))


class BlockHasher:
    """Incremental hasher for one request: call extend() whenever the request's tokens grow.

    Only full blocks are hashed, each exactly once: extend() starts where `block_hashes` stops, so the cost
    per call is O(1) until a block fills. The caller owns `block_hashes` and must not edit it otherwise.
    Block i's hash is exactly `hash_fn((block_hashes[i - 1] or none_hash, tokens of block i, extra_keys(i)))`.
    Blocks `0 .. num_public_blocks - 1` carry no namespace key; the caller (KVCacheManager.make_hasher)
    guarantees that they lie wholly inside a declared public prefix of the request's prompt.
    """

    __slots__ = (
        "block_size",
        "hash_fn",
        "none_hash",
        "namespace",
        "num_public_blocks",
        "_first_keys",
        "_digest",
        "_pack",
        "_first_enc",
        "_later_enc",
        "_tail_enc",
    )

    def __init__(
        self,
        block_size: int,
        hash_fn: HashFn,
        *,
        namespace: CacheNamespace | None = None,
        num_public_blocks: int = 0,
        cache_salt: str | None = None,
        none_hash: BlockHash | None = None,
    ) -> None:
        """`namespace`: the request's cache namespace; `cache_salt` is shorthand for a namespace holding only
        that salt (give one or the other). `num_public_blocks`: leading blocks hashed without the namespace.
        `none_hash`: block 0's parent; a fresh init_none_hash(hash_fn) when not given."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_public_blocks < 0:
            raise ValueError(f"num_public_blocks must be >= 0, got {num_public_blocks}")
        if cache_salt is not None:
            if namespace is not None:
                raise ValueError("give namespace or cache_salt, not both")
            namespace = CacheNamespace(salt=cache_salt)
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.namespace = namespace or CacheNamespace()
        self.num_public_blocks = num_public_blocks
        self.none_hash = init_none_hash(hash_fn) if none_hash is None else none_hash
        if not isinstance(self.none_hash, bytes):
            raise TypeError(f"none_hash must be bytes, got {type(self.none_hash).__name__}")
        self._first_keys: ExtraKeys | None = tuple(self.namespace.keys()) or None
        # Fast path pieces: encode((parent, tokens, keys)) ==
        #   b"t" LEN(3) | b"b" LEN(len(parent)) parent | b"i" LEN(block_size) int64s | encode(keys)
        self._digest = _raw_digest(hash_fn)
        self._pack = struct.Struct(f"<{block_size}q").pack
        self._first_enc = encode(self._first_keys)
        self._later_enc = encode(None)
        self._tail_enc = encode(_TAIL)

    def extra_keys(self, block_index: int) -> ExtraKeys | None:
        """The typed extra keys of block `block_index` (None when it has none)."""
        return self._first_keys if block_index == self.num_public_blocks else None

    def tail_key(self, block_hashes: Sequence[BlockHash], block_index: int) -> BlockHash:
        """Block `block_index`'s tail key (module docstring): `hash_fn((parent, "tail", extra_keys))`, where
        parent is `block_hashes[block_index - 1]` (none_hash for block 0). Needs the hashes of the blocks
        before it only."""
        parent = block_hashes[block_index - 1] if block_index else self.none_hash
        if self._digest is None:
            return self.hash_fn((parent, _TAIL, self.extra_keys(block_index)))
        keys_enc = self._first_enc if block_index == self.num_public_blocks else self._later_enc
        return self._digest(b"".join((_KEY_HEAD, _LEN(len(parent)), parent, self._tail_enc, keys_enc)))

    def extend(self, block_hashes: list[BlockHash], all_token_ids: Sequence[int]) -> None:
        """Append to `block_hashes` the hash of every block of `all_token_ids` that became full since the last
        call (len(block_hashes) says where the last call stopped)."""
        bs = self.block_size
        start = len(block_hashes)
        end = len(all_token_ids) // bs
        if start >= end:
            return
        parent = block_hashes[start - 1] if start else self.none_hash
        digest = self._digest
        if digest is None:
            hash_fn = self.hash_fn
            for i in range(start, end):
                parent = hash_fn((parent, all_token_ids[i * bs : (i + 1) * bs], self.extra_keys(i)))
                block_hashes.append(parent)
            return
        pack = self._pack
        join = b"".join
        head = _KEY_HEAD
        tokens_head = b"i" + _LEN(bs)
        later_enc = self._later_enc
        first = self.num_public_blocks
        for i in range(start, end):
            tokens = all_token_ids[i * bs : (i + 1) * bs]
            try:
                packed = tokens_head + pack(*tokens)
            except struct.error:  # not all int64: the general encoding (still what encode() gives)
                packed = encode(tokens)
            keys_enc = self._first_enc if i == first else later_enc
            parent = digest(join((head, _LEN(len(parent)), parent, packed, keys_enc)))
            block_hashes.append(parent)
