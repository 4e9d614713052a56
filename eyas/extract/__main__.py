"""Extract hidden-state shards with the hf backend, without Prefect.

    python -m eyas.extract --tokenized T.parquet --shards DIR --target MODEL [--config EXTRACT.json] [--num-workers 2]

DIR is a local directory or s3://bucket/prefix; a re-run extracts only what the manifest lacks. The
summary is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eyas.config import ExtractConfig
from eyas.extract.coordinator import run_extraction
from eyas.facts import facts_for


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m eyas.extract", description="extract hidden-state shards (hf)")
    ap.add_argument("--tokenized", required=True, help="tokenized dataset (Parquet) written by eyas.dataset")
    ap.add_argument("--shards", required=True, help="local directory or s3://bucket/prefix")
    ap.add_argument("--target", required=True, help="Hugging Face model directory of the target")
    ap.add_argument("--config", help="JSON of an ExtractConfig (defaults otherwise)")
    ap.add_argument("--num-workers", type=int, help="overrides the config's num_workers")
    args = ap.parse_args(argv)
    cfg = ExtractConfig.model_validate_json(Path(args.config).read_text()) if args.config else ExtractConfig()
    if args.num_workers:
        cfg = cfg.model_copy(update={"num_workers": args.num_workers})
    facts = facts_for(
        target_path=args.target,
        tokenized_path=args.tokenized,
        storage_url=args.shards,
        s3_endpoint_url=cfg.s3_endpoint_url,
    )
    print(json.dumps(run_extraction(cfg, facts).to_dict()))


if __name__ == "__main__":
    main()
