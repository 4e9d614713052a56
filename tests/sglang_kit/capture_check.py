"""eyas's capture hook run by SGLang 0.5.23's own model classes and forward path, on CPU (the kit's environment).

    python tests/sglang_kit/capture_check.py REQUEST.json    # prints one JSON object

REQUEST: {"targets": [{"argv": [the extraction server's launch_server flags], "samples": [[token ids], ...],
          "rids": [...], "capture_dirs": {"TP rank": folder}}, ...],
          "layer_cases": [{"model": config-only dir, "ids": [...] or null}, ...]}
For each target it goes the way a server started with `argv` goes, with SGLang's own code:
- the server's arguments: `prepare_server_args`, `resolve_once`, `check_server_args`, published with
  `get_context().set_server_args` (what the scheduler process does before it builds the model);
- the model: `ModelConfig.from_server_args` and `ModelRegistry.resolve_model_cls` pick the class SGLang serves
  (LlamaForCausalLM; KimiK25ForConditionalGeneration holding a DeepseekV3ForCausalLM as `language_model`),
  instances of those very classes with SGLang's LogitsProcessor, the capture layers set by
  `resolve_spec_aux_hidden_state_config` + `configure_aux_hidden_state_capture` (model_runner.py
  `init_spec_aux_hidden_state`, `init_attention_backends`), eyas's hook attached by `register_forward_hooks`
  from the `--forward-hooks` value in argv;
- the forward: a ForwardBatch for the samples packed as one prefill (capture_hidden_mode from
  `get_server_return_hidden_states_mode`, as `ForwardBatch.init_new` sets it), and `model.forward(
  forward_batch.input_ids, forward_batch.positions, forward_batch)` as runner/eager_runner.py calls it. For
  Kimi-K2.5 that is KimiK25ForConditionalGeneration.forward -> `general_mm_embed_routine` (which embeds the
  text-only request itself and calls the language model with input_ids=None) -> DeepseekV2ForCausalLM.forward
  -> LogitsProcessor.forward (hidden_states, last_hidden_states as aux-capture mode builds them) -> the hook;
- the writer rank: SGLang's `get_tensor_model_parallel_rank` under `get_parallel().override(...)` of a TP
  group of two (the LogitsProcessor itself is built for one rank: its TP gather of logits needs a process group);
then a DECODE and a TARGET_VERIFY forward of the same batch, which must write nothing.
What cannot run on CPU is the decoder stack (SGLang's attention and MoE kernels): the model's `model`
(LlamaModel, DeepseekV2Model) is a stand-in with their forward's signature and return value, which runs the
target's text model in transformers on what it is given (token ids, or the wrapper's embeddings), one request
at a time, and returns the final-norm rows and the captured layers' inputs (SGLang's `layers_to_capture`
index i is the residual stream entering layer i, HF hidden_states[i]).
`layer_cases`: SGLang's own `set_eagle3_layers_to_capture` for config-only targets, called unbound on a
stand-in holding the config (the model's __init__ needs a GPU context).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stand_ins  # noqa: E402

WRAPPER_PREFIX = "language_model."  # Kimi-K2.5's text-model weights (kimi_k25.py load_weights)


def main(request_path: str) -> dict:
    stand_ins.install()
    req = json.loads(Path(request_path).read_text())
    targets = [run_target(target) for target in req["targets"]]
    cases = [layers_to_capture(case["model"], case["ids"]) for case in req.get("layer_cases", [])]
    return {"targets": targets, "cases": cases}


def run_target(target: dict) -> dict:
    """Publish the server's arguments, build its model, run the batch at every TP rank and forward mode."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(list(target["argv"]) + ["--device", "cuda"])  # what a GPU host detects
    args.resolve_once()
    args.check_server_args()
    get_context().set_server_args(args)
    model_config = ModelConfig.from_server_args(args)
    hf = hf_text_model(args.model_path, model_config.hf_text_config)
    samples, rids = target["samples"], target["rids"]
    written, probe = {}, None
    for rank, out_dir in target["capture_dirs"].items():
        model, served = build_model(model_config, hf, args, capture_dir=out_dir)
        probe = probe or served
        tp = {"tp_group": types.SimpleNamespace(rank_in_group=int(rank), world_size=2), "tp_size": 2,
              "tp_rank": int(rank), "attn_tp_size": 2, "attn_tp_rank": int(rank), "moe_tp_size": 2}  # fmt: skip
        written[rank] = {}
        with get_parallel().override(**tp), torch.no_grad():
            for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND):
                batch = forward_batch(mode, samples, rids)
                model.forward(batch.input_ids, batch.positions, batch)  # runner/eager_runner.py
                for hook in served["logits_processor"]._forward_hooks.values():
                    hook.flush()
                written[rank][mode.name] = sorted(p.name for p in Path(out_dir).glob("*.safetensors"))
    return {"model_class": probe["model_class"], "hooked_module": probe["hooked_module"],
            "registered": probe["registered"], "layers_to_capture": probe["layers_to_capture"],
            "logits_processor_input_ids": probe["input_ids_seen"], "written": written}  # fmt: skip


