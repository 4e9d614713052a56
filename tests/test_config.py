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


def train_config(**fields):
    return eyas.config.TrainConfig(**fields)


@pytest.mark.parametrize(
    ("value", "found"),
    [(0, "a count below 1"), ("3:2", "MIN 3 above MAX 2"), ("two", "not a count or a range"), ("1:2:3", "not a count")],
)
def test_a_node_count_that_is_not_n_or_a_range_is_refused(value, found):
    with pytest.raises(ValidationError) as err:
        train_config(num_nodes=value, rdzv_endpoint="h")
    assert (
        f"train.num_nodes={value!r}: expected a node count N >= 1 or a range 'MIN:MAX' with 1 <= MIN <= MAX, "
        f"found {found}"
    ) in str(err.value)


def test_node_counts_are_kept_in_one_form():
    assert train_config().num_nodes == 1 and train_config(num_nodes="1:1").num_nodes == 1
    two = train_config(num_nodes="2", num_processes=8, rdzv_endpoint="10.0.0.5")
    assert (two.num_nodes, two.rdzv_endpoint, two.node_range, two.min_world_size) == (2, "10.0.0.5:29400", (2, 2), 16)
    assert train_config(num_nodes=" 2 : 4 ", rdzv_endpoint="[::1]:5").node_range == (2, 4)
    with pytest.raises(ValidationError):
        train_config(num_nodes=True)  # not the count 1


def test_several_nodes_need_the_rendezvous_endpoint():
    with pytest.raises(ValidationError) as err:
        train_config(num_nodes=2)
    assert (
        "train.rdzv_endpoint is empty with train.num_nodes=2: the nodes' agents meet at a c10d rendezvous and each "
        "must be given its address; set train.rdzv_endpoint to HOST:PORT of the first node"
    ) in str(err.value)


@pytest.mark.parametrize("endpoint", ["h:70000", "h:", "a b:1", "http://h:1"])
def test_a_rendezvous_endpoint_that_is_not_host_port_is_refused(endpoint):
    with pytest.raises(ValidationError) as err:
        train_config(num_nodes=2, rdzv_endpoint=endpoint)
    assert f"train.rdzv_endpoint={endpoint!r}: expected HOST or HOST:PORT" in str(err.value)


def test_rendezvous_settings_that_would_do_nothing_are_refused():
    with pytest.raises(ValidationError) as err:
        train_config(rdzv_endpoint="h:1", rdzv_join_timeout_s=60)
    assert (
        "train.rdzv_endpoint='h:1', train.rdzv_join_timeout_s=60 would do nothing: train.num_nodes=1 trains on this "
        "node alone (torchrun --standalone, no rendezvous between nodes); remove them, or set train.num_nodes"
    ) in str(err.value)
    with pytest.raises(ValidationError) as err:
        train_config(num_nodes=2, rdzv_endpoint="h", rdzv_last_call_timeout_s=5)
    assert "train.rdzv_last_call_timeout_s=5 would do nothing: train.num_nodes=2 is a fixed count" in str(err.value)
    assert train_config(num_nodes="2:3", rdzv_endpoint="h", rdzv_last_call_timeout_s=5).rdzv_last_call_timeout_s == 5


def test_a_rendezvous_id_torchrun_would_misread_is_refused():
    with pytest.raises(ValidationError) as err:
        train_config(num_nodes=2, rdzv_endpoint="h", rdzv_id="a,b")
    assert "train.rdzv_id='a,b': expected letters, digits, '_', '.' or '-'" in str(err.value)
