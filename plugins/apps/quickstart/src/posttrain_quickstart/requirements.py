"""What the quickstart needs installed, checked before it builds or trains anything."""

from __future__ import annotations

import importlib

from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host

#: (registry, name, the distribution that registers it), for every plugin the runs name.
PLUGINS = (
    ("policy_backends", "dtensor", "posttrain-dtensor"),
    ("generation_backends", "hf", "posttrain-hf"),
    ("algorithms", "sft", "posttrain-sft"),
    ("algorithms", "grpo", "posttrain-grpo"),
    ("algorithms", "eval", "posttrain-eval"),
    ("environments", "math", "posttrain-env-math"),
)
#: (module, the distribution that provides it).
MODULES = (("matplotlib", "matplotlib"),)


def check_requirements() -> None:
    """Raise :class:`ConfigError` naming every missing piece and the pip command that adds
    them all; return nothing when everything is installed."""
    host = plugin_host()
    missing = [dist for registry, name, dist in PLUGINS if name not in host.registry(f"posttrain_{registry}")]
    for module, dist in MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(dist)
    if missing:
        raise ConfigError(
            f"posttrain quickstart needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed; nothing was run. Install with: pip install {' '.join(missing)} "
            "(or reinstall posttrain-quickstart, which depends on all of them)"
        )
