"""The worker half of the KV tier on disk (``services/worker/kv_tier.py``): block files round
trip byte for byte; a missing, truncated, corrupt or foreign file fails its load (counted,
logged once per reason, deleted) and never gives wrong data; a write error (disk full, no
permission, the folder gone) turns writing off and serving goes on; concurrent writers never
expose a partial file; ``apply_ready`` waits only when asked; and ``ModelRunner.execute_step``
stores after the forward and loads before it (float32 and an int8 cache)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from services.common.kv_tier_files import SUFFIX, TMP_SUFFIX, block_path
from services.common.step import CachedRequest, KVTransfer, NewRequest, StepInput, StepOutput
from services.worker import kv_tier
from services.worker.config import WorkerConfig
from services.worker.kv_tier import HEADER, KVTier, kv_tier_namespace, model_files_digest
from services.worker.metrics import WorkerMetrics
from services.worker.server import worker_info

NS = "0123456789abcdef" * 2
OTHER_NS = "f" * 32


class Recorder:
    """A ``KVTierMetrics`` that remembers what it was told."""

    def __init__(self) -> None:
        self.stores = self.loads = self.dropped = 0
        self.store_failures: Counter[str] = Counter()
        self.load_failures: Counter[str] = Counter()
        self.writes_enabled = True

    def observe_store(self, seconds: float) -> None:
        self.stores += 1

    def observe_load(self, seconds: float) -> None:
        self.loads += 1

    def store_failed(self, reason: str) -> None:
        self.store_failures[reason] += 1

    def load_failed(self, reason: str) -> None:
        self.load_failures[reason] += 1

    def stores_dropped(self, n: int) -> None:
        self.dropped += n

    def set_writes_enabled(self, enabled: bool) -> None:
        self.writes_enabled = enabled


def make_tensors(num_blocks: int = 16, row: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """Three cache tensors ``[num_blocks, 4, 2, row]`` of the dtypes a cache has (float32,
    bfloat16, int8 rows with their scales inside), random."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, row)
    return [torch.randn(shape, generator=g), torch.randn(shape, generator=g).to(torch.bfloat16),
            torch.randint(-128, 127, shape, generator=g, dtype=torch.int8)]


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


@pytest.fixture
def tiers():
    """Build KVTier instances (``make(rank_dir, ...)``), all closed after the test."""
    made: list[KVTier] = []

    def make(rank_dir, tensors=None, namespace=NS, **kw) -> KVTier:
        kw.setdefault("metrics", Recorder())
        tier = KVTier(str(rank_dir), namespace, tensors if tensors is not None
                      else make_tensors(), **kw)
        made.append(tier)
        return tier

    yield make
    for t in made:
        t.close()


def load(tier: KVTier, transfers: list[KVTransfer], timeout: float = 10.0
         ) -> tuple[list[int], list[int]]:
    """Start ``transfers``' loads and collect every outcome."""
    tier.start_loads(transfers)
    done: list[int] = []
    failed: list[int] = []
    deadline = time.monotonic() + timeout
    while len(done) + len(failed) < len(transfers) and time.monotonic() < deadline:
        d, f = tier.apply_ready(0.05)
        done += d
        failed += f
    return sorted(done), sorted(failed)


def stored(tier: KVTier, transfers: list[KVTransfer]) -> None:
    with torch.inference_mode():
        assert tier.store(transfers) == len(transfers)
    assert tier.flush()


def files(folder) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, ns in os.walk(folder) for n in ns)


