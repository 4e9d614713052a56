"""Every SGLang command eyas builds, run through SGLang 0.5.23's own code on CPU (tests/sglang_conformance.py).

SGLang's parser, resolution and validation (`prepare_server_args`, `ServerArgs.resolve_once`,
`check_server_args`) accept or refuse each launch command, and `/server_info` as SGLang builds it is what
eyas's server checks read. eyas's capture hook runs inside SGLang's own LogitsProcessorOutput, ForwardBatch
and hook registration (tests/sglang_kit/capture_check.py), and SGLang's own `set_eagle3_layers_to_capture`
decides which layers the ids eyas sends capture.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kimi_remote_code import with_remote_config
from safetensors.torch import load_file, save_file
from sglang_conformance import REPO, TINY_DRAFT_CONFIG, SglangRefused, kit_python_env, resolved_server_info
from target_fixtures import write_target

from eyas.bench.sglang import lint_launch_command
from eyas.config import SGLangExtractConfig, load_run_config
from eyas.engines.sglang import SglangLaunch, build_launch_command
from eyas.extract.backends.hf import HFBackend
from eyas.extract.backends.sglang import (
    aux_capture_flags,
    build_extract_command,
    engine_layer_ids,
    hook_spec,
    lint_server_info,
)
from eyas_cli.engine_command import engine_command

TINY = REPO / "fixtures" / "tiny-target"
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3's config.json, narrowed (61 layers kept: the ids are the point)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 64,
    "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 2048,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    """Config-only target folders (SGLang's resolution reads config.json, no weights): Llama-shaped with 32
    layers, DeepSeek-shaped with 61."""
    root = tmp_path_factory.mktemp("targets")
    llama = json.loads((TINY / "config.json").read_text()) | {"num_hidden_layers": 32}
    out = {}
    for name, config in (("llama-32", llama), ("deepseek-v3-61", DEEPSEEK_V3)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = root / name
    return out


def extract_argv(target: Path, aux_layer_ids: list[int], capture_dir="/shared/capture", **cfg) -> list[str]:
    config = SGLangExtractConfig(**{"tp_size": 8, **cfg})
    return build_extract_command(config, target_path=str(target), aux_layer_ids=aux_layer_ids, capture_dir=capture_dir)


@pytest.mark.parametrize(
    "target, aux, engine, convention",
    [
        ("tiny", [2, 4, 5], [1, 3, 4], "sglang_llama"),
        ("llama-32", [3, 10, 20], [2, 9, 19], "sglang_llama"),
        ("deepseek-v3-61", [3, 30, 58], [3, 30, 58], "sglang_deepseek"),  # first id not 1: used as given
        ("deepseek-v3-61", [2, 30, 58], [1, 29, 57], "sglang_deepseek"),  # first id 1: SGLang adds 1 to each
    ],
)
def test_sglang_accepts_the_extraction_command_and_resolves_what_eyas_checks(
    sglang_kit, targets, target, aux, engine, convention
):
    path = TINY if target == "tiny" else targets[target]
    argv = extract_argv(path, aux)
    info = resolved_server_info(argv)
    assert engine_layer_ids(aux, path) == (engine, convention)
    assert info["return_aux_hidden_state_layer_ids"] == engine
    # SGLang's aux-capture mode: no speculation left, capture named "eagle3", every row kept
    assert info["speculative_algorithm"] is None and info["aux_hidden_state_capture"] == "eagle3"
    assert info["return_hidden_states_mode"] == "full" and info["enable_return_hidden_states"] is True
    assert info["forward_hooks"] == hook_spec("/shared/capture") and info["version"] == "0.5.23"
    assert lint_server_info(info, engine, convention) == []


def test_the_json_model_override_ids_are_ignored_in_aux_capture_mode(sglang_kit):
    """What eyas sent before: SGLang's resolution drops them, so a server would capture its default layers."""
    flags = aux_capture_flags(SGLangExtractConfig(), [1, 3, 4], "/c")
    i = flags.index("--return-aux-hidden-state-layer-ids")
    del flags[i : i + 4]
    override = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}}
    info = resolved_server_info(["--model-path", str(TINY), *flags, "--json-model-override-args", json.dumps(override)])
    assert info["return_aux_hidden_state_layer_ids"] is None
    [problem] = lint_server_info(info, [1, 3, 4], "sglang_llama")
    assert problem.startswith("return_aux_hidden_state_layer_ids=None (SGLang then captures its default layers)")


