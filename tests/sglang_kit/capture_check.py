"""eyas's capture hook run inside SGLang 0.5.23's own objects, on CPU (the kit's environment).

    python tests/sglang_kit/capture_check.py REQUEST.json    # prints one JSON object

REQUEST: {"target": HF model dir (a Llama), "engine_ids": [...], "hook_specs": [--forward-hooks value],
          "samples": [[token ids], ...], "rids": [...], "capture_dirs": {"TP rank": folder},
          "layer_cases": [{"model": config-only dir, "ids": [...] or null}, ...]}
It takes from SGLang itself:
- which layers are captured: `set_eagle3_layers_to_capture(ids)` of the model class SGLang's registry picks
  for the config's architectures (models/llama.py; models/deepseek_v2.py for DeepSeek/Kimi), called unbound
  on a stand-in holding the config (the model's __init__ needs a GPU context), for the target and each case;
- the hook's attachment: `register_forward_hooks` (model_executor/hook_manager.py) on a module tree with a
  `logits_processor` whose forward has LogitsProcessor.forward's signature (checked here), with the spec
  eyas puts in --forward-hooks;
- the objects the hook reads: a real ForwardBatch (ForwardMode.EXTEND, rids, extend_seq_lens_cpu,
  extend_prefix_lens_cpu) for the samples packed as one prefill, and a real LogitsProcessorOutput with
  `pack_aux_hidden_states` of the captured layers and the final-norm rows as last_hidden_states;
- the writer rank: SGLang's tensor-parallel rank (`get_parallel().override(tp_group=...)`, the test
  primitive SGLang provides for it);
then a DECODE forward and a TARGET_VERIFY forward, which must write nothing.
The hidden states come from transformers (the target's HF forward), one sample at a time.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stand_ins  # noqa: E402


def main(request_path: str) -> dict:
    stand_ins.install()
    import torch
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
    from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from sglang.srt.runtime_context import get_parallel
    from torch import nn
    from transformers import AutoModelForCausalLM

    req = json.loads(Path(request_path).read_text())
    layers = layers_to_capture(req["target"], req["engine_ids"])
    cases = [layers_to_capture(case["model"], case["ids"]) for case in req.get("layer_cases", [])]

    hf = AutoModelForCausalLM.from_pretrained(req["target"], dtype=torch.float32).eval()
    aux_rows, last_rows = [], []
    with torch.no_grad():
        for ids in req["samples"]:
            hs = hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            aux_rows.append([hs[i][0] for i in layers])
            last_rows.append(hs[-1][0])
    aux_list = [torch.cat([a[k] for a in aux_rows]) for k in range(len(layers))]
    last = torch.cat(last_rows)
    input_ids = torch.tensor([t for ids in req["samples"] for t in ids])
    lens = [len(ids) for ids in req["samples"]]

    class Logits(nn.Module):  # LogitsProcessor's __init__ needs a live server context; its signature is kept
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                    hidden_states_before_norm=None):  # fmt: skip
            return LogitsProcessorOutput(
                next_token_logits=hidden_states[-1:],
                hidden_states=pack_aux_hidden_states(aux_hidden_states),
                last_hidden_states=hidden_states,
            )

    same_signature = list(inspect.signature(Logits.forward).parameters) == list(
        inspect.signature(LogitsProcessor.forward).parameters
    )

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.logits_processor = Logits()

    probe = Model()
    register_forward_hooks(probe, req["hook_specs"])
    registered = len(probe.logits_processor._forward_hooks)

    def batch(mode):
        return ForwardBatch(
            forward_mode=mode, batch_size=len(lens), input_ids=input_ids, req_pool_indices=torch.arange(len(lens)),
            seq_lens=torch.tensor(lens), out_cache_loc=torch.arange(len(input_ids)), seq_lens_sum=sum(lens),
            rids=list(req["rids"]), extend_seq_lens_cpu=list(lens), extend_prefix_lens_cpu=[0] * len(lens),
        )  # fmt: skip

    written = {}
    for rank, out_dir in req["capture_dirs"].items():
        specs = [{**spec, "config": {**spec["config"], "dir": out_dir}} for spec in req["hook_specs"]]
        model = Model()
        register_forward_hooks(model, specs)
        group = types.SimpleNamespace(rank_in_group=int(rank), world_size=max(2, int(rank) + 1))
        written[rank] = {}
        with get_parallel().override(tp_group=group):
            for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND):
                model.logits_processor(input_ids, last, None, batch(mode), aux_list)
                for hook in model.logits_processor._forward_hooks.values():
                    hook.flush()
                written[rank][mode.name] = sorted(p.name for p in Path(out_dir).glob("*.safetensors"))
    return {"layers_to_capture": layers, "cases": cases, "same_signature": same_signature,
            "registered": registered, "written": written}  # fmt: skip


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
