"""The configuration reference (posttrain.config.reference) and the site hook that puts it
on its page: every key with its type, default and documentation, read from the code."""

from __future__ import annotations

import importlib
import importlib.util
import typing
from typing import Any, Literal

import attrs
import pytest

from posttrain import hookimpl
from posttrain.config.reference import config_sections, field_docs, option_keys, options_markdown, reference_markdown
from posttrain.config.schema import RunConfig
from posttrain.plugins import new_plugin_host, plugin_host
from tests.docs.pages import DOCS


@attrs.define
class ProbeInner:
    """Inner options."""

    depth: int = 3  # how deep


@attrs.define
class ProbeSource:
    """A source written as a mapping.

    - ``url``: where it is.
    """

    url: str | None = None


@attrs.define
class ProbeConfig:
    """A section of a plugin registered by hand.

    - ``mode``: how it runs, ``fast`` or ``slow``.
    """

    mode: Literal["fast", "slow"] = "fast"
    # Two comment lines above a field
    # document it.
    limit: int | None = None
    where: str | ProbeSource | None = None  # a path, or a mapping
    inner: ProbeInner = attrs.field(factory=ProbeInner)
    names: list[str] = attrs.field(factory=lambda: ["a|b"])
    needed: float = attrs.field(kw_only=True)  # must be set


class ProbePlugin:
    @hookimpl
    def posttrain_config_sections(self) -> dict[str, type]:
        return {"probe": ProbeConfig, "policy.probe": ProbeInner}


@pytest.fixture(scope="module")
def host() -> Any:
    host = new_plugin_host()
    host.register(ProbePlugin(), name="probe-plugin")
    return host


def test_field_docs_come_from_comments_and_docstrings():
    assert field_docs(ProbeConfig) == {
        "mode": "how it runs, ``fast`` or ``slow``.",
        "limit": "Two comment lines above a field document it.",
        "where": "a path, or a mapping",
        "needed": "must be set",
    }


def test_inherited_fields_are_documented_by_the_class_that_declares_them():
    from posttrain_dpo.config import DPOConfig

    docs = field_docs(DPOConfig)
    assert docs["max_num_steps"] == "optimizer steps at most; None: stop after max_num_epochs"  # SupervisedConfig's
    assert docs["beta"] == "strength of the pull towards the reference policy"


def test_a_plugin_section_lists_every_key_with_type_default_and_doc(host):
    sections = {section.path: section for section in config_sections(host)}
    probe = sections["probe"]
    assert probe.source == "probe-plugin" and probe.summary == "A section of a plugin registered by hand."
    assert [(k.path, k.type, k.default, k.doc, k.section) for k in probe.keys] == [
        ("probe.mode", "one of 'fast', 'slow'", '"fast"', "how it runs, `fast` or `slow`.", None),
        ("probe.limit", "int or null", "null", "Two comment lines above a field document it.", None),
        ("probe.where", "str or mapping (ProbeSource) or null", "null", "a path, or a mapping", "probe.where"),
        ("probe.inner", "section", "", "", "probe.inner"),
        ("probe.names", "list[str]", '["a|b"]', "", None),
        ("probe.needed", "float", "required", "must be set", None),
    ]
    assert [k.path for k in sections["probe.where"].keys] == ["probe.where.url"]
    assert sections["probe.where"].keys[0].doc == "where it is."
    assert [(k.path, k.default, k.doc) for k in sections["probe.inner"].keys] == [("probe.inner.depth", "3", "how deep")]


def test_a_plugin_subsection_is_a_key_of_the_section_it_sits_in(host):
    sections = [section.path for section in config_sections(host)]
    policy = next(section for section in config_sections(host) if section.path == "policy")
    assert policy.keys[-1].path == "policy.probe" and policy.keys[-1].doc == "Registered by plugin `probe-plugin`."
    assert sections.index("policy.probe") > sections.index("policy.resources")  # after policy's own subsections
    assert sections[-1] == "sft" and sections.index("probe") > sections.index("grpo.loss")  # top level: by name


