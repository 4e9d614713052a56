"""Deployments of every preset in deployments/: the work pool that runs each, for write_prefect_yaml.py.

    from preset_deployments import anchor_names, preset_deployments   # scripts/ is on sys.path there
    doc["deployments"] = preset_deployments(STAGES)
    text = anchor_names(yaml.safe_dump(doc, sort_keys=False, width=110))

The tiny CPU preset runs on the local process pool `eyas-local`; the 8-GPU presets on the Kubernetes pool
`eyas-gpu` (deployments/work-pools/k8s-gpu-base-job-template.json), one pod with `gpu_count` GPUs per
flow run. Deployment names are `STAGE-PRESET` (`pipeline-llama31-8b-8gpu`).
"""

from __future__ import annotations

import json
from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parents[1] / "deployments"
LOCAL_POOL = {"name": "eyas-local", "work_queue_name": "default"}
GPU_POOL = {"name": "eyas-gpu", "work_queue_name": "default"}
# preset name -> work pool (with the job variables its runs need); in the order prefect.yaml lists them
PRESET_POOLS = {
    "tiny-cpu": LOCAL_POOL,
    "llama31-8b-8gpu": {**GPU_POOL, "job_variables": {"gpu_count": 8}},
    "deepseek-v3-8gpu": {**GPU_POOL, "job_variables": {"gpu_count": 8}},
    "kimi-k25-8gpu": {**GPU_POOL, "job_variables": {"gpu_count": 8}},
}


def preset_deployments(stages: list[tuple[str, str, str]], presets_dir: Path = PRESETS_DIR) -> list[dict]:
    """One deployment per (stage, preset): stages are (name, entrypoint, description) as in write_prefect_yaml."""
    found = sorted(p.stem for p in presets_dir.glob("*.json"))
    missing = sorted(set(found) - set(PRESET_POOLS))
    if missing:
        raise ValueError(f"presets {missing} in {presets_dir} have no work pool: add them to PRESET_POOLS")
    deployments = []
    for preset, pool in PRESET_POOLS.items():
        config = json.loads((presets_dir / f"{preset}.json").read_text())
        deployments += [
            {
                "name": f"{name}-{preset}",
                "entrypoint": entrypoint,
                "description": description,
                "work_pool": json.loads(json.dumps(pool)),  # a copy: only the config is shared (one anchor)
                "parameters": {"config": config},
                "tags": ["eyas", preset],
            }
            for name, entrypoint, description in stages
        ]
    return deployments


def anchor_names(text: str) -> str:
    """Name YAML's anchors after the presets (`&tiny_cpu`, not `&id001`): the one object each preset's
    deployments share is its config, and PyYAML numbers shared objects in order of first appearance."""
    names = [preset.replace("-", "_") for preset in PRESET_POOLS]
    for i in range(len(names), 0, -1):  # id010 before id001
        text = text.replace(f"id{i:03d}", names[i - 1])
    return text
