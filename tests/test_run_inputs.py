"""Mistakes a user can foresee are refused when the run's facts are resolved, before the first expensive step
(eyas.run_inputs), each as one user error naming the object, what was expected, what was found and the fix.

| input (on the tiny preset) | stages | exit | message (key words) |
|---|---|---|---|
| bench.prompts_path missing | all | 2 | `bench.prompts_path=...: no such file, expected held-out prompts JSONL` |
| bench.prompts_path a directory | bench | 2 | `a directory, expected held-out prompts JSONL (a file)` |
| bench prompts not JSON | bench | 2 | `bench.prompts_path=...`, `heldout.jsonl:1: not a JSON object` |
| dataset.prompts_path missing / a directory | dataset | 2 | `dataset.prompts_path=...: no such file` / `a directory` |
| dataset prompts with invalid UTF-8 | dataset | 2 | `:2: not UTF-8 text`, `re-encode the file` |
| dataset prompts with a JSON list for a row | dataset | 2 | `:1: a JSON list, expected an object` |
| as_given, 24 of 25 conversations without an assistant turn | dataset | 2 | `24 of 25 conversations have no assistant turn`, `set dataset.responses='regenerate'` |
| regenerate, conversations without a user turn | dataset | 2 | `have no user turn` |
| dataset.draft_vocab_size 4096 over a 2048-token target | all | 2 | `larger than the target's vocab of 2048 tokens` |
| train.num_processes 64, gloo, 2 usable cores | train | 2 | `train.num_processes=64 ... 2 CPU core(s) ... lower train.num_processes to 2` |
| train.num_processes 8, nccl, torch sees 2 GPUs / none | train | 2 | `torch sees 2 GPU(s)` / `no CUDA device is visible` |
| workdir is a file, or under one | all | 2 | `workdir=...: a file (... on the way is a file), expected a directory` |
| workdir/dataset is a file | all | 2 | `.../dataset is a file, expected the directory a stage writes its outputs in` |
| target.model_path missing / a file / without config.json | all | 2 | `no such directory` / `a file` / `no config.json` |
| sglang.python missing with bench.engine sglang | bench | 2 | `sglang.python=...: no such file` |
| train alone: no vocab mapping / one of other sizes | train | 2 | `run \\`eyas dataset CONFIG\\`` |
| train.checkpoint_copy_url under a file | train | 2 | `train.checkpoint_copy_url=...: a file` |
| three mistakes at once | all | 2 | `3 problem(s)`, each one |

Exit 2 is what the `eyas` command gives the error (eyas_cli.errors.guarded, one message). The flows refuse the
same inputs at their start: the pipeline before its dataset subflow starts (no regeneration, no trainer), the
dataset, training and benchmark flows run alone before their own work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_fixtures import REPO

from eyas.config import load_run_config
from eyas.run_inputs import STAGES, RunInputError, check_run_inputs
from eyas_cli.errors import EXIT_BAD_INPUT, guarded, user_error_types

PRESET = REPO / "deployments" / "tiny-cpu.json"
TARGET = REPO / "fixtures" / "tiny-target"


def tiny(tmp_path: Path, **sections):
    """The tiny preset with its workdir under tmp_path, absolute paths, and `sections` updated field by field."""
    config = load_run_config(PRESET)
    config = config.model_copy(
        update={
            "workdir": str(tmp_path / "run"),
            "target": config.target.model_copy(update={"model_path": str(TARGET)}),
            "dataset": config.dataset.model_copy(update={"prompts_path": str(TARGET / "prompts.jsonl")}),
            "bench": config.bench.model_copy(update={"prompts_path": str(TARGET / "heldout_prompts.jsonl")}),
        }
    )
    updates = {name: getattr(config, name).model_copy(update=fields) for name, fields in sections.items()}
    return config.model_copy(update=updates)


def conversations(path: Path, with_assistant: int, without: int) -> Path:
    """`with_assistant` conversations that have an answer, then `without` that have only the user's turn."""
    user = {"role": "user", "content": "def add(a, b):"}
    rows = [[user, {"role": "assistant", "content": "    return a + b"}]] * with_assistant + [[user]] * without
    path.write_text("".join(json.dumps({"id": f"c{i}", "conversations": r}) + "\n" for i, r in enumerate(rows)))
    return path