def build_model(model_config, hf, args, *, capture_dir: str):
    """The model SGLang serves for this config, its decoder stack replaced (see the module docstring)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    cls, _ = ModelRegistry.resolve_model_cls(model_config.hf_config.architectures)
    text_cls = DeepseekV3ForCausalLM if cls is KimiK25ForConditionalGeneration else cls  # kimi_k25.py __init__
    lm = bare(text_cls)
    lm.config, lm.capture_aux_hidden_states = model_config.hf_text_config, False
    lm.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1, rank_in_group=0)
    lm.model = decoder_stand_in(hf, packed=issubclass(text_cls, DeepseekV3ForCausalLM))
    lm.lm_head = hf.lm_head  # ParallelLMHead of one rank: the whole [vocab, H] projection
    lm.logits_processor = LogitsProcessor(model_config.hf_text_config)
    model = lm
    if cls is KimiK25ForConditionalGeneration:  # a text-only request never reaches the vision tower
        model = bare(cls)
        model.config, model.language_model = model_config.hf_config, lm
    aux = resolve_spec_aux_hidden_state_config(
        server_args=args, model_config=model_config, is_draft_worker=False,
        spec_algorithm=SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm),
    )  # fmt: skip
    configure_aux_hidden_state_capture(
        model=model, eagle_use_aux_hidden_state=aux.eagle_use_aux_hidden_state,
        eagle_aux_hidden_state_layer_ids=aux.eagle_aux_hidden_state_layer_ids,
        dflash_use_aux_hidden_state=aux.dflash_use_aux_hidden_state, dflash_target_layer_ids=aux.dflash_target_layer_ids,
        is_dspark=aux.is_dspark,
    )  # fmt: skip
    specs = [{**spec, "config": {**spec["config"], "dir": capture_dir}} for spec in args.forward_hooks]
    register_forward_hooks(model, specs)
    hooked = [name for name, module in model.named_modules() if module._forward_hooks]
    seen = []
    lm.logits_processor.register_forward_pre_hook(lambda module, a: seen.append(None if a[0] is None else "tensor"))
    served = {"model_class": type(model).__name__, "hooked_module": hooked, "logits_processor": lm.logits_processor,
              "registered": len(lm.logits_processor._forward_hooks), "layers_to_capture": list(lm.model.layers_to_capture),
              "input_ids_seen": seen}  # fmt: skip
    return model, served


def bare(cls):
    """An instance of SGLang's model class without its __init__ (which builds GPU kernels and weights)."""
    from torch import nn

    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    return obj


def decoder_stand_in(hf, *, packed: bool):
    """LlamaModel / DeepseekV2Model: forward(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
    -> final-norm rows, or (rows, aux) when layers_to_capture is set: an AuxHiddenStatePacker's packed tensor
    (deepseek_v2.py) or an AuxHiddenStateList (llama.py)."""
    import torch
    from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList, AuxHiddenStatePacker
    from torch import nn

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = hf.get_input_embeddings()
            self.layers_to_capture = []

        def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
            embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # as both models do
            per_request, start = [], 0
            for n in forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else [len(embeds)]:
                states = hf.model(inputs_embeds=embeds[start : start + n][None], output_hidden_states=True)
                per_request.append(states.hidden_states)
                start += n
            rows = torch.cat([hs[-1][0] for hs in per_request])
            if not self.layers_to_capture:
                return rows
            aux = AuxHiddenStatePacker(len(self.layers_to_capture)) if packed else AuxHiddenStateList()
            for i in self.layers_to_capture:
                aux.capture(torch.cat([hs[i][0] for hs in per_request]))
            return rows, aux.finalize() if packed else aux

    return Decoder()


def hf_text_model(model_path: str, text_config):
    """The target's text model in transformers with its weights (a wrapper's under `language_model.`)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    if not any(name.startswith(WRAPPER_PREFIX) for name in weights):
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    config = AutoConfig.for_model(**text_config.to_dict())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    text = {n[len(WRAPPER_PREFIX) :]: t for n, t in weights.items() if n.startswith(WRAPPER_PREFIX)}
    model.load_state_dict(text, strict=True)
    return model


def forward_batch(mode, samples: list[list[int]], rids: list[str]):
    """A ForwardBatch of the samples as one batch, with the fields ForwardBatch.init_new fills for it."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        get_required_capture_hidden_mode,
        get_server_return_hidden_states_mode,
    )

    lens = [len(ids) for ids in samples]
    ids = torch.tensor([t for s in samples for t in s])
    capture = get_required_capture_hidden_mode(
        max(CaptureHiddenMode.NULL, get_server_return_hidden_states_mode()), None
    )
    return ForwardBatch(
        forward_mode=mode, batch_size=len(lens), input_ids=ids, req_pool_indices=torch.arange(len(lens)),
        seq_lens=torch.tensor(lens), out_cache_loc=torch.arange(len(ids)), seq_lens_sum=sum(lens), rids=list(rids),
        extend_seq_lens=torch.tensor(lens), extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0] * len(lens),
        positions=torch.cat([torch.arange(n) for n in lens]), capture_hidden_mode=capture,
    )  # fmt: skip


def layers_to_capture(model_dir: str, ids: list[int] | None) -> list[int]:
    """SGLang's own choice of captured layers (HF hidden_states indices) for a target config and ids."""
    from sglang.srt.models.registry import ModelRegistry
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    stand_in = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True), config=config.get_text_config(),
        model=types.SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False,
    )  # fmt: skip
    cls.set_eagle3_layers_to_capture(stand_in, ids)
    return list(stand_in.model.layers_to_capture)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
