"""Rounds produced ahead of training: the bound on how far ahead, order, pauses, errors, close.

The producer runs real threads here; ``produce`` stands in for a rollout with random
delays, and the "trainer" refits by bumping a version counter after each step.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from posttrain_grpo.rounds import RoundProducer


class Trainer:
    """Steps that take rounds, train for a random while, then publish the next weights."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.version = 0  # the weights the engines hold: version s after step s's refit
        self.lock = threading.Lock()
        self.produced: list[int] = []

    def produce(self, round_: int) -> tuple[int, int]:
        """A rollout: (round, oldest weight version that generated it); a refit may land
        in the middle of it (in-flight updates), so the oldest is read at its start."""
        with self.lock:
            oldest = self.version
        time.sleep(self.rng.uniform(0, 0.004))
        self.produced.append(round_)
        return round_, oldest


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_no_round_is_older_than_the_bound_and_each_is_taken_once_in_order(seed, ahead):
    trainer = Trainer(random.Random(seed))
    producer = RoundProducer(trainer.produce, ahead=ahead, first_round=1, last_round=12)
    staleness = []
    for step in range(1, 13):
        taken = producer.take(step)
        assert taken is not None and taken[0] == step
        staleness.append((step - 1) - taken[1])  # the trainer holds version step - 1
        time.sleep(trainer.rng.uniform(0, 0.004))  # training
        with producer.refit_window(), trainer.lock:
            trainer.version = step
    assert producer.close() == {}
    assert max(staleness) <= ahead
    assert trainer.produced == list(range(1, 13))  # every round once, in order, none past last_round
    if ahead == 0:
        assert staleness == [0] * 12  # synchronous: always the trainer's own weights


def test_with_ahead_zero_nothing_is_produced_before_it_is_asked_for():
    started = []
    producer = RoundProducer(lambda t: started.append(t) or t, ahead=0, first_round=3, last_round=9)
    time.sleep(0.05)
    assert started == []
    assert producer.take(3) == 3
    time.sleep(0.05)
    assert started == [3]  # round 4 waits for step 4
    producer.close()


def test_rounds_run_ahead_while_the_trainer_is_busy():
    producer = RoundProducer(lambda t: t, ahead=2, first_round=1, last_round=5)
    assert producer.take(1) == 1
    deadline = time.monotonic() + 5
    while len(producer._done) < 2 and time.monotonic() < deadline:  # rounds 2 and 3 fill in meanwhile
        time.sleep(0.01)
    assert sorted(producer.close()) == [2, 3]  # produced, never taken: the caller counts them as discarded


def test_no_round_starts_while_paused_and_a_pause_waits_for_the_round_in_progress():
    inside = threading.Event()
    finish = threading.Event()
    log = []

    def produce(t):
        log.append(("start", t))
        inside.set()
        finish.wait(5)
        log.append(("end", t))
        return t

    producer = RoundProducer(produce, ahead=1, first_round=1, last_round=3, in_flight_weight_updates=False)
    taker = threading.Thread(target=producer.take, args=(1,))
    taker.start()
    assert inside.wait(5)
    threading.Timer(0.1, finish.set).start()
    with producer.refit_window():  # off in-flight updates: waits for round 1 to end
        log.append(("refit", None))
        time.sleep(0.05)
        assert ("start", 2) not in log  # round 2 was allowed but held
    taker.join(5)
    assert log[:3] == [("start", 1), ("end", 1), ("refit", None)]
    producer.close()


def test_an_error_in_a_round_is_raised_by_take_and_stops_production():
    def produce(t):
        if t == 2:
            raise ValueError("environment crashed in round 2")
        return t

    producer = RoundProducer(produce, ahead=1, first_round=1, last_round=4)
    assert producer.take(1) == 1
    with pytest.raises(ValueError, match="environment crashed in round 2"):
        producer.take(2)
    producer.close()


def test_when_the_data_runs_out_the_round_and_every_later_one_are_none():
    producer = RoundProducer(lambda t: t if t < 3 else None, ahead=2, first_round=1, last_round=9)
    assert [producer.take(step) for step in (1, 2, 3, 4)] == [1, 2, None, None]
    producer.close()


def test_rounds_past_the_last_are_never_produced():
    produced = []
    producer = RoundProducer(lambda t: produced.append(t) or t, ahead=5, first_round=1, last_round=2)
    assert producer.take(1) == 1 and producer.take(2) == 2
    producer.close()
    assert produced == [1, 2]


def test_a_closed_producer_refuses_to_hand_out_rounds():
    producer = RoundProducer(lambda t: t, ahead=0, first_round=1, last_round=2)
    producer.close()
    with pytest.raises(RuntimeError, match="rollout producer is closed; round 1 cannot be taken"):
        producer.take(1)
