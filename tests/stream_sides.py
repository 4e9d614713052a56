"""The two sides of a streamed run as processes of their own, for the kill tests (tests/test_stream_kills.py).

    python tests/stream_sides.py producer SIDE.json
    torchrun --standalone --nproc_per_node=2 tests/stream_sides.py trainer JOB.json

producer: run_streamed_extraction of SIDE.json's run in the order the trainer first needs the shards
(eyas.train.stream_order from step 1; a resumed producer skips what is committed); its log lines on stdout, its
summary as the last line (JSON). SIDE.json: {"config": a RunConfig, "tokenized", "target", "storage_url",
"endpoint", "hold": null or {"after": N, "until": PATH}}; a hold lets N shard files be written, then holds the
next write until PATH exists (a producer that falls behind), so that a test kills either side while the
producer is surely mid-run.
trainer: `python -m eyas.train --config JOB.json`, with the streamed reader and its cache looking at the store
every 50 ms and a waiting reader saying so every second (instead of every 1 s and 30 s).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

POLL_S = 0.05
SAY_EVERY_S = 1.0


def producer(side_path: str) -> None:
    from eyas.config import RunConfig
    from eyas.extract.plan import describe_extraction
    from eyas.extract.streamed import run_streamed_extraction
    from eyas.facts import facts_for
    from eyas.train.stream_order import stream_order

    side = json.loads(Path(side_path).read_text())
    config = RunConfig.model_validate(side["config"])
    facts = facts_for(target_path=side["target"], tokenized_path=side["tokenized"], storage_url=side["storage_url"],
                      s3_endpoint_url=side["endpoint"])  # fmt: skip
    _, plan = describe_extraction(config.extract, facts, target_dtype=config.target.dtype)
    order = stream_order(plan, config.train, num_samples=facts.num_samples).shards
    store = facts.storage() if side["hold"] is None else held(facts.storage(), **side["hold"])
    summary = run_streamed_extraction(config, facts, shard_order=order, target_dtype=config.target.dtype,
                                      store=store, poll_s=POLL_S, log=lambda line: print(line, flush=True))  # fmt: skip
    print(json.dumps(summary.to_dict()), flush=True)


def held(store, *, after: int, until: str):
    """The store, writing `after` shard files, then holding each next one until the file `until` exists."""
    put, written = store.put_bytes, []

    def put_bytes(name: str, data: bytes) -> str:
        if name.endswith(".safetensors"):
            while len(written) >= after and not Path(until).exists():
                time.sleep(POLL_S)
            written.append(name)
        return put(name, data)

    store.put_bytes = put_bytes
    return store


def trainer(job_path: str) -> None:
    import eyas.shards.cache as cache
    import eyas.shards.streamed as streamed
    from eyas.train.__main__ import exit_without_finalizing, main

    streamed.POLL_S, streamed.SAY_EVERY_S, cache.POLL_S = POLL_S, SAY_EVERY_S, POLL_S
    exit_without_finalizing(main(["--config", job_path]))


if __name__ == "__main__":
    sides = {"producer": producer, "trainer": trainer}
    if len(sys.argv) != 3 or sys.argv[1] not in sides:
        sys.exit(f"usage: {sys.argv[0]} producer SIDE.json | trainer JOB.json (got {sys.argv[1:]})")
    sides[sys.argv[1]](sys.argv[2])
