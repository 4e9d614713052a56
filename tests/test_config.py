"""eyas.config: every field is described (the UI form shows it), renamed fields are refused with the new name."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

import eyas.config
from eyas.config import RENAMED_FIELDS, RunConfig, load_run_config

REPO = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_description():
    models = [m for _, m in inspect.getmembers(eyas.config, inspect.isclass) if issubclass(m, BaseModel)]
    undescribed = [f"{m.__name__}.{f}" for m in models for f, info in m.model_fields.items() if not info.description]
    assert len(models) > 10 and undescribed == []


@pytest.mark.parametrize(("section", "old"), [(s, o) for s, names in RENAMED_FIELDS.items() for o in names])
def test_a_renamed_field_is_refused_naming_its_new_name(section, old):
    data = json.loads((REPO / "deployments" / "tiny-cpu.json").read_text())
    new = RENAMED_FIELDS[section][old]
    data[section][old] = data[section].pop(new, 3)
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate(data)
    assert f"{section}.{old} is now {section}.{new}; rename them in the preset" in str(err.value)


def test_presets_use_the_current_names():
    for preset in sorted((REPO / "deployments").glob("*.json")):
        load_run_config(preset)
