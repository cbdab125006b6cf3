"""The plugin host: load plugins from entry points and merge what they register.

``plugin_host()`` returns this process's host, loading the ``posttrain`` entry-point group on
first use. The driver and every Ray worker call it, so a plugin installed in the
environment is usable everywhere by name.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import pluggy

from posttrain import hookspecs
from posttrain.errors import PluginError, did_you_mean

ENTRY_POINT_GROUP = "posttrain"

#: Registration hook name -> the noun used in messages and ``posttrain plugins``.
KINDS: dict[str, str] = {
    "posttrain_policy_backends": "policy backend",
    "posttrain_generation_backends": "generation backend",
    "posttrain_environments": "environment",
    "posttrain_losses": "loss",
    "posttrain_data_planes": "data plane",
    "posttrain_algorithms": "algorithm",
    "posttrain_metric_sinks": "metric sink",
    "posttrain_commands": "command",
    "posttrain_config_sections": "config section",
}


@attrs.frozen
class Registration:
    """One name registered by one plugin."""

    kind: str
    name: str
    value: Any
    distribution: str  # "name version", or the plugin's name when it has no distribution


@attrs.frozen
class PluginInfo:
    """An installed plugin: where it comes from and what it registers."""

    plugin_name: str
    distribution: str
    registrations: tuple[Registration, ...]


class Registry(Mapping[str, Any]):
    """The merged ``{name: factory}`` of one kind, refusing unknown names helpfully."""

    def __init__(self, kind: str, entries: dict[str, Registration]):
        self.kind = kind
        self._entries = entries

    def __getitem__(self, name: str) -> Any:
        if name not in self._entries:
            raise PluginError(self.unknown_message(name))
        return self._entries[name].value

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def distribution_of(self, name: str) -> str:
        self[name]  # raises the helpful error for an unknown name
        return self._entries[name].distribution

    def unknown_message(self, name: str) -> str:
        if not self._entries:
            installed = "none (install a plugin that provides one)"
        else:
            by_dist: dict[str, list[str]] = {}
            for reg in self._entries.values():  # names in the order their plugin registers them
                by_dist.setdefault(reg.distribution, []).append(reg.name)
            installed = "; ".join(f"{', '.join(names)} (from {dist})" for dist, names in sorted(by_dist.items()))
        return f"unknown {self.kind} '{name}'; installed: {installed}.{did_you_mean(name, self._entries)}"


class PluginHost:
    """A pluggy manager plus merged registries, one per registration hook."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self._registries: dict[str, Registry] = {}  # merged on first use, per kind

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def registry(self, hook_name: str) -> Registry:
        """The merged registry of one registration hook, e.g. ``"posttrain_environments"``."""
        if hook_name not in self._registries:
            self._registries[hook_name] = self._merge(hook_name)
        return self._registries[hook_name]

    @property
    def policy_backends(self) -> Registry:
        return self.registry("posttrain_policy_backends")

    @property
    def generation_backends(self) -> Registry:
        return self.registry("posttrain_generation_backends")

    @property
    def environments(self) -> Registry:
        return self.registry("posttrain_environments")

    @property
    def losses(self) -> Registry:
        return self.registry("posttrain_losses")

    @property
    def data_planes(self) -> Registry:
        return self.registry("posttrain_data_planes")

    @property
    def algorithms(self) -> Registry:
        return self.registry("posttrain_algorithms")

    @property
    def metric_sinks(self) -> Registry:
        return self.registry("posttrain_metric_sinks")

    @property
    def commands(self) -> Registry:
        return self.registry("posttrain_commands")

    @property
    def config_sections(self) -> Registry:
        return self.registry("posttrain_config_sections")

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object by hand (tests, notebooks); registries are rebuilt."""
        self.pm.register(plugin, name=name)
        self._registries = {}
        try:
            check_hook_names(self.pm)
        except PluginError:
            self.pm.unregister(plugin)
            raise

    def unregister(self, plugin: object) -> None:
        self.pm.unregister(plugin)
        self._registries = {}

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin with its distribution and registrations, in load order."""
        infos = []
        for plugin in self._loaded():
            regs = tuple(reg for kind in KINDS for reg in self._registrations(kind, plugin))
            infos.append(PluginInfo(self._plugin_name(plugin), self._distribution(plugin), regs))
        return sorted(infos, key=lambda info: info.distribution)

    # ------------------------------------------------------------------ internals

    def _loaded(self) -> list[object]:
        """Registered plugins in registration order (``pm.get_plugins()`` is an unordered set)."""
        return [plugin for _, plugin in self.pm.list_name_plugin() if plugin is not None]

    def _plugin_name(self, plugin: object) -> str:
        return self.pm.get_name(plugin) or repr(plugin)

    def _distribution(self, plugin: object) -> str:
        for loaded, dist in self.pm.list_plugin_distinfo():
            if loaded is plugin:
                return f"{dist.project_name} {dist.version}"
        return self._plugin_name(plugin)

    def _registrations(self, hook_name: str, plugin: object) -> list[Registration]:
        caller = getattr(self.pm.hook, hook_name)
        out = []
        for impl in caller.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            answer = impl.function()
            if answer is None:
                continue
            if not isinstance(answer, Mapping):
                raise PluginError(
                    f"plugin '{impl.plugin_name}' ({self._distribution(plugin)}): {hook_name}() "
                    f"must return a mapping of name to factory, got {type(answer).__name__}"
                )
            dist = self._distribution(plugin)
            out.extend(Registration(KINDS[hook_name], str(n), v, dist) for n, v in answer.items())
        return out

    def _merge(self, hook_name: str) -> Registry:
        """One kind's registry; only that kind's hooks are called (a plugin's other hooks
        may import heavy modules)."""
        kind = KINDS[hook_name]
        entries: dict[str, Registration] = {}
        for plugin in self._loaded():
            for reg in self._registrations(hook_name, plugin):
                if reg.name in entries:
                    first = entries[reg.name]
                    raise PluginError(
                        f"{kind} '{reg.name}' is registered twice: by {first.distribution} "
                        f"and by {reg.distribution}. Uninstall one of them."
                    )
                entries[reg.name] = reg
        return Registry(kind, entries)