def test_blocks_round_trip_byte_for_byte(tmp_path, tiers):
    src = make_tensors(seed=1)
    writer = tiers(tmp_path / "r", src)
    transfers = [KVTransfer(1, 0, key(1)), KVTransfer(3, 0, key(2)), KVTransfer(3, 1, key(2))]
    stored(writer, transfers)
    names = files(tmp_path / "r")
    assert names == sorted(block_path(str(tmp_path / "r"), t.group, t.key) for t in transfers)
    assert all(os.path.getsize(n) == writer.block_bytes for n in names)
    assert writer.block_bytes == HEADER.size + sum(t[0].numel() * t.element_size() for t in src)
    dst = make_tensors(seed=2)
    reader = tiers(tmp_path / "r", dst)
    done, failed = load(reader, [KVTransfer(5, 0, key(1)), KVTransfer(6, 1, key(2))])
    assert (done, failed) == ([5, 6], [])
    for s, d, fresh in zip(src, dst, make_tensors(seed=2), strict=True):
        assert torch.equal(d[5], s[1]) and torch.equal(d[6], s[3])
        assert torch.equal(d[7], fresh[7])  # the other blocks untouched
    assert writer.metrics.stores == 3 and reader.metrics.loads == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_blocks_round_trip_on_cuda(tmp_path, tiers):
    src = [t.cuda() for t in make_tensors(seed=1)]
    stored(tiers(tmp_path / "r", src), [KVTransfer(1, 0, key(1)), KVTransfer(2, 0, key(2))])
    dst = [t.cuda() for t in make_tensors(seed=2)]
    assert load(tiers(tmp_path / "r", dst), [KVTransfer(4, 0, key(2)),
                                             KVTransfer(5, 0, key(1))]) == ([4, 5], [])
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[4], s[2]) and torch.equal(d[5], s[1])


def test_a_block_already_on_disk_is_not_written_again(tmp_path, tiers):
    tier = tiers(tmp_path / "r")
    stored(tier, [KVTransfer(1, 0, key(1))])
    path = block_path(str(tmp_path / "r"), 0, key(1))
    before = os.stat(path).st_mtime_ns
    time.sleep(0.01)
    stored(tier, [KVTransfer(2, 0, key(1))])
    assert os.stat(path).st_mtime_ns == before and tier.metrics.stores == 1


