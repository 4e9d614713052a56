"""What every section of the configuration shares: the strict base model, the dtypes, renamed fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

DType = Literal["float32", "bfloat16", "float16"]


# Config keys renamed (old name -> new name): a preset still using an old name is refused with the new one.
RENAMED_FIELDS: dict[str, dict[str, str]] = {
    "train": {
        "ttt_steps": "num_ttt_steps",
        "warmup_steps": "num_warmup_steps",
        "keep_last_checkpoints": "num_checkpoints_kept",
    },
    "bench": {"steps": "num_steps"},
}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _refuse_renamed(section: str, data):
    """A before-validator body: refuse the section's old field names, naming the new ones."""
    if isinstance(data, dict):
        old = sorted(set(data) & set(RENAMED_FIELDS[section]))
        if old:
            renames = ", ".join(f"{section}.{o} is now {section}.{RENAMED_FIELDS[section][o]}" for o in old)
            raise ValueError(f"renamed config fields: {renames}; rename them in the preset (same meaning and value)")
    return data


def _refuse_derived_flags(where: str, args: list[str]) -> None:
    """Launch flags eyas derives for every SGLang server are not extra_args: one setting, every server."""
    if any(a.split("=")[0] == "--trust-remote-code" for a in args):
        raise ValueError(
            f"{where}: --trust-remote-code comes from target.trust_remote_code for every SGLang server eyas starts; "
            "remove it and set target.trust_remote_code"
        )
