"""The `eyas` command answers bad input with one clear message and exit code 2, never a traceback.

Every case runs the real command (`python -m eyas_cli.main`, the `eyas` entry point's module) in a subprocess
and asserts the exit code, that no "Traceback" is printed, and the key words of the message:

| verb | input | message (key words) |
|---|---|---|
| run | config with an unknown key `train.foo` | `train.foo: unknown field; expected one of [...]` |
| run | `train.num_epochs: "five"` | `train.num_epochs: found 'five', expected an integer` |
| run | `train.lr: -1`, `dataset.responses: "maybe"` | every invalid field, one line each |
| run | a config that is not JSON | `not valid JSON` |
| run | a config file that does not exist | `no such file; expected a JSON RunConfig` |
| extract, engine-command, plan | the same bad config | the same list (every verb that takes a config) |
| approve | `not-a-uuid` | `not a flow run id` (no server is started) |
| approve | a well-formed id of no flow run | `no flow run with this id on the Prefect server` |
| approve | PREFECT_API_URL that does not answer | `does not answer /health` |
| inspect | a directory with random bytes as model.safetensors | `not a safetensors file (header length ...` |
| inspect | a header whose JSON is cut | `not a safetensors file` / `not JSON` |
| inspect | a directory that does not exist | `no such` |
| remap | an unknown --to format | `unknown format` |
| remap | random bytes as the source's weights | `not a safetensors file` |
| target | a directory without config.json | `no config.json` |
| status | a config with a wrong type | the field list (no pydantic links) |
| stop | a train directory that does not exist | `no such directory` |
| dataset | a conversations file that is Parquet in name only | `not a readable Parquet table` |
| (any) | --debug | the traceback, then the same message |
A bug (an unexpected exception) prints its traceback and a line saying it is one (`guarded`, tested directly).
A fuzz test feeds `eyas inspect`'s reader and `eyas verify`'s header checks a few hundred random and mutated
safetensors headers; a refused config leaves a finished run's files byte for byte as they were.
"""

from __future__ import annotations

import json
import os
import random
import resource
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from draft_fixtures import write_checkpoint
from run_fixtures import write_tiny_run

from eyas.checksum import checksum_file
from eyas.export.inspect import inspect_drafter

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "deployments" / "tiny-cpu.json"


