"""A worker group's single rank in the driver's own process (``policy.in_driver``).

A small run on one machine spends more time starting worker processes (each imports torch
and transformers, seconds of CPU) than computing. :class:`DriverRank` runs the one rank of a
group as a plain object of this process instead, and keeps the process state a rank's own
process would have to itself, so that a run computes the same numbers either way:

- the variables of its rank (``RANK``, ``MASTER_PORT``, ...) and of ``resources.env_vars``;
- torch's thread count: an actor's ``OMP_NUM_THREADS`` (its ``resources.env_vars``, else
  Ray's: its CPUs), so a reduction splits the same way;
- the random generators (torch's CPU generator, Python's ``random``, NumPy's global one),
  which the driver seeds and draws from too;
- torch's deterministic-algorithms flag and default dtype;
- what the libraries print (:func:`~posttrain.log.quiet_libraries`, as a worker's
  environment sets it).

Each call swaps that state in, runs, and swaps the driver's back (:class:`ProcessState`).
Arguments and results are copied as Ray sends them (:func:`as_sent`), never shared.
Calls of every driver rank take one lock, so two never interleave (an actor runs one call at
a time too). What a separate process gives and this does not: isolation from a crash (a rank
that kills its process kills the run's driver) and parallel work beside the driver.
"""

from __future__ import annotations

import gc
import os
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from posttrain.log import quiet_libraries

#: One call of any driver rank at a time: the state they swap is the process's.
_CALLS = threading.RLock()


class Snapshot(NamedTuple):
    """What :class:`ProcessState` swaps: the values of some environment variables (None:
    unset), torch's thread count, the three random generators' states, torch's
    deterministic flag (mode, warn only) and default dtype."""

    env: dict[str, str | None]
    threads: int
    torch_rng: Any
    python_rng: Any
    numpy_rng: Any
    deterministic: tuple[bool, bool]
    dtype: Any

    @classmethod
    def now(cls, names: Iterable[str]) -> Snapshot:
        """This process's state now, with the environment variables ``names``."""
        import numpy as np
        import torch

        return cls({name: os.environ.get(name) for name in names}, torch.get_num_threads(), torch.get_rng_state(),
                   random.getstate(), np.random.get_state(),
                   (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
                   torch.get_default_dtype())

    def restore(self) -> None:
        """Make this the process's state."""
        import numpy as np
        import torch

        for name, value in self.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_default_dtype(self.dtype)


class ProcessState:
    """The process-wide state one rank keeps to itself; ``with state:`` makes it current and
    puts the previous one back after, remembering what the rank changed for next time. It
    starts as a fresh process's: ``env`` set, ``threads`` threads, generators seeded from the
    OS (as torch, random and NumPy seed themselves), deterministic algorithms off, float32."""

    def __init__(self, env: Mapping[str, str], threads: int):
        import numpy as np
        import torch

        generator = torch.Generator()
        generator.seed()
        self._own = Snapshot(dict(env), threads, generator.get_state(), random.Random().getstate(),
                             np.random.RandomState().get_state(), (False, False), torch.float32)
        self._saved: list[Snapshot] = []

    def __enter__(self) -> ProcessState:
        _CALLS.acquire()
        try:
            self._saved.append(Snapshot.now(self._own.env))
            self._own.restore()
        except BaseException:
            _CALLS.release()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._own = Snapshot.now(self._own.env)
            self._saved.pop().restore()
        finally:
            _CALLS.release()


class DriverCall:
    """What one call of a :class:`DriverRank` returned or raised; stands where an actor's
    call would give an ``ObjectRef`` (:meth:`hex` names it for the group's bookkeeping)."""

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value = value
        self.error = error

    def hex(self) -> str:
        return f"driver-call-{id(self):x}"


class DriverRank:
    """``worker_cls(*args, **kwargs)`` built and called in this process under its own
    :class:`ProcessState` (``env``: the rank's variables; ``threads``: torch's thread count)."""

    def __init__(self, worker_cls: type, env: Mapping[str, str], threads: int, args: tuple[Any, ...],
                 kwargs: dict[str, Any]):
        self.state = ProcessState(env, threads)
        with self.state, quiet_libraries():
            self.worker: Any = worker_cls(*args, **kwargs)

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DriverCall:
        """Run the worker's method ``name``; arguments that are Ray ``ObjectRef`` s are
        resolved first, as Ray resolves an actor call's."""
        import ray

        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        kwargs = {k: ray.get(v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()}
        method: Callable[..., Any] = getattr(self.worker, name)
        try:
            args, kwargs = as_sent((args, kwargs))
            with self.state, quiet_libraries():
                result = method(*args, **kwargs)
            return DriverCall(as_sent(result))
        except Exception as error:  # noqa: BLE001 -- handed to the caller, as a failed actor call's
            return DriverCall(error=error)

    def close(self) -> None:
        """Drop the worker and free what it held."""
        self.worker = None
        gc.collect()


def as_sent(value: Any) -> Any:
    """``value`` as it arrives when Ray sends it to or from an actor: a copy through the object
    store. The rank and the driver never share an object, so a rank that changes its
    weights in place cannot change a result the driver holds, nor the driver an argument."""
    import ray

    return ray.get(ray.put(value))


def rank_threads(cpus: float, omp_num_threads: str | None = None) -> int:
    """torch's thread count in a rank given ``cpus`` logical CPUs: what an actor's torch
    reads from ``OMP_NUM_THREADS``, the worker's own setting (``resources.env_vars``) or else
    Ray's, the actor's CPUs."""
    return max(1, int(omp_num_threads) if omp_num_threads else int(cpus))
