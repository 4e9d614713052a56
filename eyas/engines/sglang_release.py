"""The SGLang releases eyas has checked, and the errors every SGLang module raises: imported by the server's
lifecycle (eyas.engines.sglang) and by the check of SGLang's interpreter (eyas.engines.sglang_env) alike."""

from __future__ import annotations

import re
from typing import Sequence

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
