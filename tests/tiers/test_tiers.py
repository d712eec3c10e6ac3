"""Persistent KV tiers (prefixcache/tiers, connectors/tiers.py): the disk tier end to end.

Unit (no model): the block codec rejects corrupt, truncated, foreign and forged blocks (a
record made without the deployment's secret); store ids differ for every layout input and names
for every secret; the disk tier survives a restart, keeps its budget, cleans half-written files,
keeps its files private whatever the umask, writes again after a full disk got space back, and
a kill -9 in the middle of writes leaves only whole blocks; a flooding tenant cannot evict
another below its share (also after a restart), its write-queue overflow drops only its own
writes, and the writer serves tenants in turn; so does the reader, whose per-tenant bound drops
only the flooder's restores.
Engine (real model): a new engine on the same directory restores a prefix and gives the same
greedy tokens as a cold run at prefix lengths k*16-1 / k*16 / k*16+1, in float32 and int8 KV;
another KV dtype or block size never hits; corrupt, truncated and foreign files are misses;
namespaces are isolated and invalidation drops them from disk; a write error (file size limit:
a real kernel failure) turns the tier off while serving goes on; a restore over its tenant's
bound is computed instead, cold == warm.
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _helpers import PROSE

from prefixcache import LLM, SamplingParams
from prefixcache.api.request import RequestStatus
from prefixcache.tiers import codec
from prefixcache.tiers.disk import OWNER_FILE, SUBDIR, SUFFIX, DiskTier
from prefixcache.tiers.keys import StoreLayout, block_name, namespace_id
from prefixcache.tiers.manager import PROBE_EVERY, TierManager
from prefixcache.tiers.records import BlockRef
from prefixcache.tiers.secret import SECRET_NAME, TierKeys, generated_secret
from prefixcache.tiers.shares import owner_id

BS = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
MEM = "24MiB"
KEYS = TierKeys.from_secret(b"deployment one: 32 bytes or more")
OWNER = owner_id("alice", KEYS)


# ---- unit: codec, keys, disk tier ------------------------------------------------------------------
def _layout(**kw) -> StoreLayout:
    base = {"model_fingerprint": "m", "block_size": 16, "num_layers": 2, "num_kv_heads": 1,
            "head_dim": 8, "kv_dtype": "float32", "scaled": False, "block_bytes": 256}
    return StoreLayout(**{**base, **kw})


def _name(key=b"k" * 16, ns=None, store=None, tokens=b"t" * 64) -> codec.BlockName:
    name = bytes.fromhex(block_name(store or _layout().store_id(), key, KEYS))
    return codec.BlockName(name, bytes.fromhex(namespace_id(ns, KEYS)), b"p" * 16 + tokens)


def _decode(data, name=None, size=256):
    return codec.decode(data, name or _name(), size, KEYS)


@pytest.mark.parametrize("compression", codec.COMPRESSIONS)
def test_codec_round_trip_and_every_rejection(compression):
    payload = bytes(range(256))
    data = codec.encode(_name(), payload, KEYS, compression)
    assert _decode(data) == payload
    zeros = codec.encode(_name(), bytes(256), KEYS, compression)  # compresses when asked
    assert _decode(zeros) == bytes(256)
    assert (len(zeros) < len(data)) == (compression != "none")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    cases = {
        "mac": bytes(flipped),
        "truncated": data[:-5],
        "format": b"XXXX" + data[4:],
    }
    for reason, bad in cases.items():
        with pytest.raises(codec.BlockRejected) as e:
            _decode(bad)
        assert e.value.reason in (reason, "truncated", "mac")
    foreign = [_name(key=b"q" * 16), _name(ns="tenant-b"), _name(tokens=b"u" * 64),
               _name(store=_layout(kv_dtype="int8").store_id())]  # fmt: skip
    for other in foreign:  # a whole, valid block, but not the one asked for
        with pytest.raises(codec.BlockRejected) as e:
            _decode(data, other)
        assert e.value.reason == "foreign"
    with pytest.raises(codec.BlockRejected):
        _decode(data, size=255)  # another payload size
    assert b"t" * 64 not in data  # the token ids are not stored, only a keyed digest


def test_a_record_forged_without_the_secret_is_rejected():
    """Whoever can write to the store but lacks the secret: a record with the right header (a
    real one's) and a payload of their choosing, sealed by any digest they can compute (an
    unkeyed hash, a MAC under another secret), is a rejected miss; so is another deployment's
    genuine record of the same block and tenant."""
    real = codec.encode(_name(), bytes(range(256)), KEYS)
    head = real[: codec.HEADER_BYTES]
    evil = bytes(255 - i for i in range(256))
    other = TierKeys.from_secret(b"someone else's secret, 32+ bytes")
    for seal in (lambda b: hashlib.sha256(b).digest(), lambda b: codec._mac(other, b)):
        forged = head + evil + seal(head + evil)
        with pytest.raises(codec.BlockRejected) as e:
            _decode(forged)
        assert e.value.reason == "mac"
    theirs = codec.encode(_name(), evil, other)
    with pytest.raises(codec.BlockRejected) as e:
        _decode(theirs)
    assert e.value.reason == "mac"


def test_every_tier_declares_the_protocol_and_implements_all_of_it(tmp_path):
    """tiers/tier.py: DiskTier and RedisTier declare Tier and define each of its members
    themselves (a protocol member inherited is a stub returning None); the manager refuses a
    store that only resembles one."""
    import inspect

    from prefixcache.tiers.redis_tier import RedisTier
    from prefixcache.tiers.tier import Tier

    members = [n for n, v in vars(Tier).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"get_many", "put", "sweep", "drop_namespace", "owner_usage"} <= set(members)
    for cls in (DiskTier, RedisTier):
        assert Tier in cls.__mro__
        for n in members:
            assert vars(cls).get(n) is not None, f"{cls.__name__}.{n} is the protocol's stub"
            want = list(inspect.signature(getattr(Tier, n)).parameters)
            assert list(inspect.signature(getattr(cls, n)).parameters) == want, (cls, n)
        assert isinstance(cls.name, str) and isinstance(cls.knows_contents, bool)

    class LooksLikeOne:  # every member, but no declaration
        pass

    for n in members:
        setattr(LooksLikeOne, n, getattr(DiskTier, n))
    with pytest.raises(TypeError, match="not a tiers.tier.Tier"):
        TierManager([LooksLikeOne()], _layout(), KEYS)


def test_store_id_depends_on_every_layout_input():
    base = _layout()
    variants = [_layout(model_fingerprint="m2"), _layout(block_size=32), _layout(num_layers=3),
                _layout(num_kv_heads=2), _layout(head_dim=16), _layout(kv_dtype="int8"),
                _layout(scaled=True), _layout(block_bytes=512)]  # fmt: skip
    ids = {base.store_id()} | {v.store_id() for v in variants}
    assert len(ids) == len(variants) + 1
    assert base.store_id() == _layout().store_id()  # pure: same inputs, same name
    assert namespace_id(None, KEYS) != namespace_id("", KEYS) != namespace_id("a", KEYS)
    assert len(block_name(base.store_id(), b"k" * 16, KEYS)) == 64
    # Another deployment (secret): the same tenant and block have other names.
    other = TierKeys.from_secret(b"x" * 32)
    assert namespace_id("a", other) != namespace_id("a", KEYS)
    assert block_name(base.store_id(), b"k" * 16, other) != block_name(base.store_id(), b"k" * 16, KEYS)
    assert namespace_id("a", TierKeys.from_secret(b"x" * 32)) == namespace_id("a", other)


def _put(tier, i, ns="n", size=1000, owner=OWNER) -> str:
    name = f"{i:064x}"
    assert tier.put(ns, name, bytes([i % 256]) * size, owner=owner)
    return name


def test_disk_tier_restart_budget_and_stale_temporaries(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=5000)
    names = [_put(tier, i) for i in range(7)]  # 7000 bytes into 5000: the 2 oldest go
    assert tier.stats().stored_blocks == 5 and tier.stats().stored_bytes == 5000
    assert tier.get_many("n", names[:2]) == []
    assert tier.get_many("n", names[2:4]) == [bytes([2]) * 1000, bytes([3]) * 1000]
    stale = tmp_path / SUBDIR / "n" / ".tmp-half-written"
    stale.write_bytes(b"partial")
    tier.check_integrity()
    again = DiskTier(tmp_path, capacity_bytes=5000)  # a restart: the index comes from the files
    assert again.stats().stored_blocks == 5
    assert again.get_many("n", names[2:]) == [bytes([i]) * 1000 for i in range(2, 7)]
    assert not stale.exists()
    assert again.drop_namespace("n") == 5 and again.get_many("n", names[2:3]) == []
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="not writable"):  # a startup error, with its reason
        DiskTier(tmp_path / "file" / "x", 1000)


def test_a_flooding_tenant_cannot_evict_another_below_its_share(tmp_path):
    """Shares (shares.py): B within its share keeps every block while A writes unique records
    without end, and still after a restart (owners come back from the directories); B over
    its share is cut to it, after A's excess."""
    a, b = owner_id("flooder", KEYS), owner_id("victim", KEYS)
    tier = DiskTier(tmp_path, capacity_bytes=10_000)
    mine = [_put(tier, i, ns="b", owner=b) for i in range(4)]  # 4000 of a 5000 share
    for i in range(100, 160):
        _put(tier, i, ns="a", owner=a)
    assert tier.get_many("b", mine) == [bytes([i]) * 1000 for i in range(4)]
    assert tier.owner_usage(a) == (6, 6000) and tier.owner_usage(b) == (4, 4000)
    tier.check_integrity()
    again = DiskTier(tmp_path, capacity_bytes=10_000)
    for i in range(200, 260):
        _put(again, i, ns="a2", owner=a)  # another namespace of A's: the same share
    assert again.get_many("b", mine) == [bytes([i]) * 1000 for i in range(4)]
    more = [_put(again, i, ns="b", owner=b) for i in range(4, 9)]
    assert again.owner_usage(a) == (5, 5000) and again.owner_usage(b) == (5, 5000)
    assert again.get_many("b", mine[:1]) == [] and len(again.get_many("b", more)) == 5
    assert again.stats().owners == 2
    again.check_integrity()


