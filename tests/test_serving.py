"""eyas.export.serving's table against SGLang's own code: the draft model source (`sglang/srt/models/
llama_eagle3.py`, LlamaForCausalLMEagle3) read from the release wheels of kits/sglang-wheels.txt."""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

import pytest

from eyas.engines.sglang import parse_version
from eyas.export.serving import ENGINES, SGLANG_LAYERS0_SINCE, SGLANG_OPTION_SINCE, sglang_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from kits import require_kit  # noqa: E402

DRAFT_SOURCE = "sglang/srt/models/llama_eagle3.py"


def wheels() -> dict[str, Path]:
    return {p.name.split("-")[1]: p for p in sorted(require_kit("sglang-wheels").glob("sglang-*.whl"))}


def config_reads(tree: ast.AST) -> set[str]:
    """The config keys the draft model reads: getattr(config, "k", ...) and eagle_config.get("k", ...)."""
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            is_getattr = isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2
            is_get = isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            arg = node.args[1] if is_getattr else node.args[0] if is_get else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                keys.add(arg.value)
    return keys


def renames_midlayer(tree: ast.AST) -> bool:
    """load_weights maps checkpoint names "midlayer" -> "layers.0" (the legacy_name_map of 0.5.12+)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            pairs = {
                (k.value, v.value)
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
            }
            if ("midlayer", "layers.0") in pairs:
                return True
    return False


@pytest.mark.parametrize("version", ["0.5.10", "0.5.11", "0.5.12", "0.5.16", "0.5.17", "0.5.23"])
def test_the_serving_table_is_what_each_sglang_release_runs(version):
    source = zipfile.ZipFile(wheels()[version]).read(DRAFT_SOURCE).decode()
    tree = ast.parse(source)
    reads = config_reads(tree)
    found = {option for option in SGLANG_OPTION_SINCE if option in reads}
    if "use_aux_norm" in reads:  # the legacy name of fc_norm
        found.add("fc_norm")
    assert found == set(sglang_options(version)), version
    assert renames_midlayer(tree) == (parse_version(version) >= parse_version(SGLANG_LAYERS0_SINCE)), version
    if "norm_output" in found:  # what norm_output switches: the state handed to the next draft step
        assert "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux" in source


def test_the_engine_rows_follow_the_table():
    assert ENGINES["sglang<=0.5.11"].options == sglang_options("0.5.11") == ()
    assert ENGINES["sglang>=0.5.12"].options == sglang_options("0.5.16") == ("fc_norm", "norm_output")
    assert ENGINES["sglang>=0.5.17"].options == sglang_options("0.5.23")
    assert "sglang-0.5.12" not in ENGINES["sglang<=0.5.11"].formats
