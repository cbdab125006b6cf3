"""The plugin host: load plugins from entry points and merge what they register.

``plugin_host()`` returns this process's host, loading the ``posttrain`` entry-point group on
first use. The driver and every Ray worker call it, so a plugin installed in the
environment is usable everywhere by name.

An installed plugin that cannot be loaded (its module fails to import, or it implements a
hook no hookspec declares) is set aside as broken, the others load: the host refuses to
serve with one (naming the distribution and how to uninstall it) unless asked to list what
is installed, as ``posttrain plugins`` does.
"""

from __future__ import annotations

import importlib.metadata
import traceback
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
    """An installed plugin: where it comes from and what it registers, or, when it could
    not be loaded or its registrations not be read, the error (and no registrations)."""

    plugin_name: str
    distribution: str
    registrations: tuple[Registration, ...]
    error: str | None = None


@attrs.frozen
class BrokenPlugin:
    """An installed plugin the host could not load: its entry point's name, its
    distribution ("name version") and project name (what ``pip uninstall`` takes), and why."""

    plugin_name: str
    distribution: str
    project: str
    error: str

    @property
    def remedy(self) -> str:
        return f"Fix it, or uninstall it: pip uninstall {self.project}"

    def message(self) -> str:
        return f"the plugin '{self.plugin_name}' of {self.distribution} could not be loaded: {self.error} {self.remedy}"


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
    """A pluggy manager plus merged registries, one per registration hook.

    ``distributions`` maps plugin names to their distribution ("name version"); ``broken``
    holds the installed plugins that could not be loaded (see :meth:`check_loaded`).
    """

    def __init__(
        self,
        pm: pluggy.PluginManager,
        distributions: Mapping[str, str] | None = None,
        broken: tuple[BrokenPlugin, ...] = (),
    ):
        self.pm = pm
        self.distributions = dict(distributions or {})
        self.broken = broken
        self._registries: dict[str, Registry] = {}  # merged on first use, per kind

    def check_loaded(self) -> None:
        """Raise :class:`PluginError` naming every installed plugin that could not be loaded,
        its distribution and how to uninstall it."""
        if len(self.broken) == 1:
            raise PluginError(f"{self.broken[0].message()}.{_LISTED}")
        if self.broken:
            listed = "".join(f"\n- {plugin.message()}" for plugin in self.broken)
            raise PluginError(f"{len(self.broken)} installed plugins could not be loaded:{listed}\n{_LISTED.strip()}")

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
        """Every installed plugin, by distribution: those registered with their
        registrations, and the broken ones and those whose registrations cannot be read
        with their error."""
        infos = [PluginInfo(b.plugin_name, b.distribution, (), f"{b.error} {b.remedy}") for b in self.broken]
        for plugin in self._loaded():
            name, distribution = self._plugin_name(plugin), self._distribution(plugin)
            try:
                regs = tuple(reg for kind in KINDS for reg in self._registrations(kind, plugin))
            except PluginError as exc:
                infos.append(PluginInfo(name, distribution, (), str(exc)))
            else:
                infos.append(PluginInfo(name, distribution, regs))
        return sorted(infos, key=lambda info: info.distribution)

    # ------------------------------------------------------------------ internals

    def _loaded(self) -> list[object]:
        """Registered plugins in registration order (``pm.get_plugins()`` is an unordered set)."""
        return [plugin for _, plugin in self.pm.list_name_plugin() if plugin is not None]

    def _plugin_name(self, plugin: object) -> str:
        return self.pm.get_name(plugin) or repr(plugin)

    def _distribution(self, plugin: object) -> str:
        name = self._plugin_name(plugin)
        return self.distributions.get(name, name)

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


def new_plugin_host(load_entry_points: bool = True, *, allow_broken: bool = False) -> PluginHost:
    """A fresh host with the hookspecs added and, by default, every installed plugin loaded.

    A plugin whose entry point fails to import, or that implements a hook no hookspec
    declares, is not registered but kept in ``host.broken``; unless ``allow_broken``, the
    host then raises :class:`PluginError` naming each (:meth:`PluginHost.check_loaded`).
    """
    pm = pluggy.PluginManager("posttrain")
    pm.add_hookspecs(hookspecs)
    distributions: dict[str, str] = {}
    broken: list[BrokenPlugin] = []
    if load_entry_points:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if pm.get_plugin(entry_point.name) is not None or pm.is_blocked(entry_point.name):
                continue
            dist = entry_point.dist
            project = dist.name if dist is not None else entry_point.name
            distribution = f"{dist.name} {dist.version}" if dist is not None else entry_point.name
            try:
                plugin = entry_point.load()
            except Exception as exc:  # an installed plugin that fails to import
                error = f"importing {entry_point.value} failed: {_described(exc)}"
                broken.append(BrokenPlugin(entry_point.name, distribution, project, error))
                continue
            pm.register(plugin, name=entry_point.name)
            message = _unknown_hook_message(pm, plugin)
            if message is not None:
                pm.unregister(plugin)
                broken.append(BrokenPlugin(entry_point.name, distribution, project, f"it {message}"))
                continue
            distributions[entry_point.name] = distribution
    host = PluginHost(pm, distributions, tuple(sorted(broken, key=lambda plugin: plugin.distribution)))
    if not allow_broken:
        host.check_loaded()
    return host


def check_hook_names(pm: pluggy.PluginManager) -> None:
    """Refuse hook implementations that match no hookspec (a misspelt hook is otherwise
    silently never called)."""
    for _, plugin in pm.list_name_plugin():
        message = _unknown_hook_message(pm, plugin) if plugin is not None else None
        if message is not None:
            raise PluginError(f"plugin '{pm.get_name(plugin)}' {message}")


def _unknown_hook_message(pm: pluggy.PluginManager, plugin: object) -> str | None:
    """What is wrong when ``plugin`` implements a hook no hookspec declares, else None."""
    known = [name for name in vars(hookspecs) if name.startswith("posttrain_")]
    for name, caller in vars(pm.hook).items():
        if name.startswith("_") or caller.has_spec():
            continue
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and not impl.optionalhook:
                return (
                    f"implements '{name}', which is not a posttrain hook.{did_you_mean(name, known)} "
                    "The hooks are listed in posttrain.hookspecs."
                )
    return None


def _described(exc: BaseException) -> str:
    """An exception as its type, message and the file and line it was raised at."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames and not isinstance(exc, SyntaxError) else ""
    return f"{type(exc).__name__}: {exc}{where}."


_LISTED = " `posttrain plugins` lists every installed plugin."


_HOST: PluginHost | None = None


def plugin_host(*, allow_broken: bool = False) -> PluginHost:
    """This process's plugin host, created and loaded on first call. Raises
    :class:`PluginError` when an installed plugin could not be loaded, unless
    ``allow_broken`` (for listing what is installed)."""
    global _HOST
    if _HOST is None:
        _HOST = new_plugin_host(allow_broken=True)
    if not allow_broken:
        _HOST.check_loaded()
    return _HOST


def set_plugin_host(host: PluginHost | None) -> None:
    """Replace this process's host (tests and the conformance kit use this)."""
    global _HOST
    _HOST = host

