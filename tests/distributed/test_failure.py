"""Single-process tests of the failure protocol (:mod:`muonkit.distributed.collectives`), no ranks launched.

Two ranks are simulated by two channels on one store (a HashStore), their collectives by works
that complete when told. The launched checks are in ``scenario_failure.py``.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from muonkit.distributed.base import StrategyStats
from muonkit.distributed.collectives import Collectives, FailureChannel, RankFailedError, every_rank

_NAMES = itertools.count()


class Group:
    """What a channel asks of a process group: its store, its sequence number and its name (the same
    on every rank: the simulated ranks of one test share one, and no other test's)."""

    def __init__(self, store: Any, name: str | None = None) -> None:
        self.store = store
        self.group_name = name if name is not None else f"stub-{id(store)}-{next(_NAMES)}"

    def get_group_store(self) -> Any:
        return self.store

    def _get_sequence_number_for_group(self) -> int:
        return 7


class Counted:
    """A store that counts the calls it gets."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.store, name)


class Work:
    """A collective that completes when ``done`` is set (``wait(timeout)`` raises as torch's does)."""

    def __init__(self, done: bool = False) -> None:
        self.done = threading.Event()
        if done:
            self.done.set()
        self.waits: list[datetime.timedelta | None] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class CompletesOnThirdWait(Work):
    """A collective whose other ranks arrive during this rank's third wait (whatever the machine's load)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if len(self.waits) >= 2:
            self.done.set()
        return super().wait(timeout)


def _ranks(store: Any, world_size: int = 2) -> list[FailureChannel]:
    group = Group(store)  # one group, as every rank of a real one sees it
    return [FailureChannel(group, rank, world_size) for rank in range(world_size)]


def test_a_wait_that_completes_within_its_first_slice_reads_nothing() -> None:
    store = Counted()
    me, _ = _ranks(store)
    me.begin()
    work = Work(done=True)
    me.wait(work)
    assert store.calls == 0
    assert work.waits[0] == datetime.timedelta(seconds=0.01)


def test_a_waiting_rank_raises_soon_after_the_failure_and_refuses_to_step_again() -> None:
    """Rank 1 raises before its first collective while rank 0 waits in the agreement: rank 0 raises
    RankFailedError naming it within a slice; rank 1 waits until rank 0 left, then knows the group
    is out of step; both refuse the next step."""
    waiting, failing = _ranks(dist.HashStore())
    waiting.begin()
    waiting.issue()
    error = RuntimeError("CUDA out of memory (injected)")

    def fail() -> None:
        time.sleep(0.3)
        failing.failed(error, applied=False)

    thread = threading.Thread(target=fail)
    thread.start()
    start = time.monotonic()
    with pytest.raises(RankFailedError) as raised:
        waiting.wait(Work())
    took = time.monotonic() - start
    thread.join()
    assert 0.3 <= took < 1.5, took
    e = raised.value
    assert (e.rank, e.applied_there) == (1, False)
    assert "rank 1 raised inside HybridMuon.step(): RuntimeError: CUDA out of memory (injected)" in str(e)
    assert "out of step" in " ".join(getattr(error, "__notes__", [""])) or not hasattr(error, "add_note")
    for rank in (waiting, failing):
        with pytest.raises(RuntimeError, match="cannot step on this process group any more: rank 1 raised"):
            rank.begin()


def test_a_collective_the_failed_rank_had_issued_is_waited_for_not_abandoned() -> None:
    """Rank 1 fails after issuing the step's first two collectives, while rank 0 still waits for the
    second (it completes: rank 1 took part): rank 0 waits for it and raises nothing in this step;
    for a third collective, which rank 1 never issued, it raises."""
    waiting, failing = _ranks(dist.HashStore())
    for rank in (waiting, failing):
        rank.begin()
        rank.issue()
    failing.issue()
    second = waiting.issue()
    work = Work()
    failing.failed(RuntimeError("bug after the exchanges"), applied=True)
    threading.Timer(0.2, work.done.set).start()  # completes after a few slices in which the record is there
    waiting.wait(work, second)
    assert work.is_completed() and len(work.waits) >= 2
    with pytest.raises(RankFailedError):
        waiting.wait(Work(), waiting.issue())


def test_every_rank_failing_before_the_first_collective_leaves_the_group_in_step() -> None:
    ranks = _ranks(dist.HashStore())
    errors = [ValueError(f"bad lr on rank {r}") for r in range(2)]
    threads = [
        threading.Thread(target=r.failed, args=(e,), kwargs={"applied": False})
        for r, e in zip(ranks, errors, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, error in zip(ranks, errors, strict=True):
        assert rank.out_of_step is None
        rank.begin()  # steps again
        if hasattr(error, "add_note"):
            assert "the process group is in step" in error.__notes__[0]


def test_the_next_optimizer_on_the_group_does_not_read_a_step_every_rank_failed() -> None:
    """Every rank fails its first step before any collective (the group's sequence number stays
    where it was); a new optimizer's channels on the same groups wait for their first step's
    collective without reading that failure (CI: a refused layout, then the next scenario's
    optimizer raised RankFailedError naming the refused layout's error)."""
    store = dist.HashStore()
    group = Group(store)
    first = [FailureChannel(group, rank, 2) for rank in range(2)]
    threads = [
        threading.Thread(target=r.failed, args=(ValueError("unsupported layout"),), kwargs={"applied": False})
        for r in first
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waiting, _ = (FailureChannel(group, rank, 2) for rank in range(2))
    waiting.begin()
    work = CompletesOnThirdWait()  # the other rank arrives after two slices, each followed by a read
    waiting.wait(work, waiting.issue())
    assert work.is_completed() and len(work.waits) == 3 and waiting.out_of_step is None


def test_errors_every_rank_raises_alike_and_waiting_ranks_write_nothing() -> None:
    store = Counted()
    me, _ = _ranks(store)
    me.begin()
    me.issue()
    me.failed(every_rank(FloatingPointError("non-finite gradient")), applied=False)
    me.failed(RankFailedError({"rank": 1, "error": "x", "applied": True}, here=0), applied=True)
    assert store.calls == 0 and me.out_of_step is None


def test_a_rank_that_failed_after_a_collective_is_out_of_step_at_once() -> None:
    store = Counted()
    me, other = _ranks(store)
    me.begin()
    me.issue()
    start = time.monotonic()
    me.failed(RuntimeError("bug"), applied=True)
    assert time.monotonic() - start < 0.5  # no wait for the others: it never steps again
    assert me.out_of_step is not None
    other.begin()
    with pytest.raises(RankFailedError, match=r"partly applied \(a step .*\) on rank 0"):
        other.wait(Work())  # a later step of another rank learns it from the group's key


def test_without_a_store_waits_are_plain_and_failures_tell_nobody() -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("store gone")

    me, _ = _ranks(Broken())
    me.begin()
    work = Work(done=True)
    me.wait(work)
    me.issue()
    me.failed(RuntimeError("bug"), applied=False)  # never raises
    assert me.out_of_step is not None


def test_only_host_collectives_are_waited_for_in_slices(one_rank: None) -> None:
    """A device collective (NCCL) blocks no host: its wait() only orders the stream and must stay
    that (a wait with a timeout would block the host until the device is done)."""
    comm = Collectives(dist.group.WORLD, StrategyStats())
    on_host, on_device = Work(done=True), Work(done=True)
    comm.wait(on_host, torch.zeros(1))
    comm.wait(on_device, torch.empty(1, device="meta"))
    assert on_host.waits[0] == datetime.timedelta(seconds=0.01)
    assert on_device.waits == [None]


def test_a_restarted_job_does_not_read_the_failure_of_the_run_it_replaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent keeps its store across restarts (``--max-restarts``): the restarted ranks'
    waits must not find the previous run's failure (the key names the restart)."""
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    before, _ = _ranks(store)
    before.begin()
    before.issued = True
    before.failed(RuntimeError("bug"), applied=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    after, _ = _ranks(store)
    after.begin()
    work = Work()
    threading.Timer(0.3, work.done.set).start()
    after.wait(work)  # a slow collective of the new run, not a failure
    assert after.out_of_step is None
