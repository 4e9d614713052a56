"""`eyas remap SRC DST --to FORMAT`: convert a drafter between checkpoint formats through the eyas form.

    from eyas.export.remap import remap_checkpoint
    remap_checkpoint("hub/speculators-eagle3", "out/sglang", to="sglang")
    remap_checkpoint("hub/eagle31", "out/sglang", to="sglang", sglang_version="0.5.23")   # draft options
    remap_checkpoint("out/sglang", "out/eyas", to="eyas", embed_from="target/model.safetensors")
    remap_checkpoint("out/sglang", "out/eyas", to="eyas", embed_from="kimi-k2.5/")   # the target's directory

The source is read by eyas.export.reader (producer and format detected, config read with every problem an
error, keys checked against the exact expected set), then written in the destination format and checked
against that one's exact set; a draft option the destination does not run is refused, naming the first
SGLang version that does. Formats that drop embed_tokens need `embed_from` to produce one that keeps it: a
safetensors file with `embed_tokens.weight`, `model.embed_tokens.weight` or a wrapper's
`language_model.model.embed_tokens.weight` (Kimi-K2.5), or the target's directory (the file among its shards
that holds the text model's embedding). A source whose layer ids are not in its config (eagle format,
speculators with null ids) needs `num_target_layers`.
"""

from __future__ import annotations

from pathlib import Path

from eyas.export.configs import TargetRef
from eyas.export.convert import EXPORT_DTYPES, convert_checkpoint
from eyas.export.drafter_dir import ExportError, write_export_dir
from eyas.export.inspect import layer_range_problems
from eyas.export.reader import read_drafter
from eyas.target import EMBED_KEY, find_weight


def remap_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    to: str,
    dtype: str | None = None,
    embed_from: str | Path | None = None,
    num_target_layers: int | None = None,
    sglang_version: str | None = None,
    target: str | Path | None = None,
) -> Path:
    """Convert the drafter in src to format `to` in dst (replaced atomically); returns dst. `target` (the
    target model's directory or config.json) gives its layer count and the numbering SGLang reads its ids in."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ExportError(f"remap dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    ref = TargetRef.read(target) if target is not None else None
    num_target_layers = num_target_layers or (ref.num_layers if ref else None)
    architectures = list(ref.architectures) if ref else None
    _, ckpt = read_drafter(
        src,
        embed_from=None if embed_from is None else embedding_file(embed_from),
        num_target_layers=num_target_layers,
        target_architectures=architectures,
    )
    problems = layer_range_problems(to, ckpt.aux_layer_ids, num_target_layers)
    if problems:
        raise ExportError(f"{src}: " + "; ".join(problems))
    tensors, files = convert_checkpoint(ckpt, to, dtype, sglang_version=sglang_version, target=ref)
    return write_export_dir(Path(dst), tensors, files)


def embedding_file(embed_from: str | Path) -> Path:
    """The weights file `embed_from` names: itself, or for a target's directory the shard holding its text
    model's input embedding (read from the weight headers)."""
    path = Path(embed_from)
    if not path.is_dir():
        return path
    found = find_weight(path, EMBED_KEY.removeprefix("model."))
    if found is None:
        raise ExportError(
            f"embed_from {path}: a directory whose *.safetensors hold no *embed_tokens.weight; expected the target's "
            "model directory or the weights file that holds its input embedding"
        )
    return found[0]
