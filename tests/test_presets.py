"""The presets in deployments/ are what they claim to be, and the GPU work pool's job template runs them."""

import json
import sys
from pathlib import Path

import pytest

from eyas.config import RunConfig, load_run_config
from eyas.layer_ids import default_aux_layer_ids
from eyas.shards.encoding import extract_encoding

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "deployments").glob("*.json"))
TEMPLATE = REPO / "deployments" / "work-pools" / "k8s-gpu-base-job-template.json"
# The targets' config.json (Hugging Face): meta-llama/Llama-3.1-8B-Instruct, deepseek-ai/DeepSeek-V3,
# moonshotai/Kimi-K2.5 (its text_config).
GPU_TARGETS = {
    "llama31-8b-8gpu": {"num_layers": 32, "hidden_size": 4096, "vocab_size": 128256},
    "deepseek-v3-8gpu": {"num_layers": 61, "hidden_size": 7168, "vocab_size": 129280},
    "kimi-k25-8gpu": {"num_layers": 61, "hidden_size": 7168, "vocab_size": 163840},
}
ONE_GIB = 1 << 30

sys.path.insert(0, str(REPO / "scripts"))


def preset(name: str) -> RunConfig:
    return load_run_config(REPO / "deployments" / f"{name}.json")


def hidden_size(config: RunConfig) -> int:
    if config.name in GPU_TARGETS:
        return GPU_TARGETS[config.name]["hidden_size"]
    return json.loads((REPO / config.target.model_path / "config.json").read_text())["hidden_size"]


def test_every_gpu_target_has_a_preset():
    assert sorted(GPU_TARGETS) == sorted(p.stem for p in PRESETS if p.stem != "tiny-cpu")


@pytest.mark.parametrize("name", sorted(GPU_TARGETS))
def test_aux_layer_ids_are_the_eagle3_default_of_the_target(name):
    target = GPU_TARGETS[name]
    config = preset(name)
    assert config.target.aux_layer_ids == default_aux_layer_ids(target["num_layers"])
    assert config.dataset.draft_vocab_size < target["vocab_size"]


@pytest.mark.parametrize("name", sorted(GPU_TARGETS))
def test_training_runs_8_nccl_processes_in_bf16(name):
    config = preset(name)
    assert (config.train.num_processes, config.train.backend) == (8, "nccl")
    assert config.train.mixed_precision == "bf16"
    assert config.target.dtype == config.extract.dtype == config.extract.aux_dtype == config.export.dtype == "bfloat16"
    assert config.extract.shard_bytes == ONE_GIB


@pytest.mark.parametrize("name", sorted(GPU_TARGETS))
def test_extraction_uses_all_8_gpus(name):
    extract = preset(name).extract
    if extract.backend == "hf":  # one worker per GPU, each a full copy of the target
        assert (extract.device, extract.num_workers) == ("cuda", 8)
    else:  # one SGLang server sharding the target over the GPUs
        assert (extract.backend, extract.sglang.tp_size, extract.num_workers) == ("sglang", 8, 1)


@pytest.mark.parametrize("name", sorted(GPU_TARGETS))
def test_benchmark_serves_with_sglang(name):
    bench = preset(name).bench
    assert bench.engine == "sglang" and bench.num_steps == 3 and bench.draft_tokens == 4
    args = bench.sglang_extra_args
    assert int(args[args.index("--tp-size") + 1]) == (1 if name == "llama31-8b-8gpu" else 8)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_a_whole_sample_fits_the_draft_positions_and_one_shard(path):
    config = load_run_config(path)
    assert config.draft.max_position_embeddings >= config.dataset.max_length
    assert config.dataset.max_new_tokens < config.dataset.max_length
    num_aux = len(config.target.aux_layer_ids or [0, 0, 0])
    per_token = extract_encoding(config.extract).bytes_per_token(hidden_size=hidden_size(config), num_aux=num_aux)
    assert config.dataset.max_length * per_token <= config.extract.shard_bytes
    assert config.train.global_batch_size % config.train.num_processes == 0


@pytest.mark.parametrize("name", sorted(GPU_TARGETS))
def test_gpu_preset_paths_live_on_the_shared_volume(name):
    mount = json.loads(TEMPLATE.read_text())["variables"]["properties"]["shared_mount_path"]["default"]
    config = preset(name)
    paths = [config.workdir, config.target.model_path, config.dataset.prompts_path, config.bench.prompts_path]
    assert all(p.startswith(mount + "/") for p in paths), paths


def test_every_preset_has_a_work_pool_with_its_gpus():
    from preset_deployments import PRESET_POOLS

    assert sorted(PRESET_POOLS) == sorted(p.stem for p in PRESETS)
    for name, pool in PRESET_POOLS.items():
        gpus = pool.get("job_variables", {}).get("gpu_count", 0)
        assert gpus == (preset(name).train.num_processes if name in GPU_TARGETS else 0)
        assert pool["name"] == ("eyas-gpu" if name in GPU_TARGETS else "eyas-local")


def test_preset_deployments_carry_each_preset_on_its_pool():
    from preset_deployments import preset_deployments

    stages = [
        ("pipeline", "flows/pipeline.py:pipeline", "the pipeline"),
        ("verify-shards", "flows/verify.py:verify_flow", "v"),
    ]
    deployments = {d["name"]: d for d in preset_deployments(stages)}
    assert len(deployments) == 2 * len(PRESETS)
    gpu = deployments["pipeline-deepseek-v3-8gpu"]
    assert gpu["work_pool"] == {"name": "eyas-gpu", "work_queue_name": "default", "job_variables": {"gpu_count": 8}}
    assert gpu["parameters"]["config"] == json.loads((REPO / "deployments" / "deepseek-v3-8gpu.json").read_text())


def rendered_job(template: dict, **values) -> dict:
    """The job configuration a Kubernetes worker builds from the template, its defaults and `values`."""
    from prefect.utilities.templating import apply_values

    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    return apply_values(template["job_configuration"], {**defaults, **values})


def test_k8s_template_asks_for_8_gpus_and_mounts_the_shared_volume(prefect_server):
    job = rendered_job(json.loads(TEMPLATE.read_text()), name="pipeline-run")
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"eyas-shared": "/mnt/eyas", "dshm": "/dev/shm"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["eyas-shared"]["persistentVolumeClaim"] == {"claimName": "eyas-shared"}
    assert job["env"]["PREFECT_RESULTS_LOCAL_STORAGE_PATH"].startswith("/mnt/eyas/")


def test_k8s_template_is_accepted_by_a_prefect_server(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    template = json.loads(TEMPLATE.read_text())
    with get_client(sync_client=True) as client:
        pool = client.create_work_pool(
            WorkPoolCreate(name="eyas-gpu-test", type="kubernetes", base_job_template=template)
        )
        assert client.read_work_pool("eyas-gpu-test").base_job_template == template
        client.delete_work_pool(pool.name)