def eyas(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "eyas_cli.main", *map(str, args)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def refused(done: subprocess.CompletedProcess, *words: str, code: int = 2) -> str:
    out = done.stdout + done.stderr
    assert done.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for w in words:
        assert w in done.stderr, f"{w!r} not in:\n{done.stderr}"
    return done.stderr


def bad_config(tmp_path: Path, edit) -> Path:
    config = json.loads(PRESET.read_text())
    config["workdir"] = str(tmp_path / "run")
    edit(config)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    return path


def test_an_unknown_key_names_the_field_and_the_known_ones(tmp_path):
    path = bad_config(tmp_path, lambda c: c["train"].update(foo=1))
    err = refused(eyas("run", path), f"config {path}: 1 problem(s)", "train.foo: unknown field; expected one of [")
    assert "'num_epochs'" in err and "deployments/tiny-cpu.json" in err


def test_a_wrong_type_names_the_field_the_value_and_the_expectation(tmp_path):
    path = bad_config(tmp_path, lambda c: c["train"].update(num_epochs="five"))
    refused(eyas("run", path), "train.num_epochs: found 'five', expected an integer")


def test_every_invalid_field_is_listed_by_every_verb_that_takes_a_config(tmp_path):
    def edit(c):
        c["train"]["lr"] = -1
        c["dataset"]["responses"] = "maybe"

    path = bad_config(tmp_path, edit)
    for args in (("run", path), ("extract", path), ("engine-command", path, "--stage", "extract"), ("plan", path)):
        err = refused(eyas(*args), "2 problem(s)", "train.lr: found -1, expected a value > 0",
                      "dataset.responses: found 'maybe', expected one of 'regenerate' or 'as_given'")  # fmt: skip
        assert err.count("\n  ") == 2


def test_a_config_that_is_not_json_or_not_there(tmp_path):
    (tmp_path / "c.json").write_text("{not json")
    refused(eyas("run", tmp_path / "c.json"), "not valid JSON")
    refused(eyas("run", tmp_path / "none.json"), f"config {tmp_path / 'none.json'}: no such file; expected a JSON")


def test_approve_with_a_malformed_id_starts_no_server(tmp_path):
    err = refused(eyas("approve", "not-a-uuid", env={"EYAS_STATE_DIR": str(tmp_path / "state")}), "not a flow run id")
    assert "starting a local Prefect server" not in err and not (tmp_path / "state").exists()


def test_approve_with_an_id_of_no_run_and_with_an_unreachable_server(prefect_server):
    missing = uuid.uuid4()
    refused(eyas("approve", missing), f"eyas approve {missing}: no flow run with this id on the Prefect server")
    refused(eyas("approve", missing, env={"PREFECT_API_URL": "http://127.0.0.1:9/api"}), "does not answer /health")


def junk_drafter(tmp_path: Path, weights: bytes) -> Path:
    out = tmp_path / "drafter"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (out / "model.safetensors").write_bytes(weights)
    return out


def test_inspect_refuses_foreign_weights_before_allocating(tmp_path):
    rng = random.Random(0)
    out = junk_drafter(tmp_path, bytes(rng.randrange(256) for _ in range(4096)))
    refused(eyas("inspect", out), "model.safetensors: not a safetensors file (header length")
    junk_drafter(tmp_path, struct.pack("<Q", 40) + b'{"fc.weight": {"dtype": "F32", "sh')
    refused(eyas("inspect", out), "not a safetensors file")
    refused(eyas("inspect", tmp_path / "nowhere"), "nowhere")


def test_remap_refuses_an_unknown_format_and_foreign_weights(tmp_path):
    out = junk_drafter(tmp_path, b"\xff" * 64)
    refused(eyas("remap", out, tmp_path / "dst", "--to", "nonsense"), "unknown format")
    refused(eyas("remap", out, tmp_path / "dst", "--to", "sglang"), "not a safetensors file")
    assert not (tmp_path / "dst").exists()


def test_target_without_a_config(tmp_path):
    refused(eyas("target", tmp_path), "no config.json")


def test_a_conversations_file_that_is_parquet_in_name_only(tmp_path):
    (tmp_path / "c.parquet").write_text("id,text\n1,hello\n")
    path = bad_config(tmp_path, lambda c: c["dataset"].update(prompts_path=str(tmp_path / "c.parquet")))
    done = eyas("engine-command", path, "--stage", "generate")  # validates; then read by the dataset stage
    assert done.returncode == 0
    from eyas.dataset.conversations import read_conversations

    with pytest.raises(ValueError, match=r"conversations file .*c.parquet: not a readable Parquet table"):
        read_conversations(tmp_path / "c.parquet")


def test_status_and_stop_name_what_is_wrong(tmp_path):
    path = bad_config(tmp_path, lambda c: c["train"].update(num_epochs="five"))
    err = refused(eyas("status", path), "train.num_epochs: found 'five', expected an integer")
    assert "errors.pydantic.dev" not in err
    refused(eyas("stop", tmp_path / "nowhere"), "no such directory; expected a run's train directory")


def test_debug_shows_the_traceback_and_the_message(tmp_path):
    path = bad_config(tmp_path, lambda c: c["train"].update(foo=1))
    done = eyas("--debug", "run", path)
    assert done.returncode == 2 and "Traceback" in done.stderr and "train.foo: unknown field" in done.stderr


def test_a_bug_prints_its_traceback_and_says_it_is_one(capsys):
    from eyas_cli.errors import EXIT_BUG, guarded

    def broken() -> int:
        return 1 // 0

    assert guarded(broken) == EXIT_BUG
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err and "internal error (a bug in eyas" in err


# ---- fuzz -------------------------------------------------------------------------------------------------


def mutations(valid: bytes, rng: random.Random, n: int):
    header_len = struct.unpack("<Q", valid[:8])[0]
    header = json.loads(valid[8 : 8 + header_len])
    for i in range(n):
        kind = i % 7
        if kind == 0:  # truncated anywhere
            yield valid[: rng.randrange(len(valid))]
        elif kind == 1:  # a huge or a wrong header length
            yield (
                struct.pack("<Q", rng.choice([2**63, 2**40, len(valid), header_len + rng.randrange(1, 9)])) + valid[8:]
            )
        elif kind == 2:  # bytes of the header flipped
            b = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                b[8 + rng.randrange(header_len)] = rng.randrange(256)
            yield bytes(b)
        else:
            h = json.loads(json.dumps(header))
            name = rng.choice([k for k in h if k != "__metadata__"])
            if kind == 3:
                h[name]["dtype"] = rng.choice(["F33", "", None, 7, "I4"])
            elif kind == 4:
                h[name]["data_offsets"] = rng.choice([[-8, 16], [0, 2**40], [16, 8], "x", [0]])
            elif kind == 5:  # overlapping ranges
                other = rng.choice([k for k in h if k not in ("__metadata__", name)])
                h[name]["data_offsets"] = list(h[other]["data_offsets"])
            else:
                h[name]["shape"] = rng.choice([[-1, 4], [2**31, 2**31], "big", [1.5]])
            blob = json.dumps(h).encode()
            yield struct.pack("<Q", len(blob)) + blob + valid[8 + header_len :]


def test_fuzzed_drafter_headers_get_the_clear_refusal_and_bounded_memory(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    valid = (ckpt / "model.safetensors").read_bytes()
    rng = random.Random(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {"refused": 0, "inspected": 0}
    for i, blob in enumerate(mutations(valid, rng, 300)):
        (ckpt / "model.safetensors").write_bytes(blob)
        try:
            inspect_drafter(ckpt)
            outcomes["inspected"] += 1  # a mutation that left a readable file (a flipped byte inside a name)
        except (ValueError, OSError) as err:
            assert str(err), f"case {i}: an empty message"
            outcomes["refused"] += 1
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert outcomes["refused"] >= 250 and grown_mib < 200, (outcomes, grown_mib)


def test_fuzzed_shard_headers_are_reported_by_verify_not_raised(tmp_path, random_target_dir):
    from run_fixtures import extract, write_tokenized

    from eyas.config import ExtractConfig
    from eyas.facts import facts_for
    from eyas.verify.shard_set import expected_shard_meta, verify_shards

    rng = random.Random(2)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 20))] for _ in range(6)]
    tokenized = write_tokenized(tmp_path / "tokenized.parquet", samples)
    shards = tmp_path / "shards"
    extract(tokenized, shards, random_target_dir, ExtractConfig(shard_bytes=1 << 16, batch_size=4))
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=shards)
    expected = expected_shard_meta(facts, "float32")
    first = sorted(shards.glob("shard-*.safetensors"))[0]
    valid = first.read_bytes()
    for i, blob in enumerate(mutations(valid, rng, 140)):
        first.write_bytes(blob)
        report = verify_shards(shards_dir=shards, tokenized_path=tokenized, expected=expected, mode="cheap")
        assert blob == valid or report.bad_files == [first.name], (i, report.bad_files, report.problems)
    first.write_bytes(valid)


# ---- nothing lost -----------------------------------------------------------------------------------------


def test_a_refused_config_leaves_a_finished_run_as_it_was(tmp_path):
    run = write_tiny_run(tmp_path / "run")
    root = tmp_path / "run"
    write_checkpoint(root / "train" / "step-00000010")
    before = {p: checksum_file(p) for p in root.rglob("*") if p.is_file()}
    assert len(before) > 5

    def edit(c):
        c["workdir"] = str(root)
        c["extract"]["shard_bytes"] = "big"

    path = bad_config(tmp_path, edit)
    for verb in ("run", "dataset", "extract", "verify", "train", "export", "bench"):
        refused(eyas(verb, path), "extract.shard_bytes: found 'big', expected an integer")
    assert {p: checksum_file(p) for p in root.rglob("*") if p.is_file()} == before
    assert run