def _damage(path: str, how: str) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "flip":
        data[HEADER.size + 7] ^= 0x40
    elif how == "cut":
        data = data[:-5]
    elif how == "cut_header":
        data = data[:HEADER.size - 1]
    elif how == "longer":
        data += b"\0"
    elif how == "magic":
        data[0:4] = b"XXXX"
    elif how == "version":
        data[4] ^= 0x7
    with open(path, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize("how, reason", [
    ("flip", "corrupt"), ("longer", "corrupt"), ("magic", "corrupt"), ("cut", "truncated"),
    ("cut_header", "truncated"), ("version", "foreign")])
def test_a_damaged_file_fails_and_is_deleted_and_logged_once(tmp_path, tiers, caplog, how,
                                                             reason):
    src = make_tensors(seed=1)
    tier = tiers(tmp_path / "r", src)
    stored(tier, [KVTransfer(1, 0, key(1)), KVTransfer(2, 0, key(2))])
    for k in (1, 2):
        _damage(block_path(str(tmp_path / "r"), 0, key(k)), how)
    before = [t.clone() for t in src]
    with caplog.at_level(logging.WARNING, logger="services.worker.kv_tier"):
        assert load(tier, [KVTransfer(5, 0, key(1)), KVTransfer(6, 0, key(2))]) == ([], [5, 6])
    assert tier.metrics.load_failures == {reason: 2}
    assert len([r for r in caplog.records if reason in r.getMessage()]) == 1
    assert files(tmp_path / "r") == []
    assert all(torch.equal(a, b) for a, b in zip(src, before, strict=True))  # no wrong data


def test_a_bad_file_replaced_while_it_was_read_is_not_deleted(tmp_path, tiers, monkeypatch):
    """The scheduler may store a block again while a load of its damaged file is in flight:
    the new file, renamed into place after the reader opened the old one, stays."""
    src = make_tensors(seed=1)
    tier = tiers(tmp_path / "r", src)
    stored(tier, [KVTransfer(1, 0, key(1))])
    path = block_path(str(tmp_path / "r"), 0, key(1))
    with open(path, "rb") as f:
        good = f.read()
    _damage(path, "flip")
    real = tier._read_block

    def read_then_replace(tr):
        out = real(tr)  # (the damaged file, read)
        with open(path + ".new", "wb") as f:
            f.write(good)
        os.replace(path + ".new", path)  # a writer's rename, before the reader deletes
        return out

    monkeypatch.setattr(tier, "_read_block", read_then_replace)
    assert load(tier, [KVTransfer(5, 0, key(1))]) == ([], [5])
    with open(path, "rb") as f:
        assert f.read() == good  # the new file stays
    monkeypatch.setattr(tier, "_read_block", real)
    assert load(tier, [KVTransfer(6, 0, key(1))]) == ([6], [])


def test_a_missing_file_fails_is_counted_and_logged_once(tmp_path, tiers, caplog):
    tier = tiers(tmp_path / "r")
    with caplog.at_level(logging.WARNING, logger="services.worker.kv_tier"):
        assert load(tier, [KVTransfer(i, 0, key(i)) for i in range(4)]) == ([], [0, 1, 2, 3])
    assert tier.metrics.load_failures == {"missing": 4}
    assert len([r for r in caplog.records if "missing" in r.getMessage()]) == 1


@pytest.mark.parametrize("mismatch", ["namespace", "key", "group", "layout"])
def test_a_foreign_file_fails_and_is_deleted(tmp_path, tiers, mismatch):
    rank_dir = tmp_path / "r"
    writer = tiers(rank_dir, make_tensors(row=8 if mismatch == "layout" else 6),
                   namespace=OTHER_NS if mismatch == "namespace" else NS)
    stored(writer, [KVTransfer(1, 0, key(1))])
    path = block_path(str(rank_dir), 0, key(1))
    want = KVTransfer(5, 0, key(1))
    if mismatch in ("key", "group"):  # the file of another block under this block's name
        want = KVTransfer(5, 1, key(1)) if mismatch == "group" else KVTransfer(5, 0, key(9))
        os.makedirs(os.path.dirname(block_path(str(rank_dir), want.group, want.key)),
                    exist_ok=True)
        shutil.copy(path, block_path(str(rank_dir), want.group, want.key))
    reader = tiers(rank_dir)
    assert load(reader, [want]) == ([], [5])
    assert reader.metrics.load_failures == {"foreign": 1}
    assert not os.path.exists(block_path(str(rank_dir), want.group, want.key))


def test_enospc_turns_writing_off_once_and_serving_goes_on(tmp_path, tiers, monkeypatch,
                                                          caplog):
    tier = tiers(tmp_path / "r")
    stored(tier, [KVTransfer(1, 0, key(1))])
    real_open = open

    def full(path, mode="r", *a, **kw):
        if str(path).endswith(TMP_SUFFIX):
            f = real_open(path, mode, *a, **kw)  # (the tmp file exists, then the write fails)
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(kv_tier, "open", full, raising=False)
    with caplog.at_level(logging.WARNING, logger="services.worker.kv_tier"):
        with torch.inference_mode():
            tier.store([KVTransfer(2, 0, key(2)), KVTransfer(3, 0, key(3))])
        assert tier.flush()
        with torch.inference_mode():
            assert tier.store([KVTransfer(4, 0, key(4))]) == 0  # off: nothing queued
    assert not tier.writes_enabled and not tier.metrics.writes_enabled
    assert tier.metrics.store_failures == {"ENOSPC": 1}
    warnings = [r.getMessage() for r in caplog.records if "turned off" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "r") in warnings[0]
    assert "No space left" in warnings[0]
    assert files(tmp_path / "r") == [block_path(str(tmp_path / "r"), 0, key(1))]  # no tmp
    monkeypatch.undo()
    assert load(tier, [KVTransfer(7, 0, key(1))]) == ([7], [])  # loads go on


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the mode bits say")
def test_an_unwritable_folder_turns_writing_off(tmp_path, tiers):
    tier = tiers(tmp_path / "r")
    os.chmod(tmp_path / "r", 0o500)
    try:
        with torch.inference_mode():
            tier.store([KVTransfer(1, 0, key(1))])
        assert tier.flush()
    finally:
        os.chmod(tmp_path / "r", 0o700)
    assert not tier.writes_enabled and tier.metrics.store_failures == {"EACCES": 1}


def test_a_folder_removed_while_writing_turns_writing_off(tmp_path, tiers):
    tier = tiers(tmp_path / "r")
    stored(tier, [KVTransfer(1, 0, key(1))])
    shutil.rmtree(tmp_path / "r")
    with torch.inference_mode():
        tier.store([KVTransfer(2, 0, key(2))])
    assert tier.flush()
    assert not tier.writes_enabled and tier.metrics.store_failures == {"ENOENT": 1}
    assert not os.path.exists(tmp_path / "r")  # not made again
    assert load(tier, [KVTransfer(3, 0, key(1))]) == ([], [3])  # serving goes on


def _can_mount_tmpfs(folder) -> str | None:
    """None when a 1 MiB tmpfs was mounted on ``folder``, else why not."""
    if os.geteuid() != 0:
        return "not root: cannot mount a small tmpfs"
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount failed: {e}"
    return None if r.returncode == 0 else f"mount failed: {r.stderr.strip()}"


def test_a_full_disk_turns_writing_off_and_leaves_only_whole_files(tmp_path, tiers):
    disk = tmp_path / "disk"
    disk.mkdir()
    why = _can_mount_tmpfs(disk)
    if why is not None:
        pytest.skip(why)
    try:
        tensors = make_tensors(num_blocks=40, row=2048)  # ~100 KiB a block: 1 MiB is ~10
        tier = tiers(disk / "r", tensors)
        with torch.inference_mode():
            tier.store([KVTransfer(i, 0, key(i)) for i in range(40)])
        assert tier.flush()
        assert not tier.writes_enabled and tier.metrics.store_failures == {"ENOSPC": 1}
        names = files(disk / "r")
        assert names and all(n.endswith(SUFFIX) for n in names)
        done, _ = load(tier, [KVTransfer(i, 0, key(i)) for i in range(40)])
        assert len(done) == len(names) and tier.metrics.load_failures == {
            "missing": 40 - len(names)}
    finally:
        tier.close()
        subprocess.run(["umount", str(disk)], check=False, timeout=20)


def test_racing_writers_never_expose_a_partial_file(tmp_path, tiers):
    rank_dir = tmp_path / "r"
    src = make_tensors(num_blocks=8, row=512)
    writers = [tiers(rank_dir, src), tiers(rank_dir, src)]
    reader = tiers(rank_dir, make_tensors(num_blocks=8, row=512, seed=5))
    rounds, stop = 30, threading.Event()
    outcomes: list[tuple[list[int], list[int]]] = []

    def write(tier: KVTier) -> None:
        with torch.inference_mode():
            for r in range(rounds):
                assert tier.store([KVTransfer(b, 0, key(100 * r + b)) for b in range(8)]) == 8
                tier.flush()

    def read() -> None:
        r = 0
        while not stop.is_set():
            outcomes.append(load(reader, [KVTransfer(b, 0, key(100 * r + b)) for b in range(8)]))
            r = (r + 1) % rounds

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(60)
    stop.set()
    threads[2].join(60)
    # a reader saw whole files or none, never a part of one
    assert set(reader.metrics.load_failures) <= {"missing"}
    assert outcomes
    names = files(rank_dir)
    assert len(names) == 8 * rounds and all(n.endswith(SUFFIX) for n in names)
    assert all(os.path.getsize(n) == reader.block_bytes for n in names)
    done, failed = load(reader, [KVTransfer(b, 0, key(100 * (rounds - 1) + b)) for b in range(8)])
    assert (done, failed) == (list(range(8)), [])
    assert all(torch.equal(a, b) for a, b in zip(reader.tensors, src, strict=True))


def test_apply_ready_waits_only_for_pending_loads(tmp_path, tiers, monkeypatch):
    tier = tiers(tmp_path / "r")
    stored(tier, [KVTransfer(1, 0, key(1))])
    t0 = time.monotonic()
    assert tier.apply_ready(2.0) == ([], [])  # nothing pending: no wait
    assert time.monotonic() - t0 < 0.5
    gate = threading.Event()
    real = tier._read_block
    monkeypatch.setattr(tier, "_read_block", lambda tr: (gate.wait(10), real(tr))[1])
    tier.start_loads([KVTransfer(4, 0, key(1))])
    t0 = time.monotonic()
    assert tier.apply_ready(0.1) == ([], [])  # pending, none ready: waits its time, no more
    assert 0.08 <= time.monotonic() - t0 < 1.0
    assert tier.apply_ready(0.0) == ([], [])
    threading.Timer(0.1, gate.set).start()
    t0 = time.monotonic()
    assert tier.apply_ready(5.0) == ([4], [])  # woken by the load, long before 5 s
    assert time.monotonic() - t0 < 2.0


def test_a_full_queue_drops_a_steps_stores_and_counts_them(tmp_path, tiers):
    tensors = make_tensors()
    payload = sum(t[0].numel() * t.element_size() for t in tensors)
    tier = tiers(tmp_path / "r", tensors, max_pending_bytes=2 * payload)
    with torch.inference_mode():
        assert tier.store([KVTransfer(b, 0, key(b)) for b in range(3)]) == 0
    assert tier.metrics.dropped == 3 and tier.writes_enabled


def test_store_skips_the_blocks_it_is_told_to(tmp_path, tiers):
    tier = tiers(tmp_path / "r")
    with torch.inference_mode():
        assert tier.store([KVTransfer(1, 0, key(1)), KVTransfer(2, 0, key(2))], {2}) == 1
    assert tier.flush()
    assert files(tmp_path / "r") == [block_path(str(tmp_path / "r"), 0, key(1))]


def test_the_blocks_of_requests_a_step_left_out_are_not_stored(tmp_path, tiers):
    """``run_with_kv_tier`` stores a step's blocks less those of requests it left out: the
    driver's ``failed_request_ids`` and, on every rank, the LoRA manager's ``failed``."""
    from services.worker.kv_tier_step import blocks_of, run_with_kv_tier
    step = StepInput(1, [NewRequest("a", [1] * 8, None, [1, 2], 0, 8),  # type: ignore[arg-type]
                         NewRequest("b", [1] * 8, None, [3, 4], 0, 8)],  # type: ignore[arg-type]
                     [CachedRequest("c", [], [5], False, 16, 1),
                      CachedRequest("d", [], [6], False, 16, 1)], [])
    assert blocks_of(step, {"b", "c"}) == {3, 4, 5} and blocks_of(step, set()) == set()
    step.kv_stores = [KVTransfer(b, 0, key(b)) for b in (1, 3, 5, 6)]
    tier = tiers(tmp_path / "r")
    with torch.inference_mode():
        out = run_with_kv_tier(tier, step, lambda s: StepOutput(1, [], [],
                                                                failed_request_ids=["b"]),
                               SimpleNamespace(failed={"c"}))
    assert tier.flush() and out.kv_loads_done == [] and out.kv_loads_failed == []
    assert files(tmp_path / "r") == sorted(block_path(str(tmp_path / "r"), 0, key(b))
                                           for b in (1, 6))


def test_the_namespace_digests_the_description_and_the_model_files(tmp_path):
    base = {"dtype": "float32", "block_size": 16}
    ns = kv_tier_namespace(base)
    assert len(ns) == 32 and int(ns, 16) >= 0
    assert kv_tier_namespace(dict(reversed(base.items()))) == ns  # canonical
    assert kv_tier_namespace({**base, "block_size": 32}) != ns
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "w.safetensors"
    weights.write_bytes(os.urandom(5 << 20))
    digest = model_files_digest(str(model))
    assert [d["name"] for d in digest] == ["config.json", "w.safetensors"]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last MiB is hashed
    weights.write_bytes(bytes(data))
    assert model_files_digest(str(model)) != digest


def test_the_flag_is_refused_with_pipeline_parallelism_and_pooling():
    with pytest.raises(ValueError, match=r"--kv-offload-dir.*--pipeline-parallel-size"):
        WorkerConfig(kv_offload_dir="/tmp/x", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"--kv-offload-dir.*--runner pooling"):
        WorkerConfig(kv_offload_dir="/tmp/x", runner="pooling")


def test_the_metrics_are_exported_under_their_names(tmp_path, tiers):
    metrics = WorkerMetrics(rank=0)
    tier = tiers(tmp_path / "r", metrics=metrics.kv_tier)
    stored(tier, [KVTransfer(1, 0, key(1))])
    load(tier, [KVTransfer(2, 0, key(1)), KVTransfer(3, 0, key(7))])
    get = metrics.registry.get_sample_value
    assert get("pagedserve:kv_offload_store_seconds_count", {"rank": "0"}) == 1
    assert get("pagedserve:kv_offload_load_seconds_count", {"rank": "0"}) == 1
    assert get("pagedserve:kv_offload_load_failures_total",
               {"rank": "0", "reason": "missing"}) == 1
    assert get("pagedserve:kv_offload_writes_enabled", {"rank": "0"}) == 1
    assert get("pagedserve:kv_offload_stores_dropped_total", {"rank": "0"}) == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_runner_stores_after_the_forward_and_loads_before_it(tiny_llama, tmp_path,
                                                                one_torch_thread,
                                                                kv_cache_dtype):
    from services.common.sampling_params import EngineSamplingParams
    from services.worker.model_runner import ModelRunner
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=2 << 20, attention_backend="torch",
                                      kv_cache_dtype=kv_cache_dtype,
                                      kv_offload_dir=str(tmp_path)))
    try:
        tier = runner.kv_tier
        assert tier is not None and tier.rank_dir.startswith(str(tmp_path))
        assert tier.rank_dir.endswith("tp0of1")
        bs = runner.block_size
        greedy = EngineSamplingParams(temperature=0.0, max_tokens=4)
        prompt = torch.randint(0, 512, (2 * bs,), generator=torch.Generator().manual_seed(0))
        stores = [KVTransfer(0, 0, key(1)), KVTransfer(1, 0, key(2))]
        first = runner.execute_step(StepInput(
            1, [NewRequest("a", prompt.tolist(), greedy, [0, 1], 0, 2 * bs)], [], [],
            kv_stores=stores))
        assert first.request_ids == ["a"] and first.kv_loads_done == []
        assert tier.flush()
        assert len(files(tier.rank_dir)) == 2
        # an empty step (the scheduler's poll) loads them into blocks 5 and 6
        loads = [KVTransfer(5, 0, key(1)), KVTransfer(6, 0, key(2))]
        done: list[int] = []
        out = runner.execute_step(StepInput(2, [], [], ["a"], kv_loads=loads))
        done += out.kv_loads_done
        for i in range(50):
            if len(done) == 2:
                break
            out = runner.execute_step(StepInput(3 + i, [], [], []))
            assert out.kv_loads_failed == []
            done += out.kv_loads_done
        assert sorted(done) == [5, 6]
        for pair in {id(t): t for kv in runner.kv_caches for t in kv}.values():
            assert torch.equal(pair[5], pair[0]) and torch.equal(pair[6], pair[1])
        assert pair.dtype == (torch.int8 if kv_cache_dtype == "int8" else torch.float32)
        # a request whose prefix is the loaded blocks computes only its last token, and
        # samples what the first one did
        out = runner.execute_step(StepInput(
            60, [NewRequest("b", prompt.tolist(), greedy, [5, 6], 2 * bs - 1, 1)], [], []))
        assert out.sampled_token_ids == first.sampled_token_ids
        info = worker_info(runner)
        assert (info.kv_offload_path, info.kv_offload_block_bytes) == (tier.rank_dir,
                                                                       tier.block_bytes)
    finally:
        if runner.kv_tier is not None:
            runner.kv_tier.close()


def test_the_flag_and_its_environment_variable_set_the_config(monkeypatch):
    import argparse

    from services.worker.server import add_args

    def config(argv: list[str]) -> WorkerConfig:
        p = argparse.ArgumentParser()
        add_args(p)
        return WorkerConfig.from_args(p.parse_args(argv))

    assert config([]).kv_offload_dir == ""
    assert config(["--kv-offload-dir", "/data/kv"]).kv_offload_dir == "/data/kv"
    monkeypatch.setenv("PAGEDSERVE_KV_OFFLOAD_DIR", "/env/kv")
    assert config([]).kv_offload_dir == "/env/kv"
