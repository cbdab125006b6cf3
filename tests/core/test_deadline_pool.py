"""The per-job deadline process pool: results, timeouts, job errors, dead workers, threads.

Job functions are standard-library functions, which worker processes import by name.
"""

from __future__ import annotations

import operator
import os
import threading
import time

import pytest

from posttrain.deadline_pool import DeadlinePool


@pytest.fixture
def sleep_pool():
    pool = DeadlinePool(time.sleep, num_workers=2, timeout_s=1.5)
    yield pool
    pool.close()


def test_results_come_back_in_job_order():
    pool = DeadlinePool(pow, num_workers=2, timeout_s=30)
    try:
        results = pool.map([(2, 10), (3, 3), (7, 0), (5, 2)])
    finally:
        pool.close()
    assert [r.status for r in results] == ["ok"] * 4
    assert [r.value for r in results] == [1024, 27, 1, 25]


def test_a_job_past_its_deadline_is_given_up_and_its_worker_replaced(sleep_pool):
    sleep_pool.map([(0,)])  # both workers started
    pids_before = {w.process.pid for w in sleep_pool._workers}
    start = time.monotonic()
    results = sleep_pool.map([(0.05,), (60,), (0.05,), (0.05,)])
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["ok", "timeout", "ok", "ok"]
    assert results[1].error == "did not finish within 1.5 s"
    assert elapsed < 15, "the stuck job must not hold the call for its full 60 s"
    pids_after = {w.process.pid for w in sleep_pool._workers}
    assert len(pids_after) == 2 and len(pids_before & pids_after) == 1  # exactly the stuck worker was replaced
    assert [r.status for r in sleep_pool.map([(0.01,)] * 3)] == ["ok"] * 3


def test_an_exception_fails_only_its_job():
    pool = DeadlinePool(operator.truediv, num_workers=1, timeout_s=30)
    try:
        results = pool.map([(1, 2), (1, 0), (9, 3)])
    finally:
        pool.close()
    assert [r.status for r in results] == ["ok", "error", "ok"]
    assert results[1].error == "ZeroDivisionError: division by zero"
    assert [results[0].value, results[2].value] == [0.5, 3.0]


def test_a_job_whose_worker_dies_twice_fails_and_the_worker_is_replaced():
    pool = DeadlinePool(os._exit, num_workers=1, timeout_s=30)
    try:
        results = pool.map([(3,)])
        assert results[0].status == "error" and results[0].worker_died
        assert results[0].error == "the worker process died (exit code 3)"
        assert pool._workers[0].process.poll() is None  # a fresh worker is running
    finally:
        pool.close()


def die_once(marker: str) -> str:
    """Kill this worker process the first time (``marker`` does not exist yet)."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    return "second run"


def test_a_job_whose_worker_was_killed_under_it_runs_once_more(tmp_path):
    pool = DeadlinePool(die_once, num_workers=2, timeout_s=30)
    try:
        results = pool.map([(str(tmp_path / "a"),), (str(tmp_path / "b"),)])
        assert [(r.status, r.value) for r in results] == [("ok", "second run"), ("ok", "second run")]
    finally:
        pool.close()


def test_deadlines_work_off_the_main_thread(sleep_pool):
    out = {}
    thread = threading.Thread(target=lambda: out.update(results=sleep_pool.map([(60,), (0.01,)])))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert [r.status for r in out["results"]] == ["timeout", "ok"]


def test_close_stops_every_worker():
    pool = DeadlinePool(time.sleep, num_workers=2, timeout_s=5)
    processes = [w.process for w in pool._workers]
    pool.close()
    pool.close()
    assert all(p.poll() is not None for p in processes)


@pytest.mark.parametrize(("kwargs", "message"), [({"num_workers": 0, "timeout_s": 1}, "num_workers"), ({"num_workers": 1, "timeout_s": 0}, "timeout_s")])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeadlinePool(time.sleep, **kwargs)


def test_a_job_function_that_cannot_be_imported_fails_the_constructor():
    def local_function():  # not importable by name from a fresh interpreter
        pass

    with pytest.raises(RuntimeError, match=r"a worker process for .*local_function did not start within 30 s or died while starting \(exit code 1\)"):
        DeadlinePool(local_function, num_workers=1, timeout_s=1, start_timeout_s=30)
