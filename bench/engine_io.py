"""Client cost per token of the two ways eyas can take hidden states from SGLang: capture files against JSON.

    .venv/bin/python bench/engine_io.py [--tokens 512 --hidden-size 7168 --num-aux 3 --repeats 3] [--quick]

One sample of `--tokens` tokens at the width of the run eyas exists for (Kimi-K2.5: H = 7168, 3 aux layers),
bfloat16 as the server computes it, is handed to the client both ways, and the client's work is timed
(best of `--repeats`, on this process's CPU):
- capture: the file eyas's capture hook writes (eyas.extract.capture_hook, the safetensors of input_ids,
  aux [t, 3H] and last [t, H]; written by the hook's own code beforehand, not timed) is read and checked as
  the sglang backend does (eyas.extract.backends.sglang.read_capture: token ids, widths, dtype), converted to
  float32 as the backend returns it, and removed;
- json: the body SGLang would send for return_hidden_states (meta_info.hidden_states = [[t][3H]] floats of
  the bf16 values, `.tolist()` in SGLang's scheduler) is parsed as the client does (httpx's `.json()`, the
  standard json module) and turned into a float32 tensor. It carries the aux layers only: SGLang never puts
  the final-norm states in a response, so the JSON path cannot feed training at all without more requests.
`projected_hours_87m` is the capture path's client time for the 87.8M tokens of that run (one core);
`json_projected_hours_87m` the JSON path's. `json_python_gib_per_4096` is the Python floats one 4,096-token
answer holds while it is parsed (measured with tracemalloc at --tokens, scaled). The last line is one JSON
object with the figures; goal: capture_ms_per_token <= 0.1. `--quick` (for the test suite): 64 tokens at H 1024, once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.extract.backends.sglang import read_capture  # noqa: E402
from eyas.extract.capture_hook import CaptureHook, capture_file  # noqa: E402

RUN_TOKENS = 87.8e6


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden-size", type=int, default=7168)
    ap.add_argument("--num-aux", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 tokens at H 1024, once: seconds, the same code path")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.hidden_size, args.repeats = 64, 1024, 1
    t, h, n = args.tokens, args.hidden_size, args.num_aux
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150_000, (t,), generator=gen)
    aux = torch.randn(t, n * h, generator=gen).to(torch.bfloat16)
    last = torch.randn(t, h, generator=gen).to(torch.bfloat16)

    work = Path(tempfile.mkdtemp(prefix="eyas-engine-io-"))
    hook = CaptureHook(work, rid_prefix="eyas-", tp_rank=lambda: 0)

    def write_file(rid: str) -> Path:
        hook._put(capture_file(work, rid), (ids, aux, last))
        hook.flush()
        return capture_file(work, rid)

    counter = iter(range(10**6))
    paths = []

    def capture_client() -> None:
        path = paths.pop()
        a, b = read_capture(path, ids.tolist(), num_aux=n, hidden_size=h, where="bench")
        a.float(), b.float()
        path.unlink()

    def timed_capture() -> float:
        paths.append(write_file(f"eyas-{next(counter)}"))
        start = time.perf_counter()
        capture_client()
        return time.perf_counter() - start

    capture_s = min(timed_capture() for _ in range(args.repeats))

    body = json.dumps({"text": "x", "output_ids": [1], "meta_info": {"hidden_states": [aux.float().tolist()]}})

    def json_client() -> None:
        answer = json.loads(body)
        torch.tensor(answer["meta_info"]["hidden_states"][0], dtype=torch.float32)

    json_s = best(json_client, args.repeats)
    tracemalloc.start()
    answer = json.loads(body)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del answer
    work.rmdir()

    capture_ms, json_ms = 1e3 * capture_s / t, 1e3 * json_s / t
    figures = {
        "tokens": t,
        "hidden_size": h,
        "num_aux": n,
        "capture_file_mib": round((t * (n + 1) * h * 2 + t * 8) / 2**20, 1),
        "json_body_mib": round(len(body) / 2**20, 1),
        "capture_ms_per_token": round(capture_ms, 4),
        "json_ms_per_token": round(json_ms, 4),
        "json_vs_capture": round(json_ms / capture_ms, 1),
        "projected_hours_87m": round(RUN_TOKENS * capture_ms / 3.6e6, 2),
        "json_projected_hours_87m": round(RUN_TOKENS * json_ms / 3.6e6, 1),
        "json_python_gib_per_4096": round(held * 4096 / t / 2**30, 2),
    }
    print(f"capture files: {capture_ms:.4f} ms a token ({figures['capture_file_mib']} MiB a sample)")
    print(f"JSON floats:   {json_ms:.4f} ms a token ({figures['json_body_mib']} MiB a body, aux only)")
    print(f"87.8M tokens:  capture {figures['projected_hours_87m']} h, JSON {figures['json_projected_hours_87m']} h")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
