"""The roles of ModelConfig's fields, declared once beside each field (`txl_dist.config.model.Roles`): every field
has them, the lists the export, the hub folder, evaluation and the architecture check use are derived from them,
and a declaration that contradicts itself is refused. docs/architecture.md (Where to add): a model field."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

import pytest

from txl_dist.config.fields import Positive, config_dataclass
from txl_dist.config.model import (
    ARCHITECTURE,
    AUTHORS,
    EXTRA,
    MODEL_FIELD_ROLES,
    SEGMENT,
    ModelConfig,
    Roles,
    field_roles,
    preset,
)
from txl_dist.config.sections import EVAL_SEGMENT_FIELDS
from txl_dist.convert.hub import hub_config
from txl_dist.export import AUTHORS_FIELDS, EVAL_SETTINGS, EXTRA_FIELDS, config_to_json
from txl_dist.model.recurrence import SegmentSettings


def _roles(cls: type) -> dict[str, Roles]:
    found = {}
    for name, info in cls.__pydantic_fields__.items():
        (found[name],) = [item for item in info.metadata if isinstance(item, Roles)]
    return found


def test_every_field_declares_its_roles_and_the_derived_lists_cover_them():
    roles = _roles(ModelConfig)
    assert list(roles) == [f.name for f in dataclasses.fields(ModelConfig)]
    exported = set(AUTHORS_FIELDS) | set(EXTRA_FIELDS)
    # Each field of config.json once, under one name; the rest (compile) is a run setting the weights never see.
    assert len(AUTHORS_FIELDS) + len(EXTRA_FIELDS) == len(exported)
    assert set(roles) - exported == {"compile"} and roles["compile"].kinds == frozenset()
    assert set(ModelConfig().architecture()) == set(MODEL_FIELD_ROLES.architecture)
    assert not set(MODEL_FIELD_ROLES.architecture) & set(EVAL_SETTINGS)
    assert set(MODEL_FIELD_ROLES.architecture) | set(EVAL_SETTINGS) <= exported
    assert set(MODEL_FIELD_ROLES.hub) <= exported
    # The segment settings the eval section and SegmentSettings carry are the model's segment fields.
    assert set(EVAL_SEGMENT_FIELDS) == {f.name for f in dataclasses.fields(SegmentSettings)} <= set(EVAL_SETTINGS)


def test_the_lists_are_those_the_files_were_written_with():
    """The places in config.json and in the hub's config.json keep both files as they were (key order included)."""
    assert AUTHORS_FIELDS[:6] == ("n_token", "n_layer", "n_head", "d_model", "d_head", "d_inner")
    assert EXTRA_FIELDS == ("attn_impl", "mem_dtype", "init_std", "proj_init_std", "layer_norm_eps")
    config = preset("tiny")
    assert list(config_to_json(config)) == ["format", "version", *AUTHORS_FIELDS, *EXTRA_FIELDS, "tokenizer"]
    hub_keys = [key for key in hub_config(config, None) if key in _roles(ModelConfig)]
    assert hub_keys == list(MODEL_FIELD_ROLES.hub)
    assert hub_keys[3:5] == ["d_head", "d_model"] and hub_keys[-2:] == ["d_embed", "tie_projs"]


@config_dataclass
class _WiderConfig(ModelConfig):
    """ModelConfig with three new fields, one of each kind, declared as a new field of ModelConfig would be."""

    SECTION: ClassVar[str] = "model"

    n_expert: Annotated[Positive, Roles(ARCHITECTURE, EXTRA, config_key=24, hub_key=22)] = 1
    """An architecture field: it changes the weights."""
    window: Annotated[Positive, Roles(SEGMENT, AUTHORS, config_key=25)] = 4
    """A segment setting, under an (imagined) authors' name."""
    log_every: Annotated[Positive, Roles()] = 10
    """A run setting that leaves no trace in an export."""


def test_a_new_field_shows_up_where_its_roles_say():
    derived = field_roles(_WiderConfig)
    assert derived.architecture == MODEL_FIELD_ROLES.architecture + ("n_expert",)
    assert derived.segment == MODEL_FIELD_ROLES.segment + ("window",)
    assert derived.authors == MODEL_FIELD_ROLES.authors + ("window",)
    assert derived.extra == MODEL_FIELD_ROLES.extra + ("n_expert",)
    assert derived.hub == MODEL_FIELD_ROLES.hub + ("n_expert",)
    assert "log_every" not in {*derived.architecture, *derived.segment, *derived.authors, *derived.extra}
    wide, narrow = _WiderConfig(n_expert=4), _WiderConfig(n_expert=2)
    assert wide.architecture()["n_expert"] == 4 and wide.architecture() != narrow.architecture()
    assert "window" not in wide.architecture() and "log_every" not in wide.architecture()
    # The real ModelConfig's lists are untouched by the subclass.
    assert "n_expert" not in field_roles(ModelConfig).architecture


@pytest.mark.parametrize(
    "declare, problem",
    [
        (lambda: Roles(ARCHITECTURE), "must be written to config.json"),
        (lambda: Roles(SEGMENT, hub_key=3), "must be written to config.json"),
        (lambda: Roles(EXTRA, hub_key=3), "has a config_key"),
        (lambda: Roles(config_key=3), "has a config_key"),
        (lambda: Roles(hub_key=3), "a field with a hub_key must be in config.json"),
        (lambda: Roles(ARCHITECTURE, SEGMENT, AUTHORS, config_key=3), "not both"),
        (lambda: Roles(AUTHORS, EXTRA, config_key=3), "not both"),
        (lambda: Roles("weights", AUTHORS, config_key=3), r"unknown role\(s\) \['weights'\]"),
    ],
)
def test_a_contradictory_declaration_is_refused(declare, problem):
    with pytest.raises(TypeError, match=problem):
        declare()


def test_a_field_without_roles_or_on_anothers_place_is_refused():
    @config_dataclass
    class Undeclared(ModelConfig):
        SECTION: ClassVar[str] = "model"
        forgotten: Positive = 1

    with pytest.raises(TypeError, match=r"Undeclared.forgotten: declare its roles once"):
        field_roles(Undeclared)

    @config_dataclass
    class SamePlace(ModelConfig):
        SECTION: ClassVar[str] = "model"
        clash: Annotated[Positive, Roles(EXTRA, config_key=3)] = 1

    with pytest.raises(TypeError, match=r"fields \['clash', 'd_model'\] share a config_key"):
        field_roles(SamePlace)