def test_an_hf_first_id_1_cannot_be_written_for_a_deepseek_target(targets):
    with pytest.raises(ValueError, match=r"a first id of 1 makes the engine add 1 to every id"):
        extract_argv(targets["deepseek-v3-61"], [1, 30, 58])


@pytest.mark.parametrize(
    "change, refusal",
    [
        (["--pp-size", "2"], "--enable-return-aux-hidden-states only supports pp_size == 1"),
        (["--speculative-algorithm", "EAGLE"], "needs --speculative-algorithm EAGLE3, DFLASH or DSPARK"),
        (["--speculative-draft-model-path", "/d"], "captures without a draft; drop --speculative-draft-model-path"),
        (["--return-aux-hidden-state-layer-ids", "1", "1", "5"], "must not repeat a layer, got [1, 1, 5]"),
    ],
)
def test_sglang_refuses_a_broken_extraction_command_with_its_own_message(sglang_kit, change, refusal):
    argv = extract_argv(TINY, [2, 4, 5])[3:]
    flag = change[0]
    if flag in argv:  # replace the flag's values
        i = argv.index(flag)
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        argv[i:j] = change
    else:
        argv += change
    with pytest.raises(SglangRefused) as err:
        resolved_server_info(argv)
    assert refusal in str(err.value)


@pytest.fixture
def draft(tmp_path) -> Path:
    out = tmp_path / "draft"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(TINY_DRAFT_CONFIG))
    (out / "model.safetensors").write_bytes(b"")
    return out


def test_sglang_accepts_the_benchmark_and_baseline_commands_as_eyas_builds_them(sglang_kit, draft):
    launch = SglangLaunch(target_path=str(TINY), draft_path=str(draft), steps=3, topk=1, num_draft_tokens=4)
    spec = resolved_server_info(build_launch_command(launch))
    assert (spec["speculative_algorithm"], spec["speculative_draft_model_path"]) == ("EAGLE3", str(draft))
    shape = [spec[f"speculative_{k}"] for k in ("num_steps", "eagle_topk", "num_draft_tokens")]
    assert shape == [3, 1, 4]  # as eyas asked: the lint's steps + 1 rule is SGLang's (see below)
    assert lint_launch_command(build_launch_command(launch), shard_aux_layer_ids=[2, 4, 5]) == []
    base = resolved_server_info(build_launch_command(launch.baseline()))
    assert base["speculative_algorithm"] is None and base["speculative_draft_model_path"] is None


def test_sglang_rewrites_a_chains_draft_tokens_as_the_lint_says(sglang_kit, draft):
    launch = SglangLaunch(target_path=str(TINY), draft_path=str(draft), steps=3, topk=1, num_draft_tokens=8)
    assert resolved_server_info(build_launch_command(launch))["speculative_num_draft_tokens"] == 4
    [problem] = lint_launch_command(build_launch_command(launch))
    assert "expected steps + 1 = 4; SGLang rewrites it for a chain" in problem


