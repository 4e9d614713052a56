"""The configuration code a Kimi-K2.5 checkpoint ships, for config-only Kimi targets that run with remote code.

    target = with_remote_config(write_target(tmp / "kimi", "kimi-k2.5"), tmp / "kimi-remote")

moonshotai/Kimi-K2.5's config.json maps AutoConfig to `configuration_kimi_k25.KimiK25Config` (auto_map), and the
checkpoint holds that file: with trust_remote_code, transformers (and SGLang's get_config, which calls it) loads
the config through it. CONFIGURATION is that class narrowed to what it does with the fields eyas's fixture
writes: a `kimi_k25` PretrainedConfig whose text_config becomes a DeepseekV3Config (as the published file and
SGLang's copy of it, sglang/srt/configs/kimi_k25.py, build it), the vision config kept as given.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CONFIGURATION = """\
from transformers import DeepseekV3Config
from transformers.configuration_utils import PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, ignore_index=-100, media_placeholder_token_id=163605,
                 pad_token_id=0, **kwargs):
        if text_config is None or isinstance(text_config, dict):
            text_config = DeepseekV3Config(**(text_config or {}))
        self.text_config = text_config
        self.vision_config = vision_config or {}
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(pad_token_id=pad_token_id, **kwargs)
"""


def with_remote_config(target: Path, out: Path) -> Path:
    """A copy of the config-only Kimi target `target` at `out` with its configuration_kimi_k25.py."""
    shutil.copytree(target, out)
    (out / "configuration_kimi_k25.py").write_text(CONFIGURATION)
    return out
