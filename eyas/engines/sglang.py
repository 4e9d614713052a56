"""SGLang as eyas meets it: the launch command, the server's lifecycle, and one HTTP client for its API.

    launch = SglangLaunch(target_path="meta-llama/Llama-3.1-8B-Instruct", draft_path="run/export/sglang",
                          python="/opt/sglang/bin/python")
    argv = build_launch_command(launch)          # /opt/sglang/bin/python -m sglang.launch_server --model-path ...
    with SglangServer(launch, log_path, startup_timeout_s=1800) as url:   # started, /health waited for, stopped
        answer = request_json(f"{url}/generate", body, timeout_s=600, what="...", fix="...")

Regeneration (eyas.dataset.build), extraction (eyas.extract.backends.sglang) and the benchmark
(eyas.bench.sglang) start servers and send requests through this module. SGLang lives in an environment
of its own (it pins its own torch and transformers): `sglang.python` names its interpreter, and every
server runs there (eyas.engines.sglang_env checks that interpreter before the model loads). Every failure
of a request is a SglangServerError naming the request, what the server said and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from eyas.engines.sglang_release import (  # noqa: F401  (re-exported: the release facts live there)
    CHECKED_SGLANG_VERSIONS,
    UNCHECKED_ON_OTHER_RELEASES,
    SglangServerError,
    SGLangVersionError,
    check_sglang_version,
    parse_version,
)

SGLANG_ALGORITHM = "EAGLE3"
SGLANG_DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPEC_SHAPE_FLAGS = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
TRUST_REMOTE_CODE_FLAG = "--trust-remote-code"


@dataclass(frozen=True)
class SglangLaunch:
    target_path: str
    draft_path: str | None  # None: the baseline server, no speculation
    steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    host: str = "127.0.0.1"
    port: int = 30000
    extra_args: tuple[str, ...] = ()
    module: str = "sglang.launch_server"  # tests substitute the protocol double here
    python: str = field(default=sys.executable)  # SGLang's interpreter (sglang.python), else eyas's own
    trust_remote_code: bool = False  # target.trust_remote_code: the target's own code loads its config/tokenizer
    allowed_versions: tuple[str, ...] = ()  # sglang.allow_unchecked_versions

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def baseline(self) -> "SglangLaunch":
        return replace(self, draft_path=None)


def build_launch_command(launch: SglangLaunch) -> list[str]:
    """argv of `python -m sglang.launch_server` for this launch."""
    argv = [launch.python, "-m", launch.module, "--model-path", launch.target_path]
    argv += ["--host", launch.host, "--port", str(launch.port)]
    if launch.trust_remote_code:
        argv.append(TRUST_REMOTE_CODE_FLAG)
    if launch.draft_path is not None:
        argv += ["--speculative-algorithm", SGLANG_ALGORITHM, "--speculative-draft-model-path", launch.draft_path]
        argv += [SPEC_SHAPE_FLAGS[0], str(launch.steps), SPEC_SHAPE_FLAGS[1], str(launch.topk)]
        argv += [SPEC_SHAPE_FLAGS[2], str(launch.num_draft_tokens)]
    return argv + list(launch.extra_args)


def engine_python(configured: str) -> str:
    """The interpreter every SGLang server runs in: `sglang.python` when set, else the one running eyas."""
    return configured or sys.executable


def request_json(url: str, body: dict | None, *, timeout_s: float, what: str, fix: str, timeout_fix: str = ""):
    """GET (body None) or POST JSON; any failure is a SglangServerError naming the request and the fix
    (`timeout_fix` when no answer came in time)."""
    try:
        if body is None:
            resp = httpx.get(url, timeout=timeout_s)
        else:
            resp = httpx.post(url, json=body, timeout=timeout_s)
    except httpx.TimeoutException as err:
        raise SglangServerError(
            f"{what}: no answer from {url} within {timeout_s} s; {timeout_fix or 'check the server log'}"
        ) from err
    except httpx.TransportError as err:  # refused, reset, DNS
        raise SglangServerError(f"{what}: cannot reach {url} ({type(err).__name__}: {err}); {fix}") from err
    if resp.status_code != 200:
        raise SglangServerError(f"{what}: HTTP {resp.status_code} from {url}: {resp.text[:500]}; {fix}")
    try:
        return resp.json()
    except json.JSONDecodeError as err:
        raise SglangServerError(f"{what}: answer from {url} is not JSON ({err}): {resp.text[:200]!r}; {fix}") from err


def http_status(url: str, timeout_s: float = 5) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError:
        return None


class SglangServer:
    """`with SglangServer(launch, log_path, timeout_s) as url:` checks the launch's interpreter (its SGLang release
    against launch.allowed_versions; `capture_module` importable there as eyas has it), starts the server, waits
    for /health, stops it."""

    def __init__(self, launch: SglangLaunch, log_path: Path, startup_timeout_s: float, *, capture_module: str = ""):
        self.launch, self.log_path, self.timeout_s = launch, Path(log_path), startup_timeout_s
        self.capture_module = capture_module
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        from eyas.engines.sglang_env import check_engine_environment

        launch = self.launch
        check_engine_environment(launch.python, launch.module, allowed_versions=launch.allowed_versions,
                                 capture_module=self.capture_module)  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        argv = build_launch_command(self.launch)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + self.timeout_s
        while http_status(f"{self.launch.base_url}/health") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with code {self.proc.returncode}" if self.proc.poll() is not None else "timed out"
                self.__exit__()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise SglangServerError(
                    f"SGLang server `{' '.join(argv)}` {why} before GET /health answered 200 "
                    f"(waited up to {self.timeout_s:.0f} s); log {self.log_path}:\n{tail}"
                )
            time.sleep(0.25)
        return self.launch.base_url

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