def gpus(n: int, cuda: str | None = "13.0") -> dict:
    """eyas.train.devices' query with `n` idle H200s (or a CPU-only torch when cuda is None)."""
    rows = [{"device": f"cuda:{i}", "name": "NVIDIA H200", "capability": "9.0", "bf16": True,
             "memory_total_mib": 143771, "memory_free_mib": 143000, "memory_used_mib": 771} for i in range(n)]  # fmt: skip
    return {"cuda_visible_devices": None, "torch": "2.11.0", "cuda": cuda, "cuda_available": bool(n),
            "unavailable_reason": "", "nccl_available": bool(cuda), "nccl_version": "2.27.7", "devices": rows,
            "device_errors": {}}  # fmt: skip


def _missing_bench(t):
    return tiny(t, bench={"prompts_path": str(t / "heldout.jsonl")})


def _dir_bench(t):
    return tiny(t, bench={"prompts_path": str(t)})


def _not_json_bench(t):
    (t / "heldout.jsonl").write_text("id,prompt\n1,hello\n")
    return tiny(t, bench={"prompts_path": str(t / "heldout.jsonl")})


def _missing_prompts(t):
    return tiny(t, dataset={"prompts_path": str(t / "chats.jsonl")})


def _dir_prompts(t):
    return tiny(t, dataset={"prompts_path": str(t)})


def _latin1_prompts(t):
    good = conversations(t / "good.jsonl", 1, 0).read_bytes()
    (t / "chats.jsonl").write_bytes(
        good + '{"id": "x", "conversations": [{"role": "user", "content": "café"}]}\n'.encode("latin-1")
    )
    return tiny(t, dataset={"prompts_path": str(t / "chats.jsonl")})


def _list_row(t):
    (t / "chats.jsonl").write_text('[{"role": "user", "content": "hi"}]\n')
    return tiny(t, dataset={"prompts_path": str(t / "chats.jsonl")})


def _as_given_without_answers(t):
    return tiny(t, dataset={"prompts_path": str(conversations(t / "chats.jsonl", 1, 24)), "responses": "as_given"})