def new_plugin_host(load_entry_points: bool = True) -> PluginHost:
    """A fresh host with the hookspecs added and, by default, every installed plugin loaded."""
    pm = pluggy.PluginManager("posttrain")
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:  # an installed plugin that fails to import
            raise PluginError(
                f"loading the '{ENTRY_POINT_GROUP}' entry points failed: {type(exc).__name__}: {exc}. "
                f"Installed distributions with posttrain entry points: {', '.join(_entry_point_dists())}"
            ) from exc
        check_hook_names(pm)
    return PluginHost(pm)


def check_hook_names(pm: pluggy.PluginManager) -> None:
    """Refuse hook implementations that match no hookspec (a misspelt hook is otherwise
    silently never called)."""
    known = [name for name in vars(hookspecs) if name.startswith("posttrain_")]
    for name, caller in vars(pm.hook).items():
        if name.startswith("_") or caller.has_spec():
            continue
        for impl in caller.get_hookimpls():
            if not impl.optionalhook:
                raise PluginError(
                    f"plugin '{impl.plugin_name}' implements '{name}', which is not a posttrain hook."
                    f"{did_you_mean(name, known)} The hooks are listed in posttrain.hookspecs."
                )


def _entry_point_dists() -> list[str]:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted({f"{ep.dist.name} ({ep.name} = {ep.value})" for ep in eps if ep.dist is not None})


_HOST: PluginHost | None = None


def plugin_host() -> PluginHost:
    """This process's plugin host, created and loaded on first call."""
    global _HOST
    if _HOST is None:
        _HOST = new_plugin_host()
    return _HOST


def set_plugin_host(host: PluginHost | None) -> None:
    """Replace this process's host (tests and the conformance kit use this)."""
    global _HOST
    _HOST = host

