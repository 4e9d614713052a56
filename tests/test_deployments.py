"""The deployments and presets stay valid instances of the flows' parameter model."""

import ast
import json
import sys
from pathlib import Path

import pytest
import yaml

from eyas.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("preset", sorted((REPO / "deployments").glob("*.json")), ids=lambda p: p.name)
def test_preset_is_a_valid_run_config(preset):
    RunConfig.model_validate_json(preset.read_text())


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d["name"])
def test_deployment_entrypoint_is_a_flow(deployment):
    path, func = deployment["entrypoint"].split(":")
    tree = ast.parse((REPO / path).read_text())
    flows = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "flow" for d in node.decorator_list)
    }
    assert func in flows


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d["name"])
def test_deployment_parameters_validate_when_loaded_from_the_entrypoint(prefect_server, deployment):
    """What a worker does with a flow run: load the flow from its entrypoint, validate the parameters.
    (A served deployment's runs are exercised in tests/test_extract_flow.py: there, flows whose module
    postponed its annotations failed validation, so flows/ does not use `from __future__ import annotations`.)"""
    import os

    from prefect.flows import load_flow_from_entrypoint

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
    finally:
        os.chdir(cwd)
    facts = {  # what a coordinator passes along (eyas.facts.RunFacts)
        "target": {"model_path": "t", "num_layers": 8, "hidden_size": 128, "vocab_size": 512, "fingerprint": "f"},
        "aux_layer_ids": [2, 4, 5],
        "tokenized_path": "runs/demo/dataset/tokenized.parquet",
        "dataset_hash": "h",
        "num_samples": 1,
        "shards_dir": "runs/demo/shards",
        "storage_url": "runs/demo/shards",
    }
    worker = {"facts": facts, "worker_index": 0, "shard_indices": [0]}
    node = {"facts": facts, "node_index": 1}  # what the first node's launch task passes a further node
    extra = worker if deployment["name"].startswith("extract-worker") else {}
    extra |= node if deployment["name"].startswith("train-node") else {}
    extra |= {"export_dir": "runs/demo/export"} if "export_dir" in flow.parameters.properties else {}
    validated = flow.validate_parameters({**deployment["parameters"], **extra})
    assert isinstance(validated["config"], RunConfig)


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d["name"])
def test_deployment_parameters_equal_its_preset(deployment):
    [preset] = [t for t in deployment["tags"] if (REPO / "deployments" / f"{t}.json").exists()]
    assert deployment["name"].endswith(f"-{preset}")
    assert deployment["parameters"]["config"] == json.loads((REPO / "deployments" / f"{preset}.json").read_text())
    RunConfig.model_validate(deployment["parameters"]["config"])


def test_every_stage_is_deployed_for_every_preset():
    presets = sorted(p.stem for p in (REPO / "deployments").glob("*.json"))
    stages = sorted({d["entrypoint"] for d in DEPLOYMENTS})
    assert len(stages) == 10 and len(DEPLOYMENTS) == len(stages) * len(presets)


def test_the_streamed_producer_is_deployed_on_each_presets_extraction_pool():
    """extract.stream_deployment names one of these: the producer of a streamed run on the pool that extracts."""
    presets = sorted(p.stem for p in (REPO / "deployments").glob("*.json"))
    by_name = {d["name"]: d for d in DEPLOYMENTS}
    for preset in presets:
        stream, worker = by_name[f"extract-stream-{preset}"], by_name[f"extract-worker-{preset}"]
        assert stream["entrypoint"] == "flows/stream.py:extract_stream_flow"
        assert stream["work_pool"] == worker["work_pool"]


def test_a_stream_deployment_of_another_flow_is_refused():
    from eyas.config import ExtractConfig

    assert ExtractConfig(stream_deployment="extract-stream/gpu").stream_deployment == "extract-stream/gpu"
    for wrong in ("extract-worker/gpu", "extract-stream", "extract-stream/"):
        with pytest.raises(ValueError, match=rf"extract.stream_deployment='{wrong}': expected 'extract-stream/NAME' "
                                             r"\(a deployment of the extract-stream flow"):  # fmt: skip
            ExtractConfig(stream_deployment=wrong)
    preset = json.loads((REPO / "deployments" / "tiny-cpu.json").read_text())
    preset["extract"]["stream_deployment"] = "extract-stream/tiny-cpu"  # an offline run has no producer to place
    with pytest.raises(ValueError) as err:
        RunConfig.model_validate(preset)
    assert (
        "extract.stream_deployment='extract-stream/tiny-cpu' runs a streamed run's producer, and train.start='offline' "
        "extracts before training; set train.start='streaming', or leave extract.stream_deployment empty"
    ) in str(err.value)
    preset["train"]["start"] = "streaming"
    assert RunConfig.model_validate(preset).extract.stream_deployment == "extract-stream/tiny-cpu"


def test_prefect_yaml_is_what_the_script_writes():
    sys.path.insert(0, str(REPO / "scripts"))
    from write_prefect_yaml import render

    assert (REPO / "prefect.yaml").read_text() == render(), "run: python scripts/write_prefect_yaml.py"


def test_unknown_config_field_is_an_error():
    preset = json.loads((REPO / "deployments" / "tiny-cpu.json").read_text())
    preset["train"]["learning_rate"] = 1.0
    with pytest.raises(ValueError, match="learning_rate"):
        RunConfig.model_validate(preset)


def test_library_never_imports_prefect():
    offenders = []
    for path in sorted((REPO / "eyas").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("prefect", "flows", "tasks")]
    assert offenders == []
