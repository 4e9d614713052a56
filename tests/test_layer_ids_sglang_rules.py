"""eyas/sglang_layer_rules.py against SGLang's own source: re-derived from every release wheel of
kits/sglang-wheels.txt by scripts/sglang_layer_rules.py (EntryClass, class inheritance, the bodies of
set_eagle3_layers_to_capture), so a new release in kits/ or a changed rule cannot go unchecked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eyas import sglang_layer_rules as table
from eyas.layer_ids import SGLANG_RULES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sglang_layer_rules as derivation  # noqa: E402
import sglang_source  # noqa: E402

from kits import lock_file  # noqa: E402


@pytest.fixture(scope="module")
def derived():
    return derivation.derive()


def test_the_table_covers_exactly_the_releases_and_wheels_of_the_kit():
    pins = {v: h for v, (_, h) in derivation.kit_wheels().items()}
    assert table.RELEASES == tuple(pins) and table.WHEEL_SHA256 == pins
    lines = lock_file("sglang-0.5.23").read_text().splitlines()
    installed = next(line for line in lines if line.startswith("sglang=="))
    assert installed.endswith(f"--hash=sha256:{table.WHEEL_SHA256['0.5.23']}")  # the kit tests import is that wheel


def test_rederiving_from_the_kit_gives_the_committed_table(derived):
    assert derivation.render(derived) == derivation.OUTPUT.read_text(), (
        "eyas/sglang_layer_rules.py differs from SGLang's source: run `python scripts/sglang_layer_rules.py`"
    )


def test_every_rule_the_source_shows_is_one_eyas_implements_or_refuses(derived):
    rules = {rule for release in derived.values() for rule in release.values()}
    unknown = {r for r in rules if r not in SGLANG_RULES and r != "none" and not r.startswith("unresolved: ")}
    assert not unknown, f"rules eyas has no convention for: {unknown}; add them to eyas.layer_ids.SGLANG_RULES"
    for name, (captures, _) in SGLANG_RULES.items():  # eyas's copy captures what the derivation's rule does
        for n in derivation.PROBE_LAYERS:
            for ids in derivation.probes(n):
                assert captures(list(ids), n) == derivation.RULES[name](list(ids), n), (name, ids, n)


def test_the_classes_read_from_sglangs_source(derived):
    newest = derived["0.5.23"]
    assert newest["MistralLarge3ForCausalLM"] == "plus_one_if_first_is_1"  # inherits DeepseekV3ForCausalLM's method
    assert newest["KimiK25ForConditionalGeneration"] == "plus_one_if_first_is_1"  # its language_model's rule
    assert newest["Llama4ForConditionalGeneration"] == newest["Gemma3ForConditionalGeneration"] == "plus_one"
    assert newest["Cosmos3ForConditionalGeneration"] == "plus_one"  # __init__'s language_model_cls default
    assert newest["GptOssForCausalLM"] == "plus_one_unless_last_is_n"
    assert newest["TransformersForCausalLM"] == "none"  # the fallback for classes SGLang does not register
    assert derived["0.5.12"]["DeepseekV3ForCausalLM"] == "plus_one"  # deepseek_v2.py: "we plus 1 here"
    assert derived["0.5.14"]["DeepseekV3ForCausalLM"] == "plus_one_if_first_is_1"


def test_a_module_cut_into_statements_reads_as_the_whole_module_parsed():
    source = '''"""Docstring.
class NotAClass(Base):
    pass
"""
from typing import (
    List,
)

X = [
1, 2,
]


@decorator
class A(
    Base,
):
    value = """
class B(Other):
"""

    def f(self):
        return 1
else_name = A
if True:
    class C(A):
        pass
'''
    cut = sglang_source._statements(source)
    assert cut is None  # `1, 2,` at column 0 inside the brackets: the cut is not certain, the module is parsed whole
    whole = sglang_source.Module("m", source)
    assert sorted(whole.classes) == ["A", "C"] and "class B" in whole.classes["A"].text
    clean = source.replace("X = [\n1, 2,\n]", "X = [1, 2]")
    cut = sglang_source.Module("m", clean)
    assert sglang_source._statements(clean) is not None
    assert sorted(cut.classes) == ["A", "C"] and sorted(cut.assigns) == ["X", "else_name"]
    assert cut.classes["A"].text.startswith("@decorator\nclass A(") and "class B" in cut.classes["A"].text
    assert [ast_name(b) for b in cut.classes["A"].header().bases] == ["Base"]


def ast_name(node) -> str:
    return node.id
