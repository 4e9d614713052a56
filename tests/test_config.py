"""eyas.config: every field is described (the UI form shows it), renamed fields are refused with the new name, the
SGLang settings hold what every server needs."""

from __future__ import annotations

import inspect
import json
import re
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


@pytest.mark.parametrize(
    "section, key",
    [("dataset.generation", "sglang_extra_args"), ("extract.sglang", "extra_args"), ("bench", "sglang_extra_args")],
)
def test_trust_remote_code_comes_from_the_target_not_from_a_servers_extra_args(section, key):
    data = json.loads((REPO / "deployments" / "tiny-cpu.json").read_text())
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = ["--trust-remote-code"]
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate(data)
    assert f"{section}.{key}: --trust-remote-code comes from target.trust_remote_code for every SGLang server" in str(
        err.value
    )


def test_sglangs_interpreter_is_a_path_and_unchecked_releases_are_release_strings():
    data = json.loads((REPO / "deployments" / "tiny-cpu.json").read_text())
    assert RunConfig.model_validate(data).sglang.python == ""  # eyas's own interpreter
    data["sglang"] = {"python": "/opt/sglang/bin/python", "allow_unchecked_versions": ["0.5.24", "0.5.23.post1"]}
    assert RunConfig.model_validate(data).sglang.allow_unchecked_versions == ["0.5.24", "0.5.23.post1"]
    for bad, message in (
        ({"python": "python3"}, "sglang.python='python3': expected the path of SGLang's interpreter"),
        ({"allow_unchecked_versions": ["latest"]}, "sglang.allow_unchecked_versions: ['latest'] expected release"),
    ):
        data["sglang"] = bad
        with pytest.raises(ValidationError, match=re.escape(message)):
            RunConfig.model_validate(data)
