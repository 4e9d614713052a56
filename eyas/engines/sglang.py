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
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import httpx

SGLANG_ALGORITHM = "EAGLE3"
SGLANG_DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPEC_SHAPE_FLAGS = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
TRUST_REMOTE_CODE_FLAG = "--trust-remote-code"


# The SGLang releases eyas's contract was checked against (research/sglang-0.5.23-kimi-audit.md; the wheel kit
# kits/sglang-0.5.23.txt runs their argument code in the tests), and what is not known of any other release.
CHECKED_SGLANG_VERSIONS = ("0.5.23",)
UNCHECKED_ON_OTHER_RELEASES = (
    "the layer each aux id captures for the target's model class (a changed rule captures other layers at the "
    "right width, which no later check sees)",
    "the aux-capture flags and what /server_info reports for them",
    "what the capture hook reads of LogitsProcessor.forward's arguments, the ForwardBatch and LogitsProcessorOutput",
    "the /generate answer's meta_info (finish_reason, spec_verify_ct, top logprobs)",
)


class SglangServerError(RuntimeError):
    """The SGLang server did not start, answer or finish as documented."""


class SGLangVersionError(SglangServerError):
    """The SGLang server's release is not one eyas can use: too old, or unchecked and not allowed."""


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


def check_sglang_version(version: str, allowed: Sequence[str], where: str) -> None:
    """Refuse a release eyas has not checked, unless the config names it in sglang.allow_unchecked_versions."""
    if version in CHECKED_SGLANG_VERSIONS or version in allowed:
        return
    raise SGLangVersionError(
        f"{where}: SGLang {version} is not a release eyas has checked ({', '.join(CHECKED_SGLANG_VERSIONS)}); "
        f"not checked on {version}: {'; '.join(UNCHECKED_ON_OTHER_RELEASES)}. Install SGLang "
        f'{CHECKED_SGLANG_VERSIONS[-1]} in SGLang\'s environment (README: A GPU machine), or add "{version}" to '
        "sglang.allow_unchecked_versions to run with it unchecked"
    )


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as "0.5.23" or "v0.5.23.post1"; None if it is none."""
    match = re.match(r"v?(\d+)\.(\d+)\.(\d+)", text.strip())
    return None if match is None else tuple(int(g) for g in match.groups())


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
