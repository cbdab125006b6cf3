"""The ``code`` environment: does the model's Python pass the sample's tests?

The program is the last assistant message's ```python block (see
:func:`~posttrain_env_code.extract.extract_code`; dedented), run in a :class:`~posttrain_env_code.sandbox.Sandbox`.
Each sample's metadata holds its tests, in either or both of two forms:

- ``"tests"``: Python snippets (typically ``assert`` statements) run one after another in
  the program's namespace (the program runs as module ``solution``, so an
  ``if __name__ == "__main__":`` block does not run). One sandbox run per sample. A snippet
  passes when it raises nothing; none runs when the program itself raised or exited; a run
  stopped at its deadline credits the snippets finished before it.
- ``"cases"``: ``[{"input": str, "output": str}, ...]``. The program runs as ``__main__``
  with ``input`` on stdin, one sandbox run per case; a case passes when the program exits
  with status 0 and its stdout equals ``output``, compared line by line ignoring trailing
  whitespace and trailing blank lines.

Reward (option ``reward``): ``fraction`` of tests and cases passed (default), or ``all``
(1.0 only when every one passes). One turn: always terminated, empty observation. Options
are listed in :class:`~posttrain_env_code.options.CodeOptions`.

Returned metadata: the input's plus ``code`` (the program run), ``tests_passed``,
``tests_total`` and ``code_status``: ``passed``; else the first that applies of
``timeout``, ``memory`` (address-space limit), ``error`` (the program raised or crashed),
``failed`` (wrong results); or ``no_code`` (nothing to run), ``invalid`` (the sample's
metadata has no usable tests) and ``sandbox_error`` (the sandbox itself failed); the last
two are also reported in ``EnvironmentReturn.errors``.
"""

from __future__ import annotations

import concurrent.futures
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain_env_code.extract import extract_code
from posttrain_env_code.options import CodeOptions
from posttrain_env_code.sandbox import RunResult, Sandbox, SandboxError, SandboxLimits

_STATUS_ORDER = ("timeout", "memory", "error")  # which problem names a sample that did not pass


@attrs.frozen
class _Spec:
    """A sample's tests, read from its metadata."""

    tests: tuple[str, ...]
    cases: tuple[tuple[str, str], ...]  # (stdin, expected stdout)

    @property
    def total(self) -> int:
        return len(self.tests) + len(self.cases)


@attrs.define
class _Score:
    """A sample's results, filled in as its runs finish."""

    passed: int = 0
    problems: set[str] = attrs.field(factory=set)  # statuses seen: timeout, memory, error, failed
    error: str | None = None  # a sandbox failure (not the program's)