def test_engine_command_prints_what_sglang_accepts_for_every_stage(sglang_kit, tmp_path, draft):
    config = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    config = config.model_copy(update={"workdir": str(tmp_path / "run")})
    export = tmp_path / "run" / "export" / "sglang"
    export.parent.mkdir(parents=True)
    draft.rename(export)
    stages = ("generate", "extract", "bench", "baseline")
    infos = {stage: resolved_server_info(engine_command(config, stage)) for stage in stages}
    # regeneration: a plain server (no speculation, no capture) with the configured tensor parallelism
    assert infos["generate"]["speculative_algorithm"] is None and infos["generate"]["aux_hidden_state_capture"] is None
    assert infos["generate"]["tp_size"] == config.dataset.generation.sglang_tp_size
    assert infos["extract"]["aux_hidden_state_capture"] == "eagle3"
    assert infos["extract"]["forward_hooks"][0]["config"]["dir"] == str(tmp_path / "run" / "extract" / "sglang-capture")
    assert infos["bench"]["speculative_algorithm"] == "EAGLE3"
    assert infos["baseline"]["speculative_algorithm"] is None
    cli = subprocess.run(
        [sys.executable, "-m", "eyas_cli.main", "engine-command", str(REPO / "deployments" / "tiny-cpu.json"),
         "--stage", "extract", "--json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    printed = json.loads(cli.stdout)
    # the tiny preset names no SGLang environment (sglang.python): the servers run eyas's own interpreter
    assert printed["argv"][:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert printed["command"].startswith(f"{shlex.quote(sys.executable)} -m ")
    assert resolved_server_info(printed["argv"])["return_aux_hidden_state_layer_ids"] == [1, 3, 4]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    """A config-only Kimi-K2.5 target with the configuration code its checkpoint ships (auto_map)."""
    root = tmp_path_factory.mktemp("kimi")
    return with_remote_config(write_target(root / "kimi-k2.5", "kimi-k2.5"), root / "kimi-k2.5-remote")


def test_sglang_resolves_trust_remote_code_for_every_server_of_the_kimi_preset(sglang_kit, kimi, tmp_path):
    from producer_fixtures import PUBLISHED

    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    target = config.target.model_copy(update={"model_path": str(kimi)})
    config = config.model_copy(update={"workdir": str(tmp_path / "run"), "target": target})
    export = config.paths.export_dir / "sglang"
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps(PUBLISHED["aq-medai-kimi-k2"]["config"]))
    argvs = {stage: engine_command(config, stage) for stage in ("generate", "extract", "bench", "baseline")}
    assert {argv[0] for argv in argvs.values()} == {config.sglang.python} == {"/opt/sglang/bin/python"}
    infos = {stage: resolved_server_info(argv) for stage, argv in argvs.items()}
    assert {stage: info["trust_remote_code"] for stage, info in infos.items()} == dict.fromkeys(argvs, True)
    assert lint_server_info(infos["extract"], [1, 29, 57], "sglang_deepseek", trust_remote_code=True) == []


def test_a_kimi_server_without_trust_remote_code_is_refused_by_the_extraction_lint(sglang_kit, kimi):
    """A server started by hand from the extraction command less --trust-remote-code."""
    argv = build_extract_command(SGLangExtractConfig(tp_size=8), target_path=str(kimi), aux_layer_ids=[2, 30, 58],
                                 capture_dir="/shared/capture")  # fmt: skip
    info = resolved_server_info(argv)
    assert info["trust_remote_code"] is False
    [problem] = lint_server_info(info, [1, 29, 57], "sglang_deepseek", trust_remote_code=True)
    assert problem == (
        "trust_remote_code=False, expected True: target.trust_remote_code is true (the target's config or tokenizer "
        "loads through its own code); launch with --trust-remote-code"
    )


@pytest.mark.parametrize(
    "override, backend",
    [(["--cuda-graph-backend-prefill", "breakable"], "breakable"),
     (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'], "full")],
)  # fmt: skip
def test_settings_that_turn_prefill_cuda_graphs_back_on_are_refused(sglang_kit, override, backend):
    """SGLang lets both win over --disable-prefill-cuda-graph (cuda_graph_hook.py) and still reports that flag
    true. (On a GPU the prefill default is `breakable`, here `disabled`: the kit resolves on a CPU.)"""
    with pytest.raises(ValueError, match=f"remove them:\n  {override[0]}: they override --disable-prefill-cuda-graph"):
        extract_argv(TINY, [2, 4, 5], extra_args=override)
    info = resolved_server_info(extract_argv(TINY, [2, 4, 5]) + override)  # a server started by hand
    assert info["disable_prefill_cuda_graph"] is True and info["cuda_graph_config"]["prefill"]["backend"] == backend
    [problem] = lint_server_info(info, [1, 3, 4], "sglang_llama")
    assert problem.startswith(f"cuda_graph_config.prefill.backend='{backend}', expected 'disabled': a prefill ")


def test_data_parallel_attention_is_read_from_attn_dp_size_once_enable_dp_attention_is_gone(sglang_kit):
    """SGLang 0.5.23 marks /server_info's enable_dp_attention for removal (server_args.py); attn_dp_size stays."""
    sound = resolved_server_info(extract_argv(TINY, [2, 4, 5]))
    dp = resolved_server_info(extract_argv(TINY, [2, 4, 5]) + ["--attn-dp-size", "2"])
    assert (sound["enable_dp_attention"], sound["attn_dp_size"], dp["enable_dp_attention"], dp["attn_dp_size"]) == (
        False, 1, True, 2)  # fmt: skip
    gone = {k: v for k, v in sound.items() if k != "enable_dp_attention"}
    assert lint_server_info(gone, [1, 3, 4], "sglang_llama") == []
    for info in (dp, {k: v for k, v in dp.items() if k != "enable_dp_attention"}):
        [problem] = lint_server_info(info, [1, 3, 4], "sglang_llama")
        assert "attn_dp_size=2, expected false / 1: the hook writes from TP rank 0" in problem
    neither = {k: v for k, v in gone.items() if k != "attn_dp_size"}
    [problem] = lint_server_info(neither, [1, 3, 4], "sglang_llama")
    assert problem.startswith("enable_dp_attention='(absent)', attn_dp_size='(absent)', expected false / 1")
    # replicas (--dp-size without DP attention): each replica's TP rank 0 writes its own requests' files
    replicas = resolved_server_info(extract_argv(TINY, [2, 4, 5]) + ["--dp-size", "2"])
    assert (replicas["dp_size"], replicas["attn_dp_size"]) == (2, 1)
    assert lint_server_info(replicas, [1, 3, 4], "sglang_llama") == []


LAYER_CASES = [("llama-32", [3, 10, 20]), ("llama-32", [2, 16, 29]), ("deepseek-v3-61", [3, 30, 58]),
               ("deepseek-v3-61", [2, 30, 58]), ("deepseek-v3-61", [2, 31, 60])]  # fmt: skip
KIMI_TEXT = {  # a DeepSeek-V3 text model (MLA + MoE) small enough for CPU, with Kimi-K2.5's config keys
    **DEEPSEEK_V3, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 6,
    "first_k_dense_replace": 1, "n_routed_experts": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 512, "max_position_embeddings": 256,
    "torch_dtype": "float32",
}  # fmt: skip
KIMI_VISION = {"vt_hidden_size": 32, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2,
               "vt_intermediate_size": 64, "mm_hidden_size": 32, "text_hidden_size": 64}  # fmt: skip


@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory) -> Path:
    """A Kimi-K2.5-shaped target: the kimi_k25 wrapper's config keys around a DeepSeek-V3 text model, its weights
    under `language_model.`, a vision tensor beside them."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = tmp_path_factory.mktemp("kimi-k25")
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": KIMI_TEXT, "vision_config": KIMI_VISION, "media_placeholder_token_id": 500,
              "tie_word_embeddings": False}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    text = DeepseekV3ForCausalLM(DeepseekV3Config(**KIMI_TEXT))
    weights = {f"language_model.{name}": t.contiguous() for name, t in text.state_dict().items()}
    save_file(
        {**weights, "vision_tower.patch_embed.proj.weight": torch.zeros(32, 3, 14, 14)}, str(out / "model.safetensors")
    )
    return out


def kimi_text_features(target: Path, samples, ids: list[int]):
    """(aux, last) per sample from transformers' DeepseekV3ForCausalLM with the wrapper's text weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**KIMI_TEXT)).eval()
    weights = load_file(str(target / "model.safetensors"))
    model.load_state_dict({n.removeprefix("language_model."): t for n, t in weights.items() if
                           n.startswith("language_model.")})  # fmt: skip
    with torch.no_grad():
        hidden = [model(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states for s in samples]
    return [(torch.cat([hs[i][0] for i in ids], dim=-1), hs[-1][0]) for hs in hidden]


def test_the_capture_hook_in_sglangs_own_model_classes_writes_the_hf_rows(tmp_path, targets, kimi_target):
    """The Llama target and the Kimi-K2.5 wrapper, each through SGLang's own forward path
    (tests/sglang_kit/capture_check.py): for Kimi the logits processor gets input_ids=None
    (general_mm_embed_routine embeds the text-only request itself) and the hook takes the ForwardBatch's."""
    samples = [[5, 17, 300, 2, 9], [100, 101, 102], [7, 7, 7, 7]]
    rids = ["eyas-a", "health-check", "eyas-c"]
    runs = {"llama": (TINY, [2, 4, 5]), "kimi": (kimi_target, [2, 3, 4])}
    request = {
        "targets": [{"argv": extract_argv(path, aux, tmp_path / "unused", tp_size=1)[3:], "samples": samples,
                     "rids": rids, "capture_dirs": {r: str(tmp_path / name / f"rank{r}") for r in ("0", "1")}}
                    for name, (path, aux) in runs.items()],
        # the ids eyas sends for these canonical ids, then SGLang's own choice of layers for them
        "layer_cases": [{"model": str(targets[name]), "ids": engine_layer_ids(ids, targets[name])[0]}
                        for name, ids in LAYER_CASES] + [{"model": str(targets["deepseek-v3-61"]), "ids": None}],
    }  # fmt: skip
    (tmp_path / "request.json").write_text(json.dumps(request))
    script = REPO / "tests" / "sglang_kit" / "capture_check.py"
    env = kit_python_env()
    env["PYTHONPATH"] += f":{REPO}"  # the server's Python imports eyas's capture module
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "request.json")], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    llama, kimi = result["targets"]
    assert result["cases"] == [ids for _, ids in LAYER_CASES] + [[2, 30, 58]]  # last: SGLang's default
    assert (llama["model_class"], llama["hooked_module"]) == ("LlamaForCausalLM", ["logits_processor"])
    assert (kimi["model_class"], kimi["hooked_module"]) == ("KimiK25ForConditionalGeneration",
                                                            ["language_model.logits_processor"])  # fmt: skip
    assert llama["logits_processor_input_ids"] == ["tensor"] * 3 and kimi["logits_processor_input_ids"] == [None] * 3
    # SGLang's own set_eagle3_layers_to_capture: the canonical ids the run asked for
    assert llama["layers_to_capture"] == [2, 4, 5] and kimi["layers_to_capture"] == [2, 3, 4]
    for run in (llama, kimi):
        assert run["registered"] == 1
        assert run["written"] == {"0": {"DECODE": [], "TARGET_VERIFY": [], "EXTEND": ["eyas-a.safetensors",
                                                                                      "eyas-c.safetensors"]},
                                  "1": {"DECODE": [], "TARGET_VERIFY": [], "EXTEND": []}}  # fmt: skip
    hf = HFBackend(str(TINY), target_dtype="float32", aux_layer_ids=[2, 4, 5], hidden_size=128, device="cpu")
    expected = {"llama": hf.features([torch.tensor(s) for s in samples]),
                "kimi": kimi_text_features(kimi_target, samples, [2, 3, 4])}  # fmt: skip
    for name in runs:
        for rid, ids, (aux, last) in zip(rids, samples, expected[name]):
            if not rid.startswith("eyas-"):
                continue
            written = load_file(str(tmp_path / name / "rank0" / f"{rid}.safetensors"))
            assert written["input_ids"].tolist() == ids
            torch.testing.assert_close(written["aux"], aux, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(written["last"], last, atol=1e-5, rtol=1e-4)
