"""The trainer's metric file (eyas.train.metrics): a line a kill cut short is reported and cut, so appends go on
from a clean line; records lost before the checkpoint a run resumes from are reported as a gap; each record holds
the step's wait for its input, which TensorBoard shows too."""

from __future__ import annotations

import json

from run_fixtures import run_trainer, tiny_job, write_tiny_run

from eyas.train.metrics import METRICS_FILE, emit_metrics, read_metrics, scan_metrics, truncate_metrics


def write_records(out, steps, tail: str = "") -> None:
    (out / METRICS_FILE).write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps) + tail)


def test_torn_last_line_is_reported_and_cut_and_appends_go_on_clean(tmp_path, capsys):
    write_records(tmp_path, [1, 2, 3], tail='{"step": 4, "lo')
    assert truncate_metrics(tmp_path, 3) == 0
    out = capsys.readouterr().out
    assert f'{tmp_path / METRICS_FILE} line 4: not a metric record (15 characters: \'{{"step": 4, "lo\'), cut' in out
    emit_metrics({"step": 4, "loss": 0.25}, tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3, 4]
    assert scan_metrics(tmp_path / METRICS_FILE)[1] == []


def test_torn_line_inside_the_file_is_reported_and_cut(tmp_path, capsys):
    """Records appended after a torn write glue onto its line: both are gone, and that is said."""
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n{"step": 2, "lo{"step": 3}\n{"step": 4}\n')
    truncate_metrics(tmp_path, 4)
    assert "line 2: not a metric record" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 4]


def test_records_missing_before_the_resumed_checkpoint_are_reported(tmp_path, capsys):
    write_records(tmp_path, [1, 2, 3, 4, 5, 6])
    (tmp_path / METRICS_FILE).write_bytes((tmp_path / METRICS_FILE).read_bytes()[:40])  # cut by hand
    truncate_metrics(tmp_path, 6)
    out = capsys.readouterr().out
    assert "records end at step 1 but the run resumes from step 6: steps 2-6 have no records" in out
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1]


def test_steps_after_the_checkpoint_are_dropped_without_a_report(tmp_path, capsys):
    write_records(tmp_path, [1, 2, 3, 4])
    assert truncate_metrics(tmp_path, 2) == 2
    assert capsys.readouterr().out == ""
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]


def test_read_metrics_reports_the_line_it_leaves_out(tmp_path, capsys):
    write_records(tmp_path, [1, 2], tail='{"step": 3')
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]
    assert "line 3: not a metric record (10 characters: '{\"step\": 3'), left out" in capsys.readouterr().out


def test_trainer_started_over_a_torn_metric_file_says_so_and_appends_on_a_clean_line(tmp_path):
    """A run killed before its first checkpoint, in the middle of writing a record: the re-run starts from step 0,
    reports the torn line it cuts, and its records follow on clean lines."""
    run = write_tiny_run(tmp_path / "run", num_samples=16)
    out = tmp_path / "out"
    out.mkdir()
    write_records(out, [1], tail='{"step": 2, "loss": 0.')
    job = tiny_job(run, out, num_processes=1, global_batch_size=4, max_steps=3, save_every_steps=3)
    job_path = tmp_path / "job.json"
    job_path.write_text(job.model_dump_json())
    stdout, metrics = run_trainer(job_path, None)
    assert f"{out / METRICS_FILE} line 2: not a metric record (22 characters" in stdout
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [1, 2, 3]
    assert scan_metrics(out / METRICS_FILE)[1] == []
    assert all(r["data_wait_s"] >= 0 and 0 <= r["data_stall_fraction"] <= 1 for r in metrics)


def test_tensorboard_shows_the_steps_wait_for_its_input(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from eyas.train.tensorboard import TB_DIR, TensorBoardLog

    log = TensorBoardLog(tmp_path, resumed_step=0)
    for step in (1, 2):
        log.add({"step": step, "loss": 1.0, "loss_k": [1.0], "acc_k": [0.5], "lr": 1e-3, "grad_norm": 1.0,
                 "data_wait_s": 0.25 * step, "data_stall_fraction": 0.125 * step})  # fmt: skip
    log.close()
    events = EventAccumulator(str(tmp_path / TB_DIR))
    events.Reload()
    assert [e.value for e in events.Scalars("train/data_wait_s")] == [0.25, 0.5]
    assert [e.value for e in events.Scalars("train/data_stall_fraction")] == [0.125, 0.25]