def test_core_keys_and_every_installed_section_are_listed():
    host = plugin_host()
    paths = {key.path for section in config_sections(host) for key in section.keys}
    assert {"seed", "policy.optimizer.lr", "data.train.name", "environments", "checkpointing.resume"} <= paths
    assert not {"sections", "raw", "sources"} & paths  # the loader's own fields
    for name in host.config_sections:
        assert name in paths


def test_markdown_rows_escape_pipes_and_angle_brackets(host):
    markdown = reference_markdown(host)
    assert '| <a id="probe.names"></a>`probe.names` | list[str] | `["a\\|b"]` |  |' in markdown
    assert "## `probe.where` {#probe.where}" in markdown
    assert "| [`probe.inner`](#probe.inner) | section |  |  |" in markdown
    assert "&lt;run_dir&gt;/metrics.jsonl" in markdown  # logger.jsonl's comment
    assert "\n|---|---|---|---|\n" in options_markdown(ProbeInner, "environments.probe")


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location("docs_hook_generated", DOCS / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_hook_expands_directives_and_refuses_unknown_ones():
    hook = _hook()
    page = "Intro\n\n<!-- posttrain:options posttrain_env_math.options:GuessNumberOptions environments.guess_number -->\n"
    expanded = hook.expand(page, "environments.md")
    assert '`environments.guess_number.max_guesses` | int | `8` |' in expanded
    with pytest.raises(ValueError, match=r"^environments.md: unknown directive <!-- posttrain:opts x -->"):
        hook.expand("<!-- posttrain:opts x -->\n", "environments.md")
    with pytest.raises(ValueError, match=r"names no importable class"):
        hook.expand("<!-- posttrain:options posttrain_env_math.options:Nope environments.x -->\n", "environments.md")


def _documented_options() -> list[tuple[type, str]]:
    """``(options class, prefix)`` of every ``posttrain:options`` directive on the site's pages."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for match in _hook().DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
            if match.group("name") == "options":
                target, prefix = match.group("args").split()
                module, _, name = target.partition(":")
                found.append((getattr(importlib.import_module(module), name), prefix))
    return found


def test_every_key_of_core_and_of_installed_plugins_has_a_description():
    missing = [
        f"{key.path} ({section.class_name}, from {section.source})"
        for section in config_sections(plugin_host())
        for key in section.keys
        if not key.doc.strip()
    ]
    options = _documented_options()
    assert {prefix for _, prefix in options} >= {"environments.math", "environments.guess_number", "environments.code"}
    missing += [
        f"{key.path} ({cls.__name__}, options on the site)" for cls, prefix in options
        for key in option_keys(cls, prefix) if not key.doc.strip()
    ]
    assert not missing, (
        f"{len(missing)} config key(s) without a description: {'; '.join(missing)}. Document each with a "
        "trailing '# comment' on its field, comment lines right above it, or a '``name``: text' entry in its "
        "class docstring (see posttrain.config.reference)"
    )


def _attrs_classes(hint: Any) -> set[type]:
    """The attrs classes an annotation names, inside unions and containers too."""
    if attrs.has(hint):
        return {hint}
    return {cls for arg in typing.get_args(hint) for cls in _attrs_classes(arg)}


def test_every_attrs_class_a_section_reaches_is_listed_with_its_keys():
    host = plugin_host()
    sections = {section.path: section for section in config_sections(host)}
    seen: set[type] = set()
    todo = [RunConfig, *host.config_sections.values()]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            keys = attrs.fields_dict(cls)  # the config's keys: a ClassVar (a backend's `requires`) is none
            todo.extend(c for name, hint in typing.get_type_hints(cls).items() if name in keys
                        for c in _attrs_classes(hint))
    listed = {section.class_name for section in sections.values()}
    unlisted = sorted(cls.__name__ for cls in seen if cls.__name__ not in listed)
    assert not unlisted, f"attrs classes reached from a section whose keys the reference does not list: {unlisted}"
    for path in ("data.train", "data.validation"):  # str | DataSource | a list of them | None: the mapping form's keys
        assert sections[path].class_name == "DataSource"
        assert [key.path for key in sections[path].keys] == [
            f"{path}.{name}"
            for name in ("name", "path", "subset", "split", "revision", "columns", "tag", "weight", "count",
                         "weight_schedule", "task")
        ]
