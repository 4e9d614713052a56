"""`eyas engine-command CONFIG --stage generate|extract|bench|baseline [--json]`: the SGLang server a stage starts.

    $ eyas engine-command deployments/kimi-k25-8gpu.json --stage extract
    /opt/sglang/bin/python -m sglang.launch_server --model-path /mnt/eyas/models/Kimi-K2.5 --host 127.0.0.1 \
        --port 30000 --trust-remote-code --tp-size 8 ...

The argv is the one the stage builds (eyas.dataset.build.generation_launch for the dataset stage's
regeneration, eyas.extract.backends.sglang.build_extract_command for extraction,
eyas.bench.sglang.bench_launch for the benchmark and its baseline), so a server started by hand with it
passes the stage's checks: its interpreter is `sglang.python` (SGLang's own environment; the one running eyas
when that is empty), and `--trust-remote-code` is there when target.trust_remote_code is. For extraction the
capture folder is extract.sglang.capture_dir, or RUN/extract/sglang-capture when that is empty; it must be one
folder for the server and eyas.
"""

from __future__ import annotations

from pathlib import Path

ENGINE_STAGES = ("generate", "extract", "bench", "baseline")
DEFAULT_CAPTURE = Path("extract") / "sglang-capture"


def engine_command(config, stage: str) -> list[str]:
    """argv of the SGLang server `stage` of this run starts."""
    from eyas.engines.sglang import build_launch_command, engine_python

    if stage == "generate":
        from eyas.dataset.build import generation_launch

        return build_launch_command(generation_launch(config))
    if stage == "extract":
        from eyas.extract.backends.sglang import build_extract_command
        from eyas.layer_ids import resolve_aux_layer_ids
        from eyas.target import target_dims

        cfg = config.extract.sglang
        num_layers, _ = target_dims(config.target.model_path)
        return build_extract_command(
            cfg,
            target_path=config.target.model_path,
            aux_layer_ids=resolve_aux_layer_ids(config.target.aux_layer_ids, num_layers),
            capture_dir=str(Path(cfg.capture_dir or config.paths.root / DEFAULT_CAPTURE).resolve()),
            python=engine_python(config.sglang.python),
            trust_remote_code=config.target.trust_remote_code,
            allowed_versions=config.sglang.allow_unchecked_versions,
        )
    if stage in ("bench", "baseline"):
        from eyas.bench.sglang import bench_launch
        from eyas.export.convert import SGLANG_EXPORT

        launch = bench_launch(config, config.paths.export_dir / SGLANG_EXPORT)
        return build_launch_command(launch if stage == "bench" else launch.baseline())
    raise ValueError(f"engine-command --stage {stage!r}: expected one of {ENGINE_STAGES}")
