"""The rank cache's fetch rate from S3 (ranged, parallel GETs) against a plain parallel download of the same bytes
and against one single-stream GET at a time (the cache's fetch before), in one run.

Usage: .venv/bin/python bench/s3_fetch.py [--num-objects 4] [--object-mib 64] [--part-mib 16] [--streams 16]
       [--repeats 3] [--quick]

`--num-objects` random objects of `--object-mib` are put on a real S3 API server on loopback (moto's server
mode, as in the tests) and fetched four ways into a local directory, each `--repeats` times, interleaved,
the median run of each reported:
- cache: a ShardCache (eyas.shards.cache) over all of them, in order, as a trainer rank fetches them
  (S3Storage.download_to: a HEAD, then `--part-mib` ranges, `--streams` at once, If-Match on each, the XXH3
  checksum checked as parts land, fsync, rename);
- ranged: the same ranges of the same objects, as many at once, done bare (a GET and a pwrite each; no HEAD,
  checksum, fsync or rename): the plain parallel download of the same bytes by the same requests;
- objects: every object at once, one single-stream GET each, written to a file;
- single: one single-stream GET at a time, written to a file (the cache's fetch before, less its checksum).
What this machine can show: moto is a Python server, and for every GET, ranged or not, it copies the whole
object out of its store under the object's lock before it slices the range (moto/s3/models.py FakeKey.value):
a ranged fetch of k parts costs moto k whole-object copies, served one at a time. So on moto `cache` cannot
beat `single`, and `ranged_vs_single_ratio` measures moto, not the link; `ranged_vs_plain_ratio` (the same
requests, bare) is the figure for the fetcher's own cost. Against a real link (AWS S3, MinIO) one stream is
bounded by per-connection throughput while ranges are served independently, and the streams add up.
The last line is one JSON object. `--quick` (for the test suite): 2 objects of 8 MiB, 4 MiB parts, once each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the S3 API server the tests use

import boto3  # noqa: E402
from s3_server import CREDENTIALS, start_s3_server  # noqa: E402

from eyas.shards.cache import ShardCache  # noqa: E402
from eyas.shards.manifest import ManifestRow  # noqa: E402
from eyas.storage.s3 import S3Storage  # noqa: E402


def single_stream_get(client, bucket: str, key: str, path: Path) -> None:
    answer = client.get_object(Bucket=bucket, Key=key)
    with open(path, "wb") as f:
        for chunk in answer["Body"].iter_chunks(1 << 20):
            f.write(chunk)


def time_single(store: S3Storage, names: list[str], out: Path) -> float:
    start = time.perf_counter()
    for name in names:
        single_stream_get(store.client, store.bucket, store._key(name), out / name)
    return time.perf_counter() - start


def time_plain_ranged(store: S3Storage, names: list[str], out: Path, part_bytes: int, streams: int) -> float:
    """The cache's requests done bare: the same ranges, as many at once, each written at its offset; nothing else."""

    def get(name: str, start: int, end: int) -> None:
        answer = store.client.get_object(Bucket=store.bucket, Key=store._key(name), Range=f"bytes={start}-{end - 1}")
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, answer["Body"].read(), start)
        finally:
            os.close(fd)

    start = time.perf_counter()
    for name in names:
        size = store.list()[name]
        with ThreadPoolExecutor(max_workers=streams) as pool:
            for future in [pool.submit(get, name, a, min(a + part_bytes, size)) for a in range(0, size, part_bytes)]:
                future.result()
    return time.perf_counter() - start


def time_plain_objects(store: S3Storage, names: list[str], out: Path) -> float:
    threads = [
        threading.Thread(target=single_stream_get, args=(store.client, store.bucket, store._key(n), out / n))
        for n in names
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def time_cache(store: S3Storage, rows: list[ManifestRow], out: Path) -> float:
    start = time.perf_counter()
    cache = ShardCache(store, rows, out, sum(r.num_bytes for r in rows), log=lambda _: None)
    cache.plan(list(range(len(rows))))
    for shard in range(len(rows)):
        with cache.opened(shard):
            pass
    seconds = time.perf_counter() - start
    cache.close()
    assert cache.stats.fetched == len(rows), cache.stats
    return seconds


def clear(out: Path) -> None:
    for path in out.iterdir():
        path.unlink()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-objects", type=int, default=4)
    p.add_argument("--object-mib", type=int, default=64)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 objects of 8 MiB, 4 MiB parts, once: seconds")
    args = p.parse_args()
    if args.quick:
        args.num_objects, args.object_mib, args.part_mib, args.repeats = 2, 8, 4, 1
    os.environ.update(CREDENTIALS)
    with tempfile.TemporaryDirectory(prefix="eyas-s3-fetch-") as tmp:
        server, endpoint = start_s3_server(Path(tmp) / "server.log")
        try:
            return run(args, endpoint, Path(tmp))
        finally:
            server.terminate()
            server.wait(timeout=30)


def run(args, endpoint: str, tmp: Path) -> int:
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    store = S3Storage("s3://bench/shards", endpoint_url=endpoint, fetch_part_bytes=args.part_mib << 20,
                      num_fetch_streams=args.streams)  # fmt: skip
    size = args.object_mib << 20
    rows = []
    for i in range(args.num_objects):
        name = f"shard-{i:05d}.safetensors"
        rows.append(ManifestRow(i, name, i, i + 1, 1, size, store.put_bytes(name, os.urandom(size))))
    names, out = [r.file for r in rows], tmp / "out"
    out.mkdir()
    total = args.num_objects * size
    ways = {
        "cache": lambda: time_cache(store, rows, out),
        "ranged": lambda: time_plain_ranged(store, names, out, args.part_mib << 20, args.streams),
        "objects": lambda: time_plain_objects(store, names, out),
        "single": lambda: time_single(store, names, out),
    }
    seconds = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way, fetch in ways.items():
            seconds[way].append(fetch())
            clear(out)
    median = {way: statistics.median(s) for way, s in seconds.items()}
    rate = {way: total / s / 1e9 for way, s in median.items()}
    print(f"{args.num_objects} objects x {args.object_mib} MiB from moto on loopback ({os.cpu_count()} cores); "
          f"cache: {args.part_mib} MiB parts, {args.streams} streams; median of {args.repeats}")  # fmt: skip
    print(f"{'way':<8}{'seconds':>10}{'GB/s':>8}")
    for way in seconds:
        print(f"{way:<8}{median[way]:>10.3f}{rate[way]:>8.3f}")
    figures = {
        "ranged_vs_plain_ratio": round(rate["cache"] / rate["ranged"], 3),
        "ranged_vs_objects_ratio": round(rate["cache"] / rate["objects"], 3),
        "ranged_vs_single_ratio": round(rate["cache"] / rate["single"], 3),
        "gb_per_s": round(rate["cache"], 3),
        "plain_ranged_gb_per_s": round(rate["ranged"], 3),
        "objects_gb_per_s": round(rate["objects"], 3),
        "single_gb_per_s": round(rate["single"], 3),
        "num_objects": args.num_objects,
        "object_mib": args.object_mib,
        "part_mib": args.part_mib,
        "streams": args.streams,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
