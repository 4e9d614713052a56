"""SGLang 0.5.23's own code on CPU, for the tests and the doubles: what a launch command resolves to.

    with sglang_kit_service(tmp_dir) as url:              # conftest's session fixture `sglang_kit` starts it
        info = resolved_server_info(argv)                 # what GET /server_info of that server answers
        resolved_server_info(bad_argv)                    # raises SglangRefused with SGLang's own message

The kit (kits/sglang-0.5.23.txt: the 0.5.23 wheel and the small packages its argument code imports, each
pinned by sha256) is installed by `make install` into .kits/sglang-0.5.23, never into the environment, so
`import sglang` in the test process still means a real install (the gpu-marked tests look for one). The
service (tests/sglang_kit/resolver.py) runs in its own process with the kit first on its path and SGLang's
`triton`/`torchvision` imports served by stand-ins (tests/sglang_kit/stand_ins.py). Doubles find it through
EYAS_SGLANG_KIT_URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from kits import kit_env  # noqa: E402

KIT = "sglang-0.5.23"
KIT_URL_ENV = "EYAS_SGLANG_KIT_URL"
LAUNCH_MODULES = ("sglang.launch_server", "tests.sglang_double", "tests.sglang_extract_double")


# A draft config for the tiny target as SGLang's resolution reads it (speculative_hook.py reads the draft's
# config.json): what eyas's sglang export writes, less the fields SGLang does not read.
TINY_DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-05, "num_hidden_layers": 1, "vocab_size": 2048,
    "draft_vocab_size": 512, "tie_word_embeddings": False, "target_hidden_size": 128,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
}  # fmt: skip


class SglangRefused(RuntimeError):
    """SGLang's own argument code refused the command; the message is SGLang's."""


def kit_python_env() -> dict:
    env = kit_env(KIT)
    env["HF_HUB_OFFLINE"] = "1"
    return env


@contextlib.contextmanager
def sglang_kit_service(work_dir: Path, startup_timeout_s: float = 180):
    """The resolver service of tests/sglang_kit/resolver.py, on loopback; yields its URL."""
    port_file = Path(work_dir) / "sglang-kit.port"
    log = open(Path(work_dir) / "sglang-kit.log", "wb")
    script = REPO / "tests" / "sglang_kit" / "resolver.py"
    env = kit_python_env()
    env["HF_MODULES_CACHE"] = str(Path(work_dir) / "hf-modules")  # a target's own code (trust_remote_code) goes here
    proc = subprocess.Popen(
        [sys.executable, str(script), "--port-file", str(port_file)], env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (Path(work_dir) / "sglang-kit.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"SGLang kit service did not start (exit {proc.poll()}):\n{tail}")
            time.sleep(0.2)
        time.sleep(0.05)  # the port is written just before serve_forever
        yield f"http://127.0.0.1:{port_file.read_text().strip()}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def server_args_of(argv: list[str]) -> list[str]:
    """The flags of `python -m <launch module> FLAGS` (or FLAGS themselves)."""
    argv = [str(a) for a in argv]
    if "-m" in argv and argv[argv.index("-m") + 1] in LAUNCH_MODULES:
        return argv[argv.index("-m") + 2 :]
    return argv


def resolve(argv: list[str], url: str | None = None) -> dict:
    """{"ok": ..., "server_info" | "error"} from SGLang's own code for a launch command."""
    url = url or os.environ.get(KIT_URL_ENV)
    if not url:
        raise RuntimeError(
            f"{KIT_URL_ENV} is not set: the SGLang doubles answer from SGLang's own resolution; run them under "
            "the `sglang_kit` fixture (tests/conftest.py), which starts the kit service"
        )
    answer = httpx.post(f"{url}/server_info", json={"argv": server_args_of(argv)}, timeout=120)
    answer.raise_for_status()
    return answer.json()


def resolved_server_info(argv: list[str], url: str | None = None) -> dict:
    """What GET /server_info of the server this command starts answers; SglangRefused if SGLang refuses it."""
    result = resolve(argv, url)
    if not result["ok"]:
        raise SglangRefused(f"SGLang 0.5.23 refuses `{' '.join(server_args_of(argv))}`: {result['error']}")
    return result["server_info"]


def dump(info: dict) -> str:
    return json.dumps(info, indent=1, sort_keys=True, default=repr)
