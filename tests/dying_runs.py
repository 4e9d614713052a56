"""Flow runs that beat until their process is killed, for tests/test_crash_detection.py.

Usage: python tests/dying_runs.py NUM_RUNS BEAT_S IDS_PATH

Starts NUM_RUNS flow runs, one per thread, in this one process (as `eyas run` executes its runs in its own
process), appends each run's id to IDS_PATH once it is Running, and sleeps until killed. Each run beats every BEAT_S
seconds: Prefect's own heartbeat thread (prefect.flow_engine._send_heartbeats), with the interval it allows no
lower than 30 s shortened so that the test takes seconds, not minutes.
"""

from __future__ import annotations

import sys
import threading
import time


def main(num_runs: int, beat_s: int, ids_path: str) -> None:
    import prefect.flow_engine as engine
    from prefect import flow
    from prefect.runtime import flow_run

    engine.MINIMUM_HEARTBEAT_INTERVAL = beat_s
    engine.BaseFlowRunEngine.heartbeat_seconds = property(lambda self: beat_s)
    printing = threading.Lock()

    @flow(name="dying-run")
    def dying_run() -> None:
        with printing, open(ids_path, "a") as ids:
            ids.write(f"{flow_run.id}\n")
        time.sleep(3600)

    threads = [threading.Thread(target=dying_run, daemon=True) for _ in range(num_runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
