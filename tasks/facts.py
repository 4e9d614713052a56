"""The task that resolves a run's facts once, for the flows to hand to every later stage."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas import run_inputs
from eyas.config import RunConfig
from eyas.export.serving import check_variant_served
from eyas.facts import RunFacts, check_layer_ids, resolve_facts
from eyas.train.memory_plan import check_run_plan
from tasks.retry import TRANSIENT_IO


# Not cached: a few small reads (config.json, weight headers, the table's footer and one column), and the
# facts must follow the files. Storage errors retried.
@task(name="resolve-run-facts", cache_policy=NO_CACHE, **TRANSIENT_IO)
def resolve_run_facts(config: RunConfig) -> RunFacts:
    """The target's shape and fingerprint, the aux layer ids, the dataset's hash and size, where shards go; a
    draft.variant the export's servers would not run, aux layer ids SGLang cannot be given for the target
    (eyas.facts.check_layer_ids), and a training run whose memory plan does not fit its devices
    (eyas.train.memory_plan), are refused here, before extraction and training."""
    check_variant_served(config)
    check_layer_ids(config)
    facts = resolve_facts(config)
    check_run_plan(config, facts.target)
    return facts


# Not cached: the files must be looked at as they are now. Storage errors retried; the problems it finds are not.
@task(name="check-run-inputs", cache_policy=NO_CACHE, **TRANSIENT_IO)
def check_run_inputs(config: RunConfig, stages: list[str]) -> dict:
    """Every input of `stages` a user can get wrong (paths, vocab sizes, process counts, the dataset's trainable
    conversations; eyas.run_inputs), refused in one message before any stage starts its work."""
    return run_inputs.check_run_inputs(config, stages)


# Not cached: config.json and the weight headers, read again so that a changed target is seen.
@task(name="check-aux-layer-ids", cache_policy=NO_CACHE, **TRANSIENT_IO)
def check_run_layer_ids(config: RunConfig) -> list[int]:
    """The aux layer ids, refused before regeneration when SGLang cannot be given them for the target."""
    return check_layer_ids(config)
