"""eyas.export.serving's table against SGLang's own code: the draft model source (`sglang/srt/models/
llama_eagle3.py`, LlamaForCausalLMEagle3) read from the release wheels of kits/sglang-wheels.txt."""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

import pytest

from eyas.engines.sglang import parse_version
from eyas.export.serving import (
    ENGINES,
    SGLANG_ANY_NUM_AUX_SINCE,
    SGLANG_LAYERS0_SINCE,
    SGLANG_NUM_LAYERS_SINCE,
    SGLANG_OLDEST,
    SGLANG_OPTION_SINCE,
    sglang_options,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from kits import lock_file, require_kit  # noqa: E402

DRAFT_SOURCE = "sglang/srt/models/llama_eagle3.py"


def kit_releases() -> list[str]:
    """The SGLang releases kits/sglang-wheels.txt pins (`sglang==X --hash=...`), oldest first."""
    lines = (line.split()[0] for line in lock_file("sglang-wheels").read_text().splitlines() if line.strip())
    return sorted((line.split("==")[1] for line in lines if line.startswith("sglang==")), key=parse_version)


RELEASES = kit_releases()


def wheels() -> dict[str, Path]:
    return {p.name.split("-")[1]: p for p in sorted(require_kit("sglang-wheels").glob("sglang-*.whl"))}


def draft_source(version: str) -> str:
    return zipfile.ZipFile(wheels()[version]).read(DRAFT_SOURCE).decode()


def method(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef:
    """The (first) definition of method `name` in class `cls` of the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"no {cls}.{name} in {DRAFT_SOURCE}")


def assigned(func: ast.AST) -> dict[str, str]:
    """Each `target = value` in `func`, both as source text (the last assignment of a target wins)."""
    return {
        ast.unparse(target): ast.unparse(node.value)
        for node in ast.walk(func)
        if isinstance(node, ast.Assign)
        for target in node.targets
    }


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


def refuses_layer_counts(tree: ast.AST) -> bool:
    """`if self.config.num_hidden_layers != 1: raise ValueError("EAGLE3 currently only supports 1 layer")`."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and ast.unparse(node.test).endswith("config.num_hidden_layers != 1")
            and any(
                isinstance(stmt, ast.Raise)
                and "ValueError('EAGLE3 currently only supports 1 layer')" in ast.unparse(stmt)
                for stmt in node.body
            )
        ):
            return True
    return False


def builds_num_hidden_layers(tree: ast.AST) -> bool:
    """LlamaModel builds `self.layers = nn.ModuleList([LlamaDecoderLayer(config, i, ...) for i in
    range(config.num_hidden_layers)])` and its forward runs every one of them (`for layer in self.layers`)."""
    built = assigned(method(tree, "LlamaModel", "__init__")).get("self.layers", "")
    forward = method(tree, "LlamaModel", "forward")
    runs_each = any(isinstance(node, ast.For) and ast.unparse(node.iter) == "self.layers" for node in ast.walk(forward))
    return built.startswith("nn.ModuleList([LlamaDecoderLayer(config, i, ") and (
        built.endswith(" for i in range(config.num_hidden_layers)])") and runs_each
    )


def qkv_width(tree: ast.AST) -> str:
    """The input width of the draft layer's qkv_proj, as source text: "2H" for every layer, "2H at layer 0, H
    after" for the input-layer rule (`is_input_layer = layer_id == 0`), else the text itself."""
    init = method(tree, "LlamaDecoderLayer", "__init__")
    names = assigned(init)
    width = names["self.self_attn.qkv_proj"].removeprefix("QKVParallelLinear(").split(",")[0]
    if width == "2 * self.hidden_size":
        return "2H"
    if (
        width == "hidden_size"
        and names.get("hidden_size") == "2 * self.hidden_size if self.is_input_layer else self.hidden_size"
        and names.get("self.is_input_layer") == "layer_id == 0"
    ):
        return "2H at layer 0, H after"
    return width


@pytest.mark.parametrize("version", RELEASES)
def test_the_serving_table_is_what_each_sglang_release_runs(version):
    source = draft_source(version)
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


def test_the_kit_holds_every_release_the_tables_were_checked_in():
    assert set(wheels()) == set(RELEASES)
    assert RELEASES[0] == SGLANG_OLDEST
    # the releases the table's issue asked to be read, beside those before and at each change
    assert {"0.5.11", "0.5.12", "0.5.14", "0.5.16", "0.5.17", "0.5.22", "0.5.23"} <= set(RELEASES)


@pytest.mark.parametrize("version", RELEASES)
def test_sglang_builds_num_hidden_layers_draft_layers_from_the_release_the_table_says(version):
    tree = ast.parse(draft_source(version))
    builds = parse_version(version) >= parse_version(SGLANG_NUM_LAYERS_SINCE)
    assert refuses_layer_counts(tree) == (not builds), version
    assert builds_num_hidden_layers(tree) == builds, version
    # layer 0 takes [embeds, hidden] (2H) and later layers the previous layer's H; before, one 2H midlayer
    assert qkv_width(tree) == ("2H at layer 0, H after" if builds else "2H"), version
    if not builds:
        assert assigned(method(tree, "LlamaModel", "__init__"))["self.midlayer"].startswith(
            "LlamaDecoderLayer(config, 0, "
        ), version


@pytest.mark.parametrize("version", RELEASES)
def test_sglang_sizes_fc_by_num_aux_from_the_release_the_table_says(version):
    fc = assigned(method(ast.parse(draft_source(version)), "LlamaModel", "__init__"))["self.fc"]
    any_num_aux = parse_version(version) >= parse_version(SGLANG_ANY_NUM_AUX_SINCE)
    width = "self.hidden_size_in * self.num_aux_hidden_states" if any_num_aux else "self.hidden_size_in * 3"
    assert fc.startswith(f"torch.nn.Linear({width}, "), (version, fc)