def test_disk_files_and_secret_are_private_whatever_the_umask(tmp_path):
    old_ns = tmp_path / SUBDIR / "n"
    old_ns.mkdir(parents=True)
    old_ns.chmod(0o755)  # a directory of an earlier run
    mask = os.umask(0)  # the widest: without explicit modes, files 0666, directories 0777
    try:
        tier = DiskTier(tmp_path, 1 << 20)
        name = _put(tier, 1, ns="m")
        secret = generated_secret(tmp_path)
    finally:
        os.umask(mask)
    assert generated_secret(tmp_path) == secret and len(secret) >= 32  # made once, then read
    modes = {p: p.stat().st_mode & 0o777 for p in (tmp_path / SUBDIR, old_ns, tmp_path / SUBDIR / "m")}
    assert set(modes.values()) == {0o700}, modes
    assert (tmp_path / SUBDIR / "m" / (name + SUFFIX)).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / SECRET_NAME).stat().st_mode & 0o777 == 0o600


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB filesystem (tmpfs, we run as root): writes past it fail with ENOSPC from the
    kernel. Without mount rights, the file size limit stands in (EFBIG, the same path)."""
    d = tmp_path / "tiny"
    d.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)]
    if subprocess.run(mount, check=False, capture_output=True).returncode == 0:
        yield d, None
        subprocess.run(["umount", str(d)], check=True)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    yield d, (soft, hard)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_disk_full_pauses_writes_and_a_probe_resumes_them(tiny_disk):
    d, fsize = tiny_disk
    tier = DiskTier(d, 1 << 30, retry_after=0.01)  # the budget trusts a disk that is smaller
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, fsize[1]))
    first = _put(tier, 1, size=600_000)
    assert tier.put("n", f"{2:064x}", bytes(700_000), owner=OWNER) is False  # ENOSPC (or EFBIG)
    st = tier.stats()
    assert st.enabled is False and st.available and st.errors == 1
    assert not list((d / SUBDIR).rglob(".tmp-*"))  # the failed write left nothing
    assert tier.get_many("n", [first]) == [bytes([1]) * 600_000]  # reads go on
    tier.remove("n", first)  # space comes back (here: by our own hand)
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, fsize)
    deadline = time.monotonic() + 30
    while not tier.put("n", f"{3:064x}", bytes(700_000), owner=OWNER) and time.monotonic() < deadline:
        time.sleep(0.01)  # paused: dropped until the back-off ends, then the write probes
    st = tier.stats()
    assert st.enabled and st.reconnects == 1 and st.stored_blocks == 1
    tier.check_integrity()


def test_a_tier_slower_than_prefill_is_skipped_but_probed(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    m = TierManager([disk], _layout(), KEYS)
    ref = BlockRef(b"k" * 16, b"p" * 16 + b"t" * 64)
    m.offload("ns", [(ref, bytes(range(256)))])
    assert m.flush()

    def restore() -> int:
        job = m.submit_restore("r", "ns", [ref])
        while not job.done:
            m.wait_completed(0.05)
        m.take_completed()
        return len(job.found)

    assert restore() == 1  # the tier's speed is measured
    m.observe_prefill(10**12, 1.0)  # recomputing is faster than any disk
    got = [restore() for _ in range(PROBE_EVERY)]
    assert got.count(1) == 1 and disk.stats().skipped_slow == PROBE_EVERY - 1  # one probe
    for _ in range(200):  # prefill turns slow (a moving average: it takes a while)
        m.observe_prefill(1, 1.0)
    assert [restore() for _ in range(3)] == [1, 1, 1]
    m.close()


class _GatedDisk(DiskTier):
    """A real disk tier whose writes wait for ``gate`` (the writer is held while the queue
    fills) and that records the namespace of each write, in the order they came."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.order: list[str] = []

    def put(self, ns, name, data, record="block", *, owner):
        self.gate.wait(30)
        self.order.append(ns)
        return super().put(ns, name, data, record, owner=owner)


