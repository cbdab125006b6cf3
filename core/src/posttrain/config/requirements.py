"""Python packages a plugin's config section needs at run time, checked before Ray starts.

A section class (``policy.<backend>``, ``generation.<backend>``, ``data_plane.<backend>``)
lists them in a class attribute ``requires``: a tuple of :class:`Requirement`. When the run
selects the backend, :func:`posttrain.config.validate.check_requirements` looks each package
up (without importing it) and refuses the run naming the key, the package and the command
that installs it; ``posttrain plugins`` shows what each section requires and whether it is
there. Imports nothing heavy.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import attrs


@attrs.frozen
class Requirement:
    """A package a section needs: ``module`` is its import name, ``install`` the command that
    installs it (e.g. ``pip install 'posttrain-vllm[cpu]'``); ``distribution`` and ``minimum``
    add a version check (the installed distribution at least ``minimum``)."""

    module: str
    install: str
    distribution: str | None = None
    minimum: str | None = None

    def problem(self) -> str | None:
        """What is wrong with this environment for the requirement, or None when it is met."""
        if importlib.util.find_spec(self.module) is None:
            return f"the Python package '{self.module}' is not installed"
        if self.distribution is None or self.minimum is None:
            return None
        from packaging.version import Version

        try:
            found = importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"the distribution '{self.distribution}' is not installed"
        if Version(found) < Version(self.minimum):
            return f"{self.distribution} {found} is installed, older than the {self.minimum} it needs"
        return None


def section_requirements(section_class: type) -> tuple[Requirement, ...]:
    """What ``section_class`` declares in ``requires`` (nothing when it declares nothing)."""
    return tuple(getattr(section_class, "requires", ()))
