"""The GPU work pool's job template renders, as Prefect's Kubernetes worker renders it, to a Job that the official
Kubernetes schema accepts, with what a node of a run on several nodes needs from its pod.

The schemas are kubernetes-validate's copy of Kubernetes' OpenAPI definitions as JSON schemas (strict: unknown
fields refused), read offline.
"""

import copy
import json
import uuid
from pathlib import Path

import kubernetes_validate
import pytest

REPO = Path(__file__).resolve().parents[1]
POOLS = REPO / "deployments" / "work-pools"
TEMPLATE = json.loads((POOLS / "k8s-gpu-base-job-template.json").read_text())
NETWORK_POLICY = json.loads((POOLS / "k8s-gpu-network-policy.json").read_text())
# The oldest and the newest Kubernetes minor versions the pinned schemas cover.
VERSIONS = ["1.25", "1.37"]
# What a user gives beyond the variables' defaults (see README, "Presets and work pools").
USER_VALUES = {
    "name": "train-node",
    "image": "registry.example.com/eyas:cu128",
    "shared_volume_claim": "eyas-shared",
    "gpu_count": 8,
    "command": "prefect flow-run execute",
}
# prefect-kubernetes' worker refuses a job manifest without these two keys in the POD spec (it compares the
# manifest with its base manifest, where Prefect put them); PodSpec has no such fields, so the strict schema
# names them, and the API server drops them with a warning (fieldValidation Warn, its default for API clients).
PREFECT_POD_SPEC_KEYS = ("completions", "parallelism")


def rendered_job(**values) -> dict:
    """The Job that Prefect's Kubernetes worker submits for a flow run of this pool with `values` as job variables.

    Prefect's own code renders it (`BaseJobConfiguration.from_template_and_values`: the variables' defaults under
    `values`, a placeholder with no value removed, a whole-string placeholder taking its value's type; then
    `prepare_for_flow_run`: the flow run's environment and labels); the last lines do what the worker's
    `KubernetesWorkerJobConfiguration.prepare_for_flow_run` adds: env as a list of name/value pairs, the command
    split into args, the labels on the Job and its pod.
    """
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.utilities.asyncutils import run_coro_as_sync
    from prefect.utilities.processutils import command_from_string
    from prefect.workers.base import BaseJobConfiguration

    class KubernetesJobConfiguration(BaseJobConfiguration):
        job_manifest: dict

    config = run_coro_as_sync(KubernetesJobConfiguration.from_template_and_values(TEMPLATE, values))
    flow_run = FlowRun(flow_id=uuid.uuid4(), name="train-node-1")
    config.prepare_for_flow_run(flow_run, work_pool=WorkPool(name="eyas-gpu", type="kubernetes"))
    job = config.job_manifest
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in config.env.items()]
    container["args"] = command_from_string(container.get("args", config.command))
    job["metadata"]["labels"] = config.labels
    job["spec"]["template"]["metadata"] = {"labels": config.labels}
    return job


def as_stored(job: dict) -> dict:
    """`job` as the API server stores it: without the pod-spec keys Prefect's worker demands and PodSpec lacks."""
    job = copy.deepcopy(job)
    pod = job["spec"]["template"]["spec"]
    assert {k: pod.pop(k) for k in PREFECT_POD_SPEC_KEYS} == {"completions": 1, "parallelism": 1}
    return job


def schema_error(manifest: dict, version: str) -> str | None:
    """The strict schema's first complaint about `manifest` under Kubernetes `version`, as 'PATH: MESSAGE', or None."""
    try:
        assert kubernetes_validate.validate(manifest, version, strict=True) == version
    except kubernetes_validate.ValidationError as error:
        return f"{'.'.join(str(p) for p in error.path)}: {error.message}"
    return None


@pytest.fixture(scope="module")
def job(prefect_server) -> dict:
    return rendered_job(**USER_VALUES)


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_job_is_a_valid_kubernetes_job(job, version):
    assert schema_error(as_stored(job), version) is None


@pytest.mark.parametrize("key", PREFECT_POD_SPEC_KEYS)
def test_the_strict_schema_names_only_the_pod_spec_keys_prefect_demands(job, key):
    kept = as_stored(job)
    kept["spec"]["template"]["spec"][key] = 1
    expected = f"spec.template.spec: Additional properties are not allowed ('{key}' was unexpected)"
    assert schema_error(kept, VERSIONS[-1]) == expected


@pytest.mark.parametrize(
    ("mistake", "error"),
    [
        (
            lambda c: c["resources"].update(limits=[{"nvidia.com/gpu": 8}]),
            "spec.template.spec.containers.0.resources.limits: [{'nvidia.com/gpu': 8}] is not of type 'object', 'null'",
        ),
        (
            lambda c: c.update(gpus=8),
            "spec.template.spec.containers.0: Additional properties are not allowed ('gpus' was unexpected)",
        ),
        (
            lambda c: c["ports"][0].update(containerPort="rendezvous"),
            "spec.template.spec.containers.0.ports.0.containerPort: 'rendezvous' is not of type 'integer'",
        ),
    ],
    ids=["limits-as-a-list", "unknown-container-field", "port-as-a-name"],
)
def test_a_mistake_in_the_job_fails_validation_naming_it(job, mistake, error):
    broken = as_stored(job)
    mistake(broken["spec"]["template"]["spec"]["containers"][0])
    assert schema_error(broken, VERSIONS[-1]) == error


def test_a_node_pod_holds_the_gpus_the_shared_volume_and_an_in_memory_shm(job):
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {
        "eyas-shared": "/mnt/eyas",
        "dshm": "/dev/shm",
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["eyas-shared"]["persistentVolumeClaim"] == {"claimName": "eyas-shared"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert (pod["restartPolicy"], job["spec"]["backoffLimit"]) == ("Never", 0)


def test_gpus_claim_and_rendezvous_port_are_the_pool_variables(prefect_server):
    job = rendered_job(**USER_VALUES | {"gpu_count": 4, "shared_volume_claim": "team-a", "rendezvous_port": 29500})
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "team-a"}
    assert container["ports"] == [{"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"}]


def test_a_node_pod_is_reached_at_its_own_pod_ip(job):
    """torch's c10d store and process groups listen on the pod IP that the pod's host name resolves to: host
    networking, a fixed host name or subdomain, or extra host entries would change that address."""
    pod = job["spec"]["template"]["spec"]
    assert not {"hostNetwork", "hostname", "subdomain", "setHostnameAsFQDN", "hostAliases"} & set(pod)
    assert pod["containers"][0]["ports"] == [{"name": "rendezvous", "containerPort": 29400, "protocol": "TCP"}]
    assert TEMPLATE["variables"]["properties"]["rendezvous_port"]["default"] == 29400


@pytest.mark.parametrize("version", VERSIONS)
def test_network_policy_is_valid_and_lets_the_pool_pods_reach_each_other_on_every_port(job, version):
    assert schema_error(NETWORK_POLICY, version) is None
    spec = NETWORK_POLICY["spec"]
    pods = spec["podSelector"]["matchLabels"]
    assert pods.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert NETWORK_POLICY["metadata"]["namespace"] == TEMPLATE["variables"]["properties"]["namespace"]["default"]
    assert spec["ingress"] == [{"from": [{"podSelector": {"matchLabels": pods}}]}]  # no `ports`: all of them