def _ref(i: int) -> BlockRef:
    return BlockRef(i.to_bytes(16, "little"), b"p" * 16 + b"t" * 64)


def test_the_writer_serves_tenants_in_turn(tmp_path):
    disk = _GatedDisk(tmp_path, 1 << 30)
    m = TierManager([disk], _layout(), KEYS)
    try:
        for i in range(20):
            m.offload("flooder", [(_ref(i), bytes(256))])
        m.offload("victim/salt", [(_ref(100), bytes(256))])
        disk.gate.set()
        assert m.flush()
        # At most the flooder's write the writer held, then one more of the flooder's turn.
        assert disk.order.index(m.namespace_id("victim/salt")) <= 2, disk.order
        assert len(disk.order) == 21
        m.check_integrity()
    finally:
        disk.gate.set()
        m.close()


def test_a_flooding_tenants_queue_overflow_drops_only_its_own_writes(tmp_path):
    disk = _GatedDisk(tmp_path, 1 << 30)
    m = TierManager([disk], _layout(), KEYS, max_queued_bytes=10 * 256)
    try:
        for i in range(30):  # 10 fit (one of them held by the writer), 20 are dropped
            m.offload("flooder", [(_ref(i), bytes(256))])
        for i in range(3):  # the victim's are queued: the flooder's newest make room
            m.offload("victim", [(_ref(100 + i), bytes(256))])
        m.check_integrity()
        restores = {"queued_restores": 0, "dropped_restores": 0}
        assert m.owner_stats("victim")["queue"] == {"queued_bytes": 3 * 256, "dropped_writes": 0,
                                                    **restores}  # fmt: skip
        assert m.owner_stats("flooder")["queue"] == {"queued_bytes": 7 * 256, "dropped_writes": 23,
                                                     **restores}  # fmt: skip
        assert disk.stats().dropped_writes == 23
        disk.gate.set()
        assert m.flush()
        assert m.owner_stats("victim")["disk"]["stored_records"] == 3
        assert m.owner_stats("flooder")["disk"]["stored_records"] == 7
        m.check_integrity()
    finally:
        disk.gate.set()
        m.close()


