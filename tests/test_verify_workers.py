"""What runs shard verification: threads for work that releases the GIL, one thread or forked processes for
work that holds it, chosen from a measured first batch."""

from __future__ import annotations

import os

import pytest

from eyas.verify import workers
from eyas.verify.workers import PROCESS_MIN_S, choose_workers, run_batches


def choose(holds_gil=True, num_workers=0, cores=2, seconds_left=10.0, fork=True):
    return choose_workers(holds_gil=holds_gil, num_workers=num_workers, cores=cores, seconds_left=seconds_left,
                          fork=fork)  # fmt: skip


def test_work_that_releases_the_gil_runs_on_threads():
    assert choose(holds_gil=False) == ("threads", 2)
    assert choose(holds_gil=False, num_workers=8) == ("threads", 8)


def test_work_that_holds_the_gil_runs_on_processes_when_enough_is_left():
    assert choose(seconds_left=PROCESS_MIN_S * 2) == ("processes", 2)
    assert choose(cores=16, num_workers=4) == ("processes", 4)
    assert choose(cores=2, num_workers=8) == ("processes", 2)  # never more processes than usable cores


def test_work_that_holds_the_gil_never_runs_on_threads():
    assert choose(seconds_left=PROCESS_MIN_S / 2) == ("one thread", 1)  # a pool's start-up would cost more
    assert choose(cores=1) == ("one thread", 1)
    assert choose(fork=False) == ("one thread", 1)


def test_one_worker_is_one_thread_whatever_the_work():
    assert choose(num_workers=1) == choose(holds_gil=False, num_workers=1) == ("one thread", 1)


def test_negative_worker_count_is_refused():
    with pytest.raises(ValueError, match=r"num_workers=-1: expected >= 0 \(0 = one per usable core\)"):
        choose(num_workers=-1)


@pytest.mark.skipif(workers.usable_cores() < 2 or not workers.can_fork(), reason="needs 2 cores and fork")
def test_processes_return_every_row_in_order_and_inherit_what_the_batch_closes_over(monkeypatch):
    monkeypatch.setattr(workers, "PROCESS_MIN_S", 0.0)
    monkeypatch.setattr(workers, "PROCESS_GAIN", 0.0)  # keep the processes whatever their rate
    monkeypatch.setattr(workers, "FIRST_BATCH", 3)
    table = {f"n{i}": i * i for i in range(500)}
    unpicklable = lambda: None  # noqa: E731 (a closure over it could not be sent to a spawned process)

    def batch(names):
        assert unpicklable() is None
        return [(name, table[name], os.getpid()) for name in names]

    seen = []
    rows, how = run_batches(batch, list(table), holds_gil=True, on_batch=lambda rows: seen.append(len(rows)))
    assert how == "2 processes"
    assert [(n, v) for n, v, _ in rows] == list(table.items())
    assert {pid for *_, pid in rows[3:]}.isdisjoint({os.getpid()})  # past the timed first batch: other processes
    assert seen[0] == 3 and seen[-1] == 500 and seen == sorted(seen)


def test_a_short_list_stays_on_one_thread():
    rows, how = run_batches(lambda names: [n.upper() for n in names], ["a", "b"], holds_gil=True)
    assert (rows, how) == (["A", "B"], "one thread")


def test_no_names_start_no_workers():
    assert run_batches(lambda names: 1 / 0, [], holds_gil=False) == ([], "one thread")


@pytest.mark.skipif(workers.usable_cores() < 2 or not workers.can_fork(), reason="needs 2 cores and fork")
def test_processes_slower_than_one_thread_hand_the_rest_back(monkeypatch):
    monkeypatch.setattr(workers, "PROCESS_MIN_S", 0.0)
    monkeypatch.setattr(workers, "PROCESS_GAIN", 1e9)  # no rate is enough: as if other work held the cores
    monkeypatch.setattr(workers, "FIRST_BATCH", 3)
    monkeypatch.setattr(workers, "PROCESS_BATCH", 10)
    names = [f"n{i}" for i in range(500)]

    def batch(names):
        return [(name, os.getpid()) for name in names]

    rows, how = run_batches(batch, names, holds_gil=True)
    assert how == "one thread (processes were slower)"
    assert [n for n, _ in rows] == names
    by_process = [pid != os.getpid() for _, pid in rows]
    # the first batch here, the first two rounds and the batches in flight on the processes, the rest here
    assert by_process == [False] * 3 + [True] * 70 + [False] * (500 - 73)