class CodeEnvironment(Environment):
    def __init__(self, options: CodeOptions):
        self.options = options
        limits = SandboxLimits(
            timeout_s=options.timeout_s,
            memory_mb=options.memory_mb,
            max_output_bytes=options.max_output_bytes,
            max_processes=options.max_processes,
            disk_mb=options.disk_mb,
        )
        try:
            self.sandbox = Sandbox(limits, namespaces=options.namespaces)
        except SandboxError as exc:
            raise SandboxError(f"environments.code.namespaces={options.namespaces!r}: {exc}") from exc
        self._pool = concurrent.futures.ThreadPoolExecutor(options.max_concurrency, thread_name_prefix="code-sandbox")

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        n = len(message_logs)
        codes = [textwrap.dedent(extract_code(last_assistant_text(log))).strip("\n") for log in message_logs]
        specs: list[_Spec | None] = []
        errors: list[str | None] = []
        for meta in metadata:
            spec, problem = read_spec(meta)
            specs.append(spec)
            errors.append(problem)
        scores = [_Score() for _ in range(n)]
        futures = {}
        for i, (code, spec) in enumerate(zip(codes, specs, strict=True)):
            if spec is None or not code.strip():
                continue
            if spec.tests:
                futures[self._pool.submit(self.sandbox.run, code, tests=spec.tests)] = (i, None)
            for stdin, expected in spec.cases:
                futures[self._pool.submit(self.sandbox.run, code, stdin=stdin)] = (i, expected)
        for future in concurrent.futures.as_completed(futures):
            i, expected = futures[future]
            try:
                _score_run(scores[i], future.result(), expected, len(specs[i].tests))
            except SandboxError as exc:
                scores[i].error = f"the sandbox failed: {exc}"
        rewards = torch.zeros(n, dtype=torch.float32)
        out_metadata = []
        for i in range(n):
            spec, score = specs[i], scores[i]
            errors[i] = errors[i] or score.error
            total = spec.total if spec is not None else 0
            if total and errors[i] is None:
                all_passed = score.passed == total
                rewards[i] = float(all_passed) if self.options.reward == "all" else score.passed / total
            out_metadata.append(
                {
                    **(metadata[i] if isinstance(metadata[i], Mapping) else {}),
                    "code": codes[i],
                    "tests_passed": score.passed,
                    "tests_total": total,
                    "code_status": _status(spec, codes[i], score, errors[i]),
                }
            )
        return EnvironmentReturn.final(rewards, out_metadata, answers=list(codes), errors=errors)

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        """``pass_rate`` (mean fraction of tests passed per sample), ``solve_rate`` (fraction of
        samples passing every test), and counts of samples with a ``timeouts``,
        ``memory_kills``, ``errors`` (the program raised or crashed) or ``no_code``."""
        rows = [m for m in metadata if isinstance(m, Mapping) and "code_status" in m]
        if not rows:
            return {}

        def count(status: str) -> float:
            return float(sum(m["code_status"] == status for m in rows))

        return {
            "pass_rate": sum(m["tests_passed"] / m["tests_total"] if m["tests_total"] else 0.0 for m in rows)
            / len(rows),
            "solve_rate": count("passed") / len(rows),
            "timeouts": count("timeout"),
            "memory_kills": count("memory"),
            "errors": count("error"),
            "no_code": count("no_code"),
        }

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _score_run(score: _Score, result: RunResult, expected: str | None, num_tests: int) -> None:
    """Add one run's outcome to its sample's score (``expected`` is None for the snippet run)."""
    if result.timed_out:
        score.problems.add("timeout")
    if result.memory_exceeded:
        score.problems.add("memory")
    if expected is None:
        score.passed += result.tests_passed
        crashed = result.solution_status in ("error", "exit") or (
            result.solution_status is None and not result.timed_out
        )
        if result.tests_passed < num_tests:
            score.problems.add("error" if crashed else "failed")
        return
    if result.exit_code == 0 and not result.output_truncated and _lines(result.stdout) == _lines(expected):
        score.passed += 1
    elif result.exit_code not in (0, None) or result.killed_by_signal not in (None, 9):
        score.problems.add("error")
    else:
        score.problems.add("failed")


def _status(spec: _Spec | None, code: str, score: _Score, error: str | None) -> str:
    if spec is None:
        return "invalid"
    if error is not None:
        return "sandbox_error"
    if not code.strip():
        return "no_code"
    if score.passed == spec.total:
        return "passed"
    return next((status for status in _STATUS_ORDER if status in score.problems), "failed")


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def read_spec(meta: Any) -> tuple[_Spec | None, str | None]:
    """The sample's tests, or ``(None, what is wrong)``."""
    expected = "'tests' (a list of Python snippets) and/or 'cases' (a list of {'input': str, 'output': str})"
    if not isinstance(meta, Mapping) or ("tests" not in meta and "cases" not in meta):
        return None, f"the sample's metadata has no tests: the code environment needs {expected}"
    tests, cases = meta.get("tests", []), meta.get("cases", [])
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        return None, f"the sample's metadata 'tests' must be a list of str, found {tests!r:.200}"
    if not isinstance(cases, list) or not all(
        isinstance(c, Mapping) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str) for c in cases
    ):
        return (
            None,
            f"the sample's metadata 'cases' must be a list of {{'input': str, 'output': str}}, found {cases!r:.200}",
        )
    if not tests and not cases:
        return None, f"the sample's metadata holds no tests: the code environment needs {expected}"
    return _Spec(tuple(tests), tuple((c["input"], c["output"]) for c in cases)), None


def last_assistant_text(message_log: Sequence[Message]) -> str:
    """The content of the last assistant message ("" when there is none)."""
    for message in reversed(message_log):
        if message.get("role") == "assistant":
            return str(message.get("content", ""))
    return ""