class _GatedReads(DiskTier):
    """A real disk tier whose reads wait for ``gate`` once one has begun (``reading``): the
    reader is held on a job while restores queue up behind it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.reading = threading.Event(), threading.Event()

    def get_many(self, ns, names, owner=None):
        self.reading.set()
        self.gate.wait(30)
        return super().get_many(ns, names, owner=owner)


def test_the_reader_serves_tenants_in_turn_and_bounds_each_ones_queue(tmp_path):
    disk = _GatedReads(tmp_path, 1 << 30)
    m = TierManager([disk], _layout(), KEYS, max_queued_restores=20)
    try:
        for ns, i in (("flooder", 0), ("victim/salt", 100)):
            m.offload(ns, [(_ref(i), bytes(range(256)))])
        assert m.flush()
        held = m.submit_restore("f-held", "flooder", [_ref(0)])
        assert disk.reading.wait(30)  # the reader holds the flooder's first job
        flood = [m.submit_restore(f"f{i}", "flooder", [_ref(0)]) for i in range(25)]
        victim = m.submit_restore("v", "victim/salt", [_ref(100)])
        # The bound drops only the flooder's excess: its 5 newest, not the victim's one.
        assert all(flood[:20]) and flood[20:] == [None] * 5 and victim is not None
        assert m.owner_stats("flooder")["queue"]["queued_restores"] == 20
        assert m.owner_stats("flooder")["queue"]["dropped_restores"] == 5
        assert m.owner_stats("victim")["queue"]["queued_restores"] == 1
        assert m.owner_stats("victim")["queue"]["dropped_restores"] == 0
        m.cancel(flood[19])  # its request left: its job no longer counts against the bound
        assert m.submit_restore("f-late", "flooder", [_ref(0)]) is not None
        m.check_integrity()
        disk.gate.set()
        done: list = []
        while len(done) < 22:
            m.wait_completed(0.05)
            done += m.take_completed()
        order = [j.request_id for j in done]
        # At most the flooder's job the reader held, then one more of the flooder's turn.
        assert order.index("v") <= 2, order
        flooder = ["f-held"] + [f"f{i}" for i in range(19)] + ["f-late"]
        assert [r for r in order if r != "v"] == flooder  # its own jobs keep their order
        assert all(len(j.found) == 1 for j in done) and held.done
        m.check_integrity()
    finally:
        disk.gate.set()
        m.close()


def test_kill_9_during_writes_leaves_only_whole_blocks(tmp_path):
    """A writer killed at a random moment, many times: after restart every block file decodes."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from prefixcache.tiers import codec
        from prefixcache.tiers.disk import DiskTier
        from prefixcache.tiers.keys import namespace_id
        from prefixcache.tiers.secret import TierKeys
        keys = TierKeys.from_secret(b"k" * 32)
        tier = DiskTier({str(tmp_path)!r}, 1 << 40)
        ns = namespace_id(None, keys)
        i = 0
        print("ready", flush=True)
        while True:
            name = codec.BlockName(i.to_bytes(32, "little"), bytes.fromhex(ns), b"p" * 80)
            tier.put(ns, f"{{i:064x}}", codec.encode(name, os.urandom(1 << 20), keys), owner="0" * 32)
            i += 1
    """)
    for delay in (0.05, 0.15, 0.3):
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
    files = list((tmp_path / SUBDIR).rglob("*"))
    assert any(f.name.endswith(SUFFIX) for f in files)
    tier = DiskTier(tmp_path, 1 << 40)  # the restart
    keys = TierKeys.from_secret(b"k" * 32)
    ns = namespace_id(None, keys)
    left = [f.name for f in (tmp_path / SUBDIR / ns).iterdir() if f.name != OWNER_FILE]
    assert left and all(n.endswith(SUFFIX) for n in left), "a temporary file survived the restart"
    for n in left:
        i = int(n[: -len(SUFFIX)], 16)
        data = tier.get_many(ns, [n[: -len(SUFFIX)]])[0]
        name = codec.BlockName(i.to_bytes(32, "little"), bytes.fromhex(ns), b"p" * 80)
        assert len(codec.decode(data, name, 1 << 20, keys)) == 1 << 20


# ---- engine: the real model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cold(llm_cold):
    """The references for cold == warm: the suite's float32 engine without caching, and one in
    int8 (its own numbers)."""
    int8 = LLM(kv_cache_memory=MEM, enable_prefix_caching=False, kv_cache_dtype="int8", seed=0)
    return {"float32": llm_cold, "int8": int8}


def _prompts(tok, n, length, salt):
    """``n`` prompts of ``length`` tokens, each its own prefix (distinct by ``salt``)."""
    base = tok.encode(PROSE * 4, add_special_tokens=False)
    return [[(salt * 97 + i * 31) % 5000 + 100] + base[: length - 1] for i in range(n)]


def _disk(llm):
    return llm.cache_stats()["tiers"]["disk"]


def _tails(ids_list, k):
    return [ids + [42 + k, 7, 99] for ids in ids_list]


@pytest.mark.slow
def test_restart_restores_from_disk_cold_equals_warm_int8(tmp_path, cold):
    """In int8 KV (blocks with scales), at k*16-1 / k*16 / k*16+1; float32 restores are
    checked below and in test_tiers_redis.py, float32 at these lengths there."""
    ref = cold["int8"]
    tok = ref.get_tokenizer()
    lengths = [5 * BS - 1, 5 * BS, 5 * BS + 1]
    prefixes = [_prompts(tok, 1, n, salt=i)[0] for i, n in enumerate(lengths)]
    first = LLM(kv_cache_memory=MEM, kv_cache_dtype="int8", disk_cache_dir=tmp_path, seed=0)
    first.generate(_tails(prefixes, 0), GREEDY)
    assert first.engine.connectors.flush()
    assert _disk(first)["written_blocks"] == sum((n + 3) // BS for n in lengths)
    del first
    second = LLM(kv_cache_memory=MEM, kv_cache_dtype="int8", disk_cache_dir=tmp_path, seed=0)
    prompts = _tails(prefixes, 1) + [prefixes[1]]  # new suffixes, and a prompt seen before
    warm = second.generate(prompts, GREEDY)
    expect = ref.generate(prompts, GREEDY)
    for w, c in zip(warm, expect):
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
    # Every full block of the shared prefix came from disk (the prompt seen before: all full
    # blocks, then the 15 tokens before its last one, copied from the restored fifth block).
    assert [w.num_cached_tokens for w in warm] == [n // BS * BS for n in lengths] + [5 * BS - 1]
    st = _disk(second)
    assert st["hit_tokens"] == sum(n // BS * BS for n in lengths) and st["rejected_blocks"] == 0
    second.check_integrity()
    del second
    # A request whose prefix is on disk waits in LOADING while it is read (vLLM's
    # WAITING_FOR_REMOTE_KVS), never admitted meanwhile; then WAITING, then it runs.
    third = LLM(kv_cache_memory=MEM, kv_cache_dtype="int8", disk_cache_dir=tmp_path, seed=0)
    probe = third.engine.add_request("probe", prefixes[0] + [5, 6], GREEDY)
    assert probe.status is RequestStatus.LOADING and probe.loading
    seen = []
    while third.engine.has_unfinished():
        seen.append(probe.status)
        third.engine.step()
    assert seen[0] is RequestStatus.LOADING and RequestStatus.RUNNING in seen
    assert probe.num_cached_tokens == len(prefixes[0]) // BS * BS
    # Another KV dtype shares the directory but never hits on these blocks (nor reads them).
    # (Only the three distinct prefixes: the repeated one would hit its twin in RAM.)
    alien = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    out = alien.generate(_tails(prefixes, 1), GREEDY)
    assert all(o.num_cached_tokens == 0 for o in out)
    st = _disk(alien)
    assert st["hit_blocks"] == 0 and st["read_blocks"] == 0 and st["rejected_blocks"] == 0


def _block_file(llm, root: Path, ids, i, namespace=None) -> Path:
    key = llm.engine.block_hashes(ids, namespace)[i]
    m = llm.engine.connectors.get("tiers").manager
    return root / SUBDIR / m.namespace_id(namespace) / (m.record_name(key) + SUFFIX)


@pytest.mark.slow
def test_corrupt_truncated_foreign_files_tenants_invalidation_and_disk_full(tmp_path, cold):
    ref = cold["float32"]
    tok = ref.get_tokenizer()
    prompts = [p + [11, 12, 13] for p in _prompts(tok, 3, 5 * BS, salt=7)]
    secret = _prompts(tok, 1, 4 * BS + 3, salt=8)[0]
    writer = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    writer.generate(prompts, GREEDY)
    writer.generate([secret], GREEDY, cache_salt="tenant-a")
    assert writer.engine.connectors.flush()
    files = [_block_file(writer, tmp_path, p, 2) for p in prompts]
    assert all(f.exists() for f in files)
    data = files[0].read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    files[0].write_bytes(bytes(flipped))  # a flipped bit in the payload
    files[1].write_bytes(files[1].read_bytes()[:-1000])  # a torn write
    files[2].write_bytes(_block_file(writer, tmp_path, prompts[0], 3).read_bytes())  # another block
    del writer

    reader = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    out = reader.generate(prompts, GREEDY)
    expect = ref.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [c.outputs[0].token_ids for c in expect]
    assert [o.num_cached_tokens for o in out] == [2 * BS] * 3  # up to the bad block, not past it
    st = _disk(reader)
    assert st["rejected_by_reason"] == {"mac": 1, "truncated": 1, "foreign": 1}
    assert reader.engine.connectors.flush()
    again = DiskTier(tmp_path, 1 << 30)  # removed, then written again whole by the recompute
    for f in files:
        ns, name = f.parent.name, f.name[: -len(SUFFIX)]
        assert again.get_many(ns, [name]) and f.read_bytes() != b""
    assert _disk(reader)["written_blocks"] == 3  # the rejected ones; their successors were there
    out = reader.generate(prompts, GREEDY)  # and now they are RAM hits, still cold == warm
    assert [o.outputs[0].token_ids for o in out] == [c.outputs[0].token_ids for c in expect]

    # Tenants: the namespace is in every key; another tenant's same prompt never hits the disk.
    hits = _disk(reader)["hit_blocks"]
    other = reader.generate([secret], GREEDY, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0 and _disk(reader)["hit_blocks"] == hits
    own = reader.generate([secret], GREEDY, cache_salt="tenant-a")[0]
    assert own.num_cached_tokens == 4 * BS and _disk(reader)["hit_blocks"] == hits + 4
    # Invalidation drops the namespace from RAM and disk: nothing of it comes back.
    ns_dir = tmp_path / SUBDIR / reader.engine.connectors.get("tiers").manager.namespace_id("tenant-a")
    assert ns_dir.exists()
    reader.engine.invalidate("tenant-a")
    assert not ns_dir.exists()
    again = reader.generate([secret], GREEDY, cache_salt="tenant-a")[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == ref.generate([secret], GREEDY)[0].outputs[0].token_ids

    # A write the kernel refuses (here: over the file size limit, EFBIG; a full disk is ENOSPC,
    # the same path) pauses the tier's writes; serving goes on, cold == warm.
    fresh = [p + [5] for p in _prompts(tok, 1, 3 * BS, salt=9)]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        out = reader.generate(fresh, GREEDY)
        assert reader.engine.connectors.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    st = _disk(reader)
    assert st["enabled"] is False and st["errors"] >= 1
    assert out[0].outputs[0].token_ids == ref.generate(fresh, GREEDY)[0].outputs[0].token_ids
    assert not list((tmp_path / SUBDIR).rglob(".tmp-*"))  # the failed write left nothing
    out = reader.generate(prompts[:1], GREEDY)  # still serving, from RAM
    assert out[0].outputs[0].token_ids == expect[0].outputs[0].token_ids
    reader.check_integrity()


@pytest.mark.slow
def test_a_restore_over_the_tenants_bound_is_computed_cold_equals_warm(tmp_path, cold):
    """The engine's side of the reader's per-tenant bound: a restore that is not queued leaves
    the request to compute those blocks, with the outputs of a cold run."""
    ref = cold["float32"]
    prompt = _prompts(ref.get_tokenizer(), 1, 3 * BS + 2, salt=10)[0]
    writer = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    writer.generate([prompt], GREEDY, cache_salt="t")
    assert writer.engine.connectors.flush()
    del writer
    reader = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    reader.engine.connectors.get("tiers").manager.max_queued_restores = 0  # every restore is over the bound
    out = reader.generate([prompt], GREEDY, cache_salt="t")[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert reader.engine.connectors.get("tiers").tenant_stats("t")["usage"]["queue"]["dropped_restores"] == 1
    assert _disk(reader)["restores"] == 0
    reader.check_integrity()
