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
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.log import quiet_libraries

#: One call of any driver rank at a time: the state they swap is the process's.
_CALLS = threading.RLock()


class ProcessState:
    """The process-wide state one rank keeps to itself; ``with state:`` makes it current and
    puts the previous one back after, remembering what the rank changed for next time."""

    def __init__(self, env: Mapping[str, str], threads: int):
        import numpy as np
        import torch

        self.env = dict(env)
        self.threads = threads
        # a fresh process's generators: seeded from the OS, as torch, random and NumPy seed themselves
        generator = torch.Generator()
        generator.seed()
        self.torch_rng = generator.get_state()
        self.python_rng = random.Random().getstate()
        self.numpy_rng = np.random.RandomState().get_state()
        self.deterministic = (False, False)  # torch.use_deterministic_algorithms(mode, warn_only=...)
        self.default_dtype = torch.float32
        self._saved: list[Any] = []

    def __enter__(self) -> ProcessState:
        import numpy as np
        import torch

        _CALLS.acquire()
        self._saved.append((
            {name: os.environ.get(name) for name in self.env},
            torch.get_num_threads(),
            torch.get_rng_state(), random.getstate(), np.random.get_state(),
            (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
            torch.get_default_dtype(),
        ))
        os.environ.update(self.env)
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_default_dtype(self.default_dtype)
        return self

    def __exit__(self, *exc_info: object) -> None:
        import numpy as np
        import torch

        env, threads, torch_rng, python_rng, numpy_rng, deterministic, dtype = self._saved.pop()
        try:
            self.torch_rng = torch.get_rng_state()
            self.python_rng = random.getstate()
            self.numpy_rng = np.random.get_state()
            self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled())
            self.default_dtype = torch.get_default_dtype()
            for name, value in env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            torch.set_num_threads(threads)
            torch.set_rng_state(torch_rng)
            random.setstate(python_rng)
            np.random.set_state(numpy_rng)
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
            torch.set_default_dtype(dtype)
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

        if self.worker is None:
            return DriverCall(error=RuntimeError("the rank was shut down"))
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
