"""Names of stored blocks: what a tier key is made of, and why two keys never alias.

A block's chain key (cache/hashing.py, format v2) already depends on the key format version,
the block size, the model fingerprint (weights digest, tokenizer, dtype, quantization, KV dtype:
``LLMEngine.fingerprint``), the namespace and every token up to the block. A stored block is
named by that key plus the *store id*: a hash of the codec version and the KV layout (layers,
KV heads, head dim, storage dtype, scales). So a block written by a different model, dtype, KV
dtype, block size, layout or codec is never even looked up, and the header stored with every
block repeats the name for the load-time check (codec.py).

The namespace also names a *directory* (disk) or a key prefix (Redis), as a digest: tenant
names are hostile strings and never become file names; dropping a namespace from a tier is one
directory or one index set (redis_tier.py), never a scan. Segment records (segments/record.py)
live in the same namespace directory or prefix under ``segment_store_id``, so dropping a
namespace drops its segments with its blocks.

Both names are *keyed* digests (secret.py, ``TierKeys.names``): the deployment's secret is in
every namespace id, so two deployments sharing a Redis never share a tenant's blocks, and a
reader of the Redis or the directory can neither map a directory to a tenant nor test whether a
guessed prompt is stored (a chain key is an unkeyed hash of the tokens; the record name is not).
Given the keys, everything here is a pure function of its arguments: the same block has the
same name in every process, after every restart, on every replica of the deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

from xxhash import xxh3_128_digest

from prefixcache.cache.hashing import KEY_FORMAT_VERSION
from prefixcache.tiers.secret import TierKeys

# Bumped whenever the stored bytes of a block (codec.py) change meaning: it enters the store id.
CODEC_VERSION = 2  # 2: keyed MAC, keyed names, no token ids in records (secret.py)
_STORE_TAG = b"prefixcache/kv-store"
_SEGMENT_STORE_TAG = b"prefixcache/segment-store"


@dataclass(frozen=True)
class StoreLayout:
    """What the bytes of one stored block depend on besides its chain key."""

    model_fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # the KV format's name (float32, bfloat16, int8, fp8_e4m3, ...)
    scaled: bool  # a float32 scale per (token, KV head) follows K and V
    block_bytes: int  # payload bytes of one block (block_size * bytes_per_token)

    def describe(self) -> str:
        return (
            f"keys:v{KEY_FORMAT_VERSION}|codec:v{CODEC_VERSION}|model:{self.model_fingerprint}|"
            f"bs:{self.block_size}|layers:{self.num_layers}|kvh:{self.num_kv_heads}|"
            f"hd:{self.head_dim}|kv:{self.kv_dtype}|scaled:{int(self.scaled)}|"
            f"bytes:{self.block_bytes}"
        )

    def store_id(self) -> bytes:
        """16 bytes naming the layout; in every stored block's name and header."""
        return xxh3_128_digest(_STORE_TAG + self.describe().encode())

    def segment_store_id(self) -> bytes:
        """16 bytes naming the layout of a stored *segment* (segments/record.py: a document's
        K and V computed alone, float32, any length). Another tag than ``store_id``: a segment
        record and a block never share a name, and neither decodes as the other."""
        return xxh3_128_digest(_SEGMENT_STORE_TAG + self.describe().encode())


def namespace_id(namespace: str | None, keys: TierKeys) -> str:
    """A file- and key-safe name for a namespace in this deployment (32 hex chars). None and ""
    differ; the same tenant name in another deployment (another secret) differs."""
    raw = b"\x00" if namespace is None else b"\x01" + namespace.encode("utf-8")
    return keys.digest(b"namespace", raw, 16).hex()


def block_name(store_id: bytes, block_key: bytes, keys: TierKeys) -> str:
    """The name of one stored block (or segment) inside its namespace (64 hex chars)."""
    return keys.digest(b"record-name", store_id + block_key).hex()
