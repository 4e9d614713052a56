"""Every mistake a user plausibly makes, for every config section and every CLI verb, is answered cleanly: one
message naming what is wrong, exit code 2, no traceback, whichever stage finds it.

The table below is the test: (what, argv, exit code, words of the message). Config rows name the preset's edits
(`deployments/tiny-cpu.json`, workdir under the test's directory); {dir}, {file}, {missing}, {latin1}, {notjson},
{list}, {empty}, {badtarget}, {wronghidden}, {badjson}, {badtext} are a directory, a plain file, a path that does not
exist, a JSONL file that is not UTF-8, a file that is not JSON, a JSON list, an empty file, a target whose config.json
is not JSON, one whose config.json gives another hidden size than its weights, and drafter directories whose
config.json is not JSON or not UTF-8. Each row runs the real command in its own process (tests/cli_rows.py
forks one per row from an interpreter that imported the CLI once). Answered cleanly = the exit code, every word in
stderr, no "Traceback" in stdout or stderr, at most one `eyas:` message, and no config section's values dumped.

Rows found before a stage starts need no Prefect server (PREFECT_API_URL points where nothing answers, so a row that
wrongly got past its check cannot start one); rows found inside a stage's flow run against the session's server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "deployments" / "tiny-cpu.json"
DEAD_API = "http://127.0.0.1:9/api"
DELETE = object()

# fmt: off
# (section, mistake, verb, edits of the preset, exit code, words of the message); edits None: the config file
# itself is the mistake (CONFIG_FILES)
CONFIG_ROWS = [
    ("config", "the file does not exist", "run", None, 2, ["config {missing}: no such file; expected a JSON RunConfig"]),
    ("config", "a directory", "plan", None, 2, ["config {dir}: a directory; expected a JSON RunConfig file"]),
    ("config", "not JSON", "run", None, 2, ["config {notjson}: 1 problem(s)", "not valid JSON: key must be a string"]),
    ("config", "not UTF-8", "dataset", None, 2, ["config {latin1}: not text", "expected a JSON RunConfig"]),
    ("config", "a JSON list", "engine-command", None, 2, ["(the whole config): found [1, 2], expected an object"]),
    ("config", "empty", "train", None, 2, ["config {empty}: 1 problem(s)", "not valid JSON: EOF while parsing"]),
    ("config", "an unknown section", "run", {"foo": {}}, 2, ["foo: unknown field; expected one of ['approval'"]),
    ("name", "capitals and a space", "run", {"name": "My Run"}, 2,
     ["name: found 'My Run', expected a string matching ^[a-z0-9][a-z0-9-]*$"]),
    ("workdir", "missing", "run", {"workdir": DELETE}, 2, ["workdir: missing; expected a value"]),
    ("workdir", "a number", "run", {"workdir": 5}, 2, ["workdir: found 5, expected a string"]),
    ("workdir", "a file", "dataset", {"workdir": "{file}"}, 2,
     ["workdir='{file}': {file} is a file, expected a directory", "fix workdir in the config"]),
    ("workdir", "under a file", "run", {"workdir": "{file}/run"}, 2,
     ["workdir='{file}/run': {file} is a file, expected a directory"]),
    ("target", "no such directory", "plan", {"target.model_path": "{missing}"}, 2,
     ["cannot read the facts of target.model_path='{missing}'", "set target.model_path in the config"]),
    ("target", "a file", "engine-command", {"target.model_path": "{file}"}, 2,
     ["target '{file}': no config.json; expected a Hugging Face model directory"]),
    ("target", "a directory without config.json", "plan", {"target.model_path": "{dir}"}, 2,
     ["target.model_path='{dir}'", "no config.json"]),
    ("target", "a config.json that is not JSON", "plan", {"target.model_path": "{badtarget}"}, 2,
     ["{badtarget}/config.json (named by target.model_path='{badtarget}'): not valid JSON", "fix the file"]),
    ("target", "a dtype that does not exist", "run", {"target.dtype": "fp8"}, 2,
     ["target.dtype: found 'fp8', expected one of 'float32', 'bfloat16' or 'float16'"]),
    ("target", "a word for a flag", "run", {"target.trust_remote_code": "maybe"}, 2,
     ["target.trust_remote_code: found 'maybe', expected true or false"]),
    ("target", "layer ids as a string", "run", {"target.aux_layer_ids": "2,4,5"}, 2,
     ["target.aux_layer_ids: found '2,4,5', expected a list"]),
    ("dataset", "responses misspelled", "dataset", {"dataset.responses": "maybe"}, 2,
     ["dataset.responses: found 'maybe', expected one of 'regenerate' or 'as_given'"]),
    ("dataset", "max_length below 8", "run", {"dataset.max_length": 4}, 2,
     ["dataset.max_length: found 4, expected a value >= 8"]),
    ("dataset", "draft_vocab_size 1", "run", {"dataset.draft_vocab_size": 1}, 2,
     ["dataset.draft_vocab_size: found 1, expected a value >= 2"]),
    ("dataset", "num_samples negative", "run", {"dataset.num_samples": -1}, 2,
     ["dataset.num_samples: found -1, expected a value >= 0"]),
    ("dataset", "prompts_path missing", "run", {"dataset.prompts_path": DELETE}, 2, ["dataset.prompts_path: missing"]),
    ("dataset", "an unknown generator", "run", {"dataset.generation.generator": "vllm"}, 2,
     ["dataset.generation.generator: found 'vllm', expected one of 'hf', 'sglang' or 'openai'"]),
    ("dataset", "a server URL without scheme", "run", {"dataset.generation.generator": "openai",
     "dataset.generation.server_urls": ["localhost:8000"], "dataset.generation.openai_model": "m"}, 2,
     ["dataset.generation.server_urls: ['localhost:8000'] expected http://HOST:PORT"]),
    ("dataset", "openai without a model name", "run", {"dataset.generation.generator": "openai",
     "dataset.generation.server_urls": ["http://h:1"]}, 2, ["generator='openai' needs server_urls and openai_model"]),
    ("dataset", "top_p 0", "run", {"dataset.generation.top_p": 0}, 2,
     ["dataset.generation.top_p: found 0, expected a value > 0"]),
    ("extract", "an unknown backend", "extract", {"extract.backend": "vllm"}, 2,
     ["extract.backend: found 'vllm', expected one of 'hf' or 'sglang'"]),
    ("extract", "shard_bytes as words", "extract", {"extract.shard_bytes": "1 GiB"}, 2,
     ["extract.shard_bytes: found '1 GiB', expected an integer"]),
    ("extract", "batch_size 0", "extract", {"extract.batch_size": 0}, 2,
     ["extract.batch_size: found 0, expected a value >= 1"]),
    ("extract", "storage_url a local path", "extract", {"extract.storage_url": "/data/shards"}, 2,
     ["extract.storage_url='/data/shards': expected empty (the run's shards dir) or s3://bucket/prefix"]),
    ("extract", "topk teacher stored in bfloat16", "extract", {"extract.teacher": "topk", "extract.dtype": "bfloat16"},
     2, ["extract.teacher='topk' stores log-probabilities", "set extract.dtype to float16"]),
    ("extract", "deployment fan-out without a deployment", "extract", {"extract.fanout": "deployment"}, 2,
     ["extract.fanout='deployment' needs extract.worker_deployment"]),
    ("extract", "an SGLang URL without scheme", "engine-command", {"extract.sglang.server_url": "localhost:30000"}, 2,
     ["extract.sglang.server_url='localhost:30000': expected empty (launch a server) or http://HOST:PORT"]),
    ("verify", "an unknown mode", "verify", {"verify.mode": "fast"}, 2,
     ["verify.mode: found 'fast', expected one of 'cheap' or 'full'"]),
    ("verify", "heal rounds above 5", "verify", {"verify.num_heal_rounds": 9}, 2,
     ["verify.num_heal_rounds: found 9, expected a value <= 5"]),
    ("verify", "chunk_bytes 1", "verify", {"verify.chunk_bytes": 1}, 2,
     ["verify.chunk_bytes: found 1, expected a value >= 65536"]),
    ("draft", "heads not a multiple of kv heads", "plan", {"draft.num_attention_heads": 5}, 2,
     ["draft.num_attention_heads=5 is not a multiple of draft.num_key_value_heads=2; pick a divisor"]),
    ("draft", "head_dim 4", "plan", {"draft.head_dim": 4}, 2, ["draft.head_dim: found 4, expected a value >= 8"]),
    ("draft", "an unknown variant", "plan", {"draft.variant": "eagle4"}, 2,
     ["draft.variant: found 'eagle4', expected one of 'eagle3', 'eagle3.1' or 'norm_before_fc'"]),
    ("train", "num_processes 0", "train", {"train.num_processes": 0}, 2,
     ["train.num_processes: found 0, expected a value >= 1"]),
    ("train", "a negative lr", "train", {"train.lr": -1}, 2, ["train.lr: found -1, expected a value > 0"]),
    ("train", "epochs as a word", "train", {"train.num_epochs": "five"}, 2,
     ["train.num_epochs: found 'five', expected an integer"]),
    ("train", "an unknown backend", "train", {"train.backend": "mpi"}, 2,
     ["train.backend: found 'mpi', expected one of 'gloo' or 'nccl'"]),
    ("train", "a relative checkpoint copy", "train", {"train.checkpoint_copy_url": "copies/run"}, 2,
     ["train.checkpoint_copy_url='copies/run': expected empty (no copy), s3://bucket/prefix, or an absolute"]),
    ("train", "eval_fraction 0.5", "train", {"train.eval_fraction": 0.5}, 2,
     ["train.eval_fraction: found 0.5, expected a value < 0.5"]),
    ("train", "an old field name", "train", {"train.ttt_steps": 4}, 2, ["train.ttt_steps is now train.num_ttt_steps"]),
    ("train", "a shard cache for local shards", "train", {"train.cache_bytes": 1 << 30}, 2,
     ["train.cache_bytes=1073741824: the shard cache reads shards stored on S3"]),
    ("train", "a device too small for the plan", "plan", {"train.device_memory_gib": 0.001}, 2,
     ["training needs 0.1 GiB per device", "fixes: train.activation_checkpointing=true"]),
    ("smoke", "min_loss_drop above 1", "run", {"smoke.min_loss_drop": 1.5}, 2,
     ["smoke.min_loss_drop: found 1.5, expected a value < 1"]),
    ("smoke", "one step", "run", {"smoke.num_steps": 1}, 2, ["smoke.num_steps: found 1, expected a value >= 2"]),
    ("approval", "a 5 s timeout", "run", {"approval.timeout_s": 5}, 2,
     ["approval.timeout_s: found 5, expected a value >= 10"]),
    ("approval", "a removed field", "run", {"approval.gpu_hours_per_step": 0.1}, 2,
     ["approval.gpu_hours_per_step was removed", "delete the key from the preset"]),
    ("export", "a format the stage does not write", "export", {"export.format": "vllm"}, 2,
     ["export.format: found 'vllm', expected one of 'sglang' or 'sglang-0.5.12'"]),
    ("export", "a release without patch number", "export", {"export.sglang_version": "0.5"}, 2,
     ["export.sglang_version: found '0.5', expected a string matching"]),
    ("export", "an unknown checkpoint", "export", {"export.checkpoint": "middle"}, 2,
     ["export.checkpoint: found 'middle', expected one of 'best' or 'last'"]),
    ("bench", "prompts_path missing", "bench", {"bench.prompts_path": DELETE}, 2, ["bench.prompts_path: missing"]),
    ("bench", "an unknown engine", "bench", {"bench.engine": "vllm"}, 2,
     ["bench.engine: found 'vllm', expected one of 'reference' or 'sglang'"]),
    ("bench", "a tree without its size", "bench", {"bench.topk": 2}, 2,
     ["bench.topk=2 (a tree) needs bench.num_draft_tokens >= 2"]),
    ("bench", "draft tokens that are no chain", "bench", {"bench.num_draft_tokens": 7}, 2,
     ["bench.num_draft_tokens=7 with bench.topk=1", "expected 0 or num_steps + 1 = 4"]),
    ("bench", "a negative min_tau", "bench", {"bench.min_tau": -1}, 2, ["bench.min_tau: found -1, expected a value >= 0"]),
    ("bench", "an old field name", "bench", {"bench.steps": 3}, 2, ["bench.steps is now bench.num_steps"]),
    ("sglang", "an interpreter by name", "engine-command", {"sglang.python": "python3"}, 2,
     ["sglang.python='python3': expected the path of SGLang's interpreter"]),
    ("sglang", "a version that is no release", "engine-command", {"sglang.allow_unchecked_versions": ["latest"]}, 2,
     ["sglang.allow_unchecked_versions: ['latest'] expected release strings"]),
]
CONFIG_FILES = {"the file does not exist": "missing", "a directory": "dir", "not JSON": "notjson",
                "not UTF-8": "latin1", "a JSON list": "list", "empty": "empty"}

# (verb, mistake, argv, environment, exit code, words of the message); {preset}: the preset, as it is;
# {config:FIELD=VALUE}: the preset with one field set
VERB_ROWS = [
    ("(none)", "an unknown verb", ["fly"], {}, 2, ["invalid choice: 'fly'"]),
    ("dataset", "no config given", ["dataset"], {}, 2, ["the following arguments are required: config"]),
    ("demo", "--workdir a file", ["demo", "--workdir", "{file}"], {}, 2, ["{file} is a file, expected a directory"]),
    ("demo", "--approve maybe", ["demo", "--approve", "maybe"], {}, 2, ["invalid choice: 'maybe'"]),
    ("run", "a crash window below one heartbeat", ["run", "{preset}"], {"EYAS_CRASH_WITHIN_S": "5"}, 2,
     ["EYAS_CRASH_WITHIN_S='5': expected whole seconds above the heartbeat interval"]),
    ("run", "a server that does not answer", ["run", "{preset}"], {}, 2, [f"PREFECT_API_URL={DEAD_API} does not answer"]),
    ("worker", "--within-s as a word", ["worker", "--within-s", "soon"], {}, 2, ["invalid int value: 'soon'"]),
    ("worker", "a server that does not answer", ["worker", "--setup-only"], {}, 2, ["does not answer /health"]),
    ("deploy", "neither --name nor --all", ["deploy"], {}, 2, ["one of the arguments --name --all is required"]),
    ("deploy", "a server that does not answer", ["deploy", "--name", "x"], {}, 2, ["does not answer /health"]),
    ("approve", "not a flow run id", ["approve", "not-a-uuid"], {}, 2, ["eyas approve not-a-uuid: not a flow run id"]),
    ("approve", "a server that does not answer", ["approve", "0b6c4a3e-2f1d-4c6b-9a57-3e8f0d1c2b4a"], {}, 2,
     ["does not answer /health"]),
    ("inspect", "no such directory", ["inspect", "{missing}"], {}, 2,
     ["eyas inspect {missing}: no such directory; expected a drafter checkpoint directory"]),
    ("inspect", "a file for the checkpoint directory", ["inspect", "{file}"], {}, 2,
     ["eyas inspect {file}: a file; expected a drafter checkpoint directory", "name the directory that holds it"]),
    ("inspect", "a directory without weights", ["inspect", "{dir}"], {}, 2,
     ["eyas inspect: {dir}: neither model.safetensors nor pytorch_model.bin"]),
    ("inspect", "--target that does not exist", ["inspect", "{dir}", "--target", "{missing}"], {}, 2,
     ["eyas inspect --target {missing}: no such directory; expected a Hugging Face model directory"]),
    ("inspect", "a drafter whose config.json is not JSON", ["inspect", "{badjson}"], {}, 2,
     ["eyas inspect: {badjson}/config.json: not valid JSON (Expecting property name", "fix the file"]),
    ("inspect", "a drafter whose config.json is not UTF-8", ["inspect", "{badtext}"], {}, 2,
     ["eyas inspect: {badtext}/config.json: not UTF-8 text (invalid continuation byte", "re-encode the file"]),
    ("inspect", "a negative layer count", ["inspect", "{dir}", "--num-target-layers", "-3"], {}, 2,
     ["argument --num-target-layers: '-3': expected a whole number above 0"]),
    ("inspect", "an unknown engine", ["inspect", "{dir}", "--engine", "sglang-9"], {}, 2, ["invalid choice"]),
    ("inspect", "a layer count as a word", ["inspect", "{dir}", "--num-target-layers", "many"], {}, 2,
     ["argument --num-target-layers: 'many': expected a whole number above 0"]),
    ("remap", "an unknown format", ["remap", "{dir}", "{missing}", "--to", "onnx"], {}, 2,
     ["eyas remap --to onnx: unknown format; expected one of ['eagle'"]),
    ("remap", "no such source", ["remap", "{missing}", "{root}/out", "--to", "sglang"], {}, 2,
     ["eyas remap {missing}: no such directory; expected a drafter checkpoint directory"]),
    ("remap", "--embed-from that does not exist", ["remap", "{dir}", "{root}/out", "--to", "eyas", "--embed-from",
     "{missing}"], {}, 2, ["eyas remap --embed-from {missing}: no such file or directory"]),
    ("remap", "a destination under a file", ["remap", "{dir}", "{file}/out", "--to", "sglang"], {}, 2,
     ["{file} is a file; expected a directory to write the converted drafter to"]),
    ("remap", "a source whose config.json is not JSON", ["remap", "{badjson}", "{root}/out", "--to", "eyas"], {}, 2,
     ["eyas remap: {badjson}/config.json: not valid JSON"]),
    ("remap", "an unknown dtype", ["remap", "{dir}", "{missing}", "--to", "sglang", "--dtype", "int8"], {}, 2,
     ["invalid choice: 'int8'"]),
    ("stop", "no such directory", ["stop", "{missing}"], {}, 2,
     ["eyas stop {missing}: no such directory; expected a run's train directory"]),
    ("stop", "a file", ["stop", "{file}"], {}, 2, ["eyas stop {file}: a file; expected a run's train directory"]),
    ("status", "a config with a wrong type", ["status", "{config:train.num_epochs=five}"], {}, 2,
     ["train.num_epochs: found 'five', expected an integer"]),
    ("status", "a config that is not JSON", ["status", "{notjson}"], {}, 2, ["eyas status: config", "not valid JSON"]),
    ("status", "a directory that is not a run", ["status", "{dir}"], {}, 2,
     ["{dir}: not an eyas run", "expected a run's workdir"]),
    ("target", "no such path", ["target", "{missing}"], {}, 2,
     ["eyas target {missing}: no such directory; expected a Hugging Face model directory"]),
    ("target", "a directory without config.json", ["target", "{dir}"], {}, 2, ["no config.json"]),
    ("target", "a config.json that is not JSON", ["target", "{badtarget}"], {}, 2,
     ["eyas target: {badtarget}/config.json: not valid JSON (Expecting property name"]),
    ("target", "config.json's hidden_size not the weights'", ["target", "{wronghidden}"], {}, 2,
     ["config.json does not describe its weights (hidden_size 256, the weights 128)", "set hidden_size to 128"]),
    ("plan", "a config with a wrong type", ["plan", "{config:train.num_epochs=five}"], {}, 2,
     ["train.num_epochs: found 'five', expected an integer"]),
    ("engine-command", "an unknown stage", ["engine-command", "{preset}", "--stage", "train"], {}, 2,
     ["invalid choice: 'train'"]),
]

# Found inside a stage's flow run, against a Prefect server: (verb, mistake, edits of the preset, exit code, words)
STAGE_ROWS = [
    ("dataset", "prompts_path a directory", {"dataset.prompts_path": "{dir}"}, 2,
     ["dataset.prompts_path='{dir}': a directory, expected JSONL or Parquet of conversations", "name the file itself"]),
    ("dataset", "prompts not UTF-8", {"dataset.prompts_path": "{latin1}"}, 2,
     ["{latin1}:1: not UTF-8 text", "re-encode the file"]),
    ("dataset", "draft_vocab_size above the target's vocab", {"dataset.draft_vocab_size": 4096}, 2,
     ["dataset.draft_vocab_size=4096: larger than the target's vocab of 2048 tokens", "lower dataset.draft_vocab_size"]),
    ("dataset", "as_given prompts without assistant turns", {"dataset.responses": "as_given"}, 2,
     ["conversations have no assistant turn", "set dataset.responses='regenerate'"]),
    ("verify", "before the dataset stage", {}, 2, ["tokenized.parquet: no such file; run the dataset stage first"]),
    ("bench", "held-out prompts missing", {"bench.prompts_path": "{missing}"}, 2,
     ["bench.prompts_path='{missing}': no such file, expected held-out prompts JSONL; fix the path"]),
    ("bench", "held-out prompts not JSON", {"bench.prompts_path": "{notjson}"}, 2,
     ["bench.prompts_path='{notjson}'", "{notjson}:1: not a JSON object"]),
    ("run", "held-out prompts missing, found before the pipeline's first stage", {"bench.prompts_path": "{missing}"},
     2, ["bench.prompts_path='{missing}': no such file", "found before any stage started its work"]),
    ("train", "more trainer processes than cores", {"train.num_processes": 64}, 2,
     ["train.num_processes=64 with train.backend='gloo' starts 64 trainer processes", "lower train.num_processes"]),
]
# fmt: on


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    """The paths the rows name: {dir}, {file}, {missing}, ... (see the module docstring)."""
    root = tmp_path_factory.mktemp("mistakes")
    (root / "a dir").mkdir()
    (root / "a file").write_text("x\n")
    (root / "latin1.jsonl").write_bytes(
        '{"id": "a", "conversations": [{"role": "user", "content": "café"}]}\n'.encode("latin-1")
    )
    (root / "notjson.jsonl").write_text("{not json\n")
    (root / "list.json").write_text("[1, 2]\n")
    (root / "empty.json").write_text("")
    (root / "badtarget").mkdir()
    (root / "badtarget" / "config.json").write_text("{cut")
    for name, text in (("badjson", b"{cut"), ("badtext", b'{"name": "caf\xe9"}')):  # drafters with a bad config.json
        (root / name).mkdir()
        (root / name / "config.json").write_bytes(text)
        (root / name / "model.safetensors").symlink_to(REPO / "fixtures" / "tiny-target" / "model.safetensors")
    (root / "wronghidden").mkdir()  # the tiny target's weights under a config.json with another hidden_size
    tiny = REPO / "fixtures" / "tiny-target"
    (root / "wronghidden" / "config.json").write_text(
        json.dumps({**json.loads((tiny / "config.json").read_text()), "hidden_size": 256})
    )
    (root / "wronghidden" / "model.safetensors").symlink_to(tiny / "model.safetensors")
    return {"dir": str(root / "a dir"), "file": str(root / "a file"), "missing": str(root / "nowhere"),
            "latin1": str(root / "latin1.jsonl"), "notjson": str(root / "notjson.jsonl"),
            "list": str(root / "list.json"), "empty": str(root / "empty.json"),
            "badtarget": str(root / "badtarget"), "wronghidden": str(root / "wronghidden"), "badjson": str(root / "badjson"),
            "badtext": str(root / "badtext"), "root": str(root)}  # fmt: skip


def fill(text: str, places: dict) -> str:
    for key, value in places.items():
        text = text.replace("{" + key + "}", value)
    return text


def edited_preset(path: Path, edits: dict, places: dict) -> Path:
    config = json.loads(PRESET.read_text())
    config["workdir"] = str(path.with_suffix(".run"))
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        section = config
        for part in parents:
            section = section.setdefault(part, {})
        if value is DELETE:
            section.pop(last, None)
        else:
            section[last] = fill(value, places) if isinstance(value, str) else value
    path.write_text(json.dumps(config))
    return path


def config_row_argv(i: int, mistake: str, verb: str, edits, places: dict) -> list[str]:
    """The command of a CONFIG_ROWS row: the verb on the edited preset, or on the file the mistake names."""
    root = Path(places["root"])
    if edits is not None:
        path = edited_preset(root / f"config-{i}.json", edits, places)
    else:
        path = places[CONFIG_FILES[mistake]]
    return [verb, str(path)] + (["--stage", "extract"] if verb == "engine-command" else [])


def verb_row_argv(i: int, argv: list[str], places: dict) -> list[str]:
    out = []
    for arg in argv:
        if arg == "{preset}":
            arg = str(edited_preset(Path(places["root"]) / f"verb-{i}.json", {}, places))
        elif arg.startswith("{config:"):
            dotted, value = arg[len("{config:") : -1].split("=")
            arg = str(edited_preset(Path(places["root"]) / f"verb-{i}.json", {dotted: value}, places))
        out.append(fill(arg, places))
    return out


def run_rows(rows: list[dict], work: Path, parallel: int) -> list[dict]:
    """Each row's {code, stdout, stderr} (tests/cli_rows.py)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "rows.json").write_text(json.dumps(rows))
    done = subprocess.run([sys.executable, str(REPO / "tests" / "cli_rows.py"), str(work / "rows.json"),
                           str(work / "results.json"), str(parallel)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((work / "results.json").read_text())


def answered_cleanly(result: dict, code: int, words: list[str]) -> str | None:
    """None when the row was answered cleanly, else what was wrong."""
    out, err = result["stdout"], result["stderr"]
    if result["code"] != code:
        return f"exit code {result['code']}, expected {code}"
    if "Traceback" in out + err:
        return "a traceback"
    missing = [w for w in words if w not in err]
    if missing:
        return f"words {missing} not in stderr"
    if sum(line.startswith("eyas: ") for line in err.splitlines()) > 1:
        return "more than one eyas: message"
    if "found {'" in err:
        return "a whole config section's values in the message"
    return None


def check_table(labels: list[str], results: list[dict], expected: list[tuple[int, list[str]]]) -> None:
    problems = []
    for label, result, (code, words) in zip(labels, results, expected):
        wrong = answered_cleanly(result, code, words)
        if wrong:
            problems.append(f"{label}: {wrong}\n    stderr: {result['stderr'][-1200:]}")
    print(f"{len(labels) - len(problems)} of {len(labels)} rows answered cleanly")
    assert not problems, "\n".join(problems)


def base_env(places: dict, api: str) -> dict:
    return {"PREFECT_API_URL": api, "EYAS_STATE_DIR": str(Path(places["root"]) / "state"), "EYAS_DEBUG": "0"}


def test_mistakes_found_before_a_stage_starts(places, tmp_path):
    env = base_env(places, DEAD_API)
    labels, rows, expected = [], [], []
    for i, (section, mistake, verb, edits, code, words) in enumerate(CONFIG_ROWS):
        labels.append(f"config {section}: {mistake} ({verb})")
        rows.append({"argv": config_row_argv(i, mistake, verb, edits, places), "env": env})
        expected.append((code, [fill(w, places) for w in words]))
    for i, (verb, mistake, argv, extra, code, words) in enumerate(VERB_ROWS):
        labels.append(f"eyas {verb}: {mistake}")
        rows.append({"argv": verb_row_argv(i, argv, places), "env": {**env, **extra}})
        expected.append((code, [fill(w, places) for w in words]))
    results = run_rows(rows, tmp_path / "work", parallel=2)
    check_table(labels, results, expected)
    assert not (Path(places["root"]) / "state").exists(), "a row started a Prefect server"


def test_mistakes_found_inside_a_stage(places, tmp_path, prefect_server, removes_crash_automation):
    env = {**base_env(places, prefect_server), "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
    labels, rows, expected = [], [], []
    for i, (verb, mistake, edits, code, words) in enumerate(STAGE_ROWS):
        path = edited_preset(Path(places["root"]) / f"stage-{i}.json", edits, places)
        labels.append(f"eyas {verb}: {mistake}")
        rows.append({"argv": [verb, str(path)], "env": env})
        expected.append((code, [fill(w, places) for w in words]))
    results = run_rows(rows, tmp_path / "work", parallel=2)
    check_table(labels, results, expected)
    for result in results:
        assert "Encountered exception" in result["stderr"]  # found by the flow run, then told in one line


def test_a_raw_os_error_names_the_config_field_found_expected_and_fix(tmp_path):
    from eyas.config import load_run_config
    from eyas_cli.errors import describe

    config = load_run_config(edited_preset(tmp_path / "c.json", {}, {}))
    prompts = Path(config.dataset.prompts_path)
    text = describe(IsADirectoryError(21, "Is a directory", str(prompts)), config)
    assert text.startswith(f"dataset.prompts_path={str(prompts)!r}: a directory, expected a file (conversations")
    assert "name the file itself (fix dataset.prompts_path in the config)" in text
    out = Path(config.workdir) / "export" / "sglang" / "config.json"
    text = describe(NotADirectoryError(20, "Not a directory", str(out)), config)
    assert f"workdir={config.workdir!r} (under it: {out})" in text and "fix workdir in the config" in text
    assert describe(PermissionError(13, "Permission denied", "/elsewhere/x")).startswith("/elsewhere/x: permission")
    assert describe(FileNotFoundError("tokenized dataset X: no such file; run the dataset stage first")) == (
        "tokenized dataset X: no such file; run the dataset stage first"
    )


def test_a_user_error_in_a_flow_log_is_one_line_on_the_console():
    import logging

    from eyas_cli.errors import _UserErrorsInOneLine

    formatter = _UserErrorsInOneLine(logging.Formatter("%(message)s"))

    def record(err: BaseException) -> logging.LogRecord:
        try:
            raise err
        except BaseException:  # noqa: BLE001 -- the record of whatever was raised
            return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())

    assert formatter.format(record(IsADirectoryError(21, "Is a directory", "/x"))) == "failed"
    shown = formatter.format(record(ZeroDivisionError("a bug")))
    assert "Traceback" in shown and "ZeroDivisionError" in shown
    if os.environ.get("EYAS_DEBUG") != "1":
        user = record(ValueError("bad"))
        assert formatter.format(user) == "failed" and user.exc_info is not None  # the server's handler keeps it


def test_a_failed_run_is_not_a_user_error(prefect_server):
    """Only a flow that failed on a user error ends as one (exit 2); a failed run (its own RuntimeError: training,
    verification, the gate, the benchmark's tau) or a crashed one keeps exit code 1. (prefect_server: prefect is
    imported in this process only once PREFECT_API_URL names the session's server.)"""
    from prefect.states import Completed, Crashed, Failed

    from eyas_cli.errors import raise_user_error

    for state in (Completed(data=1), Failed(data=RuntimeError("loss nan")), Crashed(message="process gone")):
        raise_user_error(state)
    with pytest.raises(IsADirectoryError):
        raise_user_error(Failed(data=IsADirectoryError(21, "Is a directory", "/x")))
