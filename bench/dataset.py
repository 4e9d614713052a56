"""Regeneration through a served engine: eyas's path against the same server driven directly, and the resume plan.

    .venv/bin/python bench/dataset.py [--num-prompts 64 --max-new-tokens 16 --in-flight 8 --log-records 40000] [--quick]

A generation double (tests/generation_double.py: the tiny target's greedy answers over SGLang's /generate)
is started once. The same prompts are then answered both ways, `--repeats` rounds alternated (the best
round of each counts), each with `--in-flight` requests in flight:
- direct: a bare client posting the /generate bodies from a thread pool and keeping the answers in memory;
- eyas: `eyas.dataset.generate.regenerate` with the sglang generator (worker threads over one queue, every
  answer checked, appended to the checksummed log and fsynced every second, accounting).
`served_ratio` = eyas's tokens/s / direct tokens/s (goal >= 0.9). `resume_plan_s` is the time a re-run takes
to read a log of `--log-records` answered records (300 tokens each) and find the prompts still missing
(goal < 2 s). The last line is one JSON object with the figures. `--quick` (for the test suite): 4 prompts of 4 new
tokens, a log of 400 records, one round.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from generation_double import start  # noqa: E402

from eyas.dataset.generate import Item, ResponseLog, Sampling, SGLangGenerator, regenerate  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--log-records", type=int, default=40_000)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of each path, alternated; the best counts")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: seconds, the same code path")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.in_flight, args.log_records, args.repeats = 4, 4, 2, 400, 1
    target = REPO / "fixtures" / "tiny-target"
    prompts = [json.loads(line) for line in (target / "prompts.jsonl").read_text().splitlines()][: args.num_prompts]
    from eyas.dataset.prompts import prompt_token_ids
    from eyas.target import load_tokenizer

    tok = load_tokenizer(target)
    items = [Item(p["id"], prompt_token_ids(tok, p["conversations"]), p["conversations"]) for p in prompts]
    port = free_port()
    server = start(target, port)
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="eyas-bench-dataset-"))
    try:
        params = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens}

        def direct_one(item: Item) -> int:
            answer = httpx.post(f"{url}/generate", json={"input_ids": item.prompt_ids, "sampling_params": params},
                                timeout=600).json()  # fmt: skip
            return len(answer["output_ids"])

        direct_one(items[0])  # warm the server

        def direct() -> float:
            start_s = time.perf_counter()
            with ThreadPoolExecutor(args.in_flight) as pool:
                tokens = sum(pool.map(direct_one, items))
            return tokens / (time.perf_counter() - start_s)

        def served(round_: int) -> float:
            gen = SGLangGenerator([url], Sampling(args.max_new_tokens), args.in_flight, 600)
            start_s = time.perf_counter()
            records, acct = regenerate(items, gen, ResponseLog(work / f"served-{round_}.log"), max_attempts=3)
            assert acct.answered == len(items), acct
            return sum(len(r["output_ids"]) for r in records.values()) / (time.perf_counter() - start_s)

        rates = {"direct": [], "served": []}
        for round_ in range(args.repeats):  # alternated, so a change of machine load hits both sides alike
            rates["direct"].append(direct())
            rates["served"].append(served(round_))
        direct_rate, served_rate = max(rates["direct"]), max(rates["served"])
    finally:
        server.kill()
        server.wait()

    big = ResponseLog(work / "big.log")
    for i in range(args.log_records):
        big.append({"id": f"p{i:06d}", "status": "answered", "output_ids": list(range(300)), "attempts": 1,
                    "finish_reason": "stop", "token_ids_source": "server"})  # fmt: skip
    big.close()
    wanted = [f"p{i:06d}" for i in range(args.log_records + 1000)]
    start_s = time.perf_counter()
    known = ResponseLog(work / "big.log").read()
    missing = [i for i in wanted if (known.get(i) or {}).get("status") != "answered"]
    resume_s = time.perf_counter() - start_s
    assert len(missing) == 1000
    log_mib = (work / "big.log").stat().st_size / 2**20
    for path in work.iterdir():
        path.unlink()
    work.rmdir()

    figures = {
        "num_prompts": len(items),
        "in_flight": args.in_flight,
        "direct_tokens_per_s": round(direct_rate, 1),
        "served_tokens_per_s": round(served_rate, 1),
        "served_ratio": round(served_rate / direct_rate, 3),
        "log_records": args.log_records,
        "log_mib": round(log_mib, 1),
        "resume_plan_s": round(resume_s, 3),
    }
    print(f"direct client: {figures['direct_tokens_per_s']} tokens/s; eyas regeneration: "
          f"{figures['served_tokens_per_s']} tokens/s (ratio {figures['served_ratio']})")  # fmt: skip
    print(f"resume plan over {args.log_records:,} records ({figures['log_mib']} MiB): {figures['resume_plan_s']} s")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
