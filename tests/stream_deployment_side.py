"""The `extract-stream` flow as tests/test_stream_deployment.py serves it: the real flow (flows/stream.py), whose
store holds its writes when EYAS_TEST_HOLD='N:PATH' is set in the serving process's environment (N shard files
written, then each next write held until PATH exists: a producer surely mid-run when the test kills it).

    python tests/stream_deployment_side.py NAME   (serves extract-stream/NAME until terminated)
"""

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from prefect import flow  # noqa: E402

import tasks.stream  # noqa: E402
from eyas.config import RunConfig  # noqa: E402
from eyas.facts import RunFacts  # noqa: E402
from flows.stream import extract_stream_flow  # noqa: E402


def hold_writes(spec: str) -> None:
    """Make the producer task's extraction write through a held store (tests/stream_sides.py held)."""
    from stream_sides import held

    after, until = spec.split(":", 1)
    extract = tasks.stream.run_streamed_extraction

    def held_extraction(config, facts, **kwargs):
        return extract(config, facts, store=held(facts.storage(), after=int(after), until=until), **kwargs)

    tasks.stream.run_streamed_extraction = held_extraction


@flow(name="extract-stream", log_prints=True)
def held_extract_stream(config: RunConfig, facts: RunFacts | None = None) -> dict:
    """extract_stream_flow, its writes held as EYAS_TEST_HOLD says (unset: not held)."""
    if os.environ.get("EYAS_TEST_HOLD"):
        hold_writes(os.environ["EYAS_TEST_HOLD"])
    return extract_stream_flow.fn(config, facts)


if __name__ == "__main__":
    held_extract_stream.serve(name=sys.argv[1], limit=2)