def _regenerate_without_user_turns(t):
    rows = [{"id": f"a{i}", "conversations": [{"role": "system", "content": "be brief"}]} for i in range(3)]
    (t / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tiny(t, dataset={"prompts_path": str(t / "chats.jsonl")})


def _vocab_too_large(t):
    return tiny(t, dataset={"draft_vocab_size": 4096})


def _gloo_64(t):
    return tiny(t, train={"num_processes": 64})


def _nccl_8(t):
    return tiny(t, train={"num_processes": 8, "backend": "nccl"})


def _workdir_file(t):
    (t / "afile").write_text("x")
    return tiny(t).model_copy(update={"workdir": str(t / "afile")})


def _workdir_under_file(t):
    (t / "afile").write_text("x")
    return tiny(t).model_copy(update={"workdir": str(t / "afile" / "run")})


def _stage_dir_file(t):
    config = tiny(t)
    config.paths.root.mkdir(parents=True)
    config.paths.dataset_dir.write_text("x")
    return config


def _target_missing(t):
    return tiny(t, target={"model_path": str(t / "no-target")})


def _target_file(t):
    return tiny(t, target={"model_path": str(TARGET / "config.json")})


def _target_without_config(t):
    (t / "target").mkdir()
    return tiny(t, target={"model_path": str(t / "target")})


def _sglang_python_missing(t):
    return tiny(t, bench={"engine": "sglang"}, sglang={"python": "/opt/no-sglang/bin/python"})


def _train_without_vocab(t):
    return tiny(t)


def _train_with_other_vocab(t):
    import torch

    from eyas.dataset.vocab import build_vocab_mapping, save_vocab

    config = tiny(t)
    config.paths.dataset_dir.mkdir(parents=True)
    save_vocab(config.paths.vocab, *build_vocab_mapping(torch.ones(2048, dtype=torch.int64), 512), "d5e7")
    return config


def _copy_under_file(t):
    (t / "afile").write_text("x")
    return tiny(t, train={"checkpoint_copy_url": str(t / "afile" / "copies")})


def _three_at_once(t):
    return tiny(t, bench={"prompts_path": str(t / "heldout.jsonl")}, dataset={"draft_vocab_size": 4096},
                train={"num_processes": 64})  # fmt: skip


# (id, config maker, stages, device query, words of the message)
TABLE = [
    ("bench prompts missing", _missing_bench, STAGES, None,
     ["bench.prompts_path=", "heldout.jsonl'", "no such file, expected held-out prompts JSONL; fix the path"]),
    ("bench prompts a directory", _dir_bench, ["bench"], None,
     ["bench.prompts_path=", "a directory, expected held-out prompts JSONL (a file); name the file itself"]),
    ("bench prompts not JSON", _not_json_bench, ["bench"], None,
     ["bench.prompts_path=", "heldout.jsonl:1: not a JSON object", "expected one prompt row a line"]),
    ("prompts missing", _missing_prompts, ["dataset"], None,
     ["dataset.prompts_path=", "chats.jsonl'", "no such file, expected JSONL or Parquet of conversations"]),
    ("prompts a directory", _dir_prompts, ["dataset"], None, ["dataset.prompts_path=", "a directory, expected JSONL"]),
    ("prompts not UTF-8", _latin1_prompts, ["dataset"], None,
     ["dataset.prompts_path=", "chats.jsonl:2: not UTF-8 text", "expected JSONL in UTF-8: re-encode the file"]),
    ("a row that is a list", _list_row, ["dataset"], None,
     ["chats.jsonl:1: a JSON list, expected an object (one conversation a line)"]),
    ("as_given without answers", _as_given_without_answers, ["dataset"], None,
     ["dataset.prompts_path=", "24 of 25 conversations have no assistant turn", "dataset.max_empty_mask_fraction=0.05",
      "set dataset.responses='regenerate' to have the target write them"]),
    ("regenerate without user turns", _regenerate_without_user_turns, ["dataset"], None,
     ["3 of 3 conversations have no user turn", "give each conversation a user turn, or remove those rows"]),
    ("draft vocab over the target's", _vocab_too_large, STAGES, None,
     ["dataset.draft_vocab_size=4096: larger than the target's vocab of 2048 tokens", "expected at most 2048",
      "lower dataset.draft_vocab_size"]),
    ("64 gloo processes on 2 cores", _gloo_64, ["train"], None,
     ["train.num_processes=64 with train.backend='gloo' starts 64 trainer processes, but this process may use 2 CPU "
      "core(s); expected at most one process per core", "lower train.num_processes to 2 or fewer"]),
    ("8 nccl processes on 2 GPUs", _nccl_8, ["train"], gpus(2),
     ["train.num_processes=8 but torch sees 2 GPU(s)", "lower train.num_processes"]),
    ("nccl on a CPU-only torch", _nccl_8, ["train"], gpus(0, cuda=None),
     ["no CUDA device is visible to torch", "or use train.backend='gloo' on CPU"]),
    ("workdir a file", _workdir_file, STAGES, None, ["workdir=", "afile': a file, expected a directory"]),
    ("workdir under a file", _workdir_under_file, STAGES, None, ["workdir=", "afile on the way is a file"]),
    ("a stage's folder in the workdir a file", _stage_dir_file, STAGES, None,
     ["workdir=", "run/dataset is a file, expected the directory a stage writes its outputs in"]),
    ("target missing", _target_missing, STAGES, None,
     ["target.model_path=", "no-target': no such directory, expected a Hugging Face model directory"]),
    ("target a file", _target_file, STAGES, None, ["target.model_path=", "config.json': a file, expected a Hugging"]),
    ("target without config.json", _target_without_config, STAGES, None, ["target.model_path=", "no config.json"]),
    ("sglang.python missing", _sglang_python_missing, ["bench"], None,
     ["sglang.python='/opt/no-sglang/bin/python': no such file, expected the interpreter of SGLang's environment"]),
    ("train alone without a vocab", _train_without_vocab, ["train"], None,
     ["vocab.safetensors: no such file", "run `eyas dataset CONFIG`"]),
    ("train alone on another vocab", _train_with_other_vocab, ["train"], None,
     ["vocab.safetensors: 512 draft ids over 2048 target ids, expected dataset.draft_vocab_size=1024",
      "run `eyas dataset CONFIG` to rebuild it"]),
    ("copy under a file", _copy_under_file, ["train"], None,
     ["train.checkpoint_copy_url=", "a file (", "expected a directory"]),
    ("three at once", _three_at_once, STAGES, None,
     ["3 problem(s) in the run's inputs", "- bench.prompts_path=", "- dataset.draft_vocab_size=4096",
      "- train.num_processes=64"]),
]  # fmt: skip


@pytest.fixture
def two_cores(monkeypatch):
    """This process may use 2 cores (eyas.train.devices.usable_cores), whatever the machine running the test."""
    monkeypatch.setattr("eyas.train.devices.usable_cores", lambda: 2)


@pytest.mark.usefixtures("two_cores")
@pytest.mark.parametrize(("make", "stages", "found", "words"), [row[1:] for row in TABLE], ids=[r[0] for r in TABLE])
def test_a_foreseeable_mistake_is_one_user_error_naming_the_fix(tmp_path, capsys, make, stages, found, words):
    config = make(tmp_path)
    with pytest.raises(RunInputError) as refused:
        check_run_inputs(config, stages, found=found)
    message = str(refused.value)
    for w in words:
        assert w in message, f"{w!r} not in:\n{message}"
    assert isinstance(refused.value, user_error_types())

    def command():
        raise refused.value

    assert guarded(command) == EXIT_BAD_INPUT  # what `eyas` answers: the message, exit 2, no traceback
    err = capsys.readouterr().err
    assert err.startswith("eyas: ") and "Traceback" not in err and words[0] in err


@pytest.mark.usefixtures("two_cores")
def test_the_tiny_preset_passes_and_says_what_it_looked_at(tmp_path):
    assert check_run_inputs(tiny(tmp_path), STAGES) == {
        "dataset": {"conversations": 638, "without_turn_to_train_on": 0},
        "processes": 2,
    }
    nccl = tiny(tmp_path, train={"num_processes": 2, "backend": "nccl"})
    assert check_run_inputs(nccl, STAGES, found=gpus(2))["processes"] == 2


def test_only_the_stages_that_run_are_checked(tmp_path):
    config = _missing_bench(tmp_path)
    assert check_run_inputs(config, ["dataset"])["dataset"]["conversations"] == 638  # no benchmark in this run
    as_given = tiny(tmp_path, dataset={"prompts_path": str(conversations(tmp_path / "c.jsonl", 24, 1)),
                                       "responses": "as_given", "max_empty_mask_fraction": 0.05})  # fmt: skip
    assert check_run_inputs(as_given, ["dataset"])["dataset"] == {"conversations": 25, "without_turn_to_train_on": 1}


# ---- the flows, as `eyas run` and the stage verbs run them ------------------------------------------------------


def _nothing_started(config, state) -> None:
    """Only the check ran: no subflow (no dataset stage, so no regeneration, no tokenizer or target loaded), and
    none of the stages' directories (the response log, shards, the trainer's output, the benchmark) exists."""
    from run_queries import run_tree

    assert run_tree(state.state_details.flow_run_id) == [state.state_details.flow_run_id]
    for stage_dir in ("dataset", "shards", "smoke", "train", "export", "bench"):
        assert not (config.paths.root / stage_dir).exists(), stage_dir


FLOW_TABLE = [
    ("pipeline, bench prompts missing", "pipeline", _missing_bench, "no such file, expected held-out prompts JSONL"),
    ("pipeline, draft vocab too large", "pipeline", _vocab_too_large, "larger than the target's vocab of 2048"),
    ("pipeline, 64 processes", "pipeline", _gloo_64, "train.num_processes=64 with train.backend='gloo'"),
    ("pipeline, as_given without answers", "pipeline", _as_given_without_answers, "24 of 25 conversations have no"),
    ("dataset alone, as_given without answers", "dataset", _as_given_without_answers, "24 of 25 conversations"),
    ("train alone, 64 processes", "train", _gloo_64, "train.num_processes=64"),
    ("bench alone, bench prompts missing", "bench", _missing_bench, "bench.prompts_path="),
]


@pytest.mark.usefixtures("flush_prefect_logs", "two_cores")
@pytest.mark.parametrize(("flow", "make", "words"), [r[1:] for r in FLOW_TABLE], ids=[r[0] for r in FLOW_TABLE])
def test_the_flow_refuses_it_before_anything_expensive_starts(prefect_server, tmp_path, flow, make, words):
    from flows.bench import bench_flow
    from flows.dataset import build_dataset_flow
    from flows.pipeline import pipeline
    from flows.train import train_flow

    run = {"pipeline": pipeline, "dataset": build_dataset_flow, "train": train_flow, "bench": bench_flow}[flow]
    config = make(tmp_path)
    state = run(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(RunInputError, match="found before any stage started its work") as refused:
        state.result()
    assert words in str(refused.value)
    _nothing_started(config, state)
