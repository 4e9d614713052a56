"""The dataset stage's first step: conversations -> (the target's responses) -> the tokenized table.

    report = build_dataset(config)          # config: RunConfig; writes RUN/dataset/

`dataset.responses = "regenerate"`: the target answers each conversation's last user turn through the
configured generator (eyas.dataset.generate: hf, sglang or openai, into a crash-safe log a re-run resumes);
a sample is the prompt's tokens (the chat template applied when the tokenizer has one, the raw text
otherwise) followed by the response's tokens, loss mask 1 on the response only. `"as_given"`: the file's
conversations are rendered whole (eyas.dataset.conversations) with every assistant turn loss-masked. Output:
`tokenized.parquet` (eyas.dataset.table), `report.json` (with the accounting: answered + failed + skipped =
input), and `responses.jsonl` for people to read. A table whose cache key (conversations, dataset config,
target) matches is reused.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from eyas.config import DatasetConfig, RunConfig
from eyas.dataset.conversations import read_conversations, render_conversation, turn_options
from eyas.dataset.generate import (
    Accounting,
    HFGenerator,
    Item,
    OpenAIGenerator,
    ResponseLog,
    Sampling,
    SGLangGenerator,
    regenerate,
)
from eyas.dataset.prompts import DatasetError, prompt_token_ids
from eyas.dataset.table import content_hash, read_tokenized_meta, write_tokenized_table
from eyas.fsio import atomic_write_bytes, read_json_record
from eyas.target import load_target, load_tokenizer, target_fingerprint

REPORT_FILE = "report.json"
RESPONSES_FILE = "responses.jsonl"
PROMPT_TOO_LONG = "the prompt alone fills dataset.max_length"
BENCH_TEMPERATURE = 0.0  # the benchmark decodes greedily (eyas.bench)


@dataclass
class DatasetReport:
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    num_empty_mask: int
    num_truncated: int
    content_hash: str
    seconds: float
    reused: bool = False
    shape: str = "eyas"  # the conversations file's shape (eyas, sharegpt, openai)
    responses: str = "regenerate"
    generator: str = "hf"
    accounting: dict = field(default_factory=dict)
    generation_temperature: float = 0.0
    bench_temperature: float = BENCH_TEMPERATURE

    def to_dict(self) -> dict:
        return asdict(self)


def dataset_cache_key(cfg: DatasetConfig, target_path: str | Path) -> str:
    h = hashlib.sha256(Path(cfg.prompts_path).read_bytes())
    settings = cfg.model_dump(mode="json", exclude={"prompts_path", "generation"})
    settings["generation"] = cfg.generation.identity()
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(target_fingerprint(target_path).encode())
    return h.hexdigest()[:16]


def generation_launch(config: RunConfig):
    """The SGLang server eyas launches for regeneration (no speculation, no capture), in SGLang's environment."""
    from eyas.engines.sglang import SglangLaunch, engine_python

    gen = config.dataset.generation
    extra = ("--tp-size", str(gen.sglang_tp_size), *gen.sglang_extra_args)
    return SglangLaunch(config.target.model_path, None, port=gen.sglang_port, extra_args=extra,
                        python=engine_python(config.sglang.python), trust_remote_code=config.target.trust_remote_code,
                        allowed_versions=tuple(config.sglang.allow_unchecked_versions))  # fmt: skip


def _generator(config: RunConfig, tokenizer, stack: ExitStack):
    cfg, gen = config.dataset, config.dataset.generation
    sampling = Sampling(cfg.max_new_tokens, gen.temperature, gen.top_p)
    if gen.generator == "hf":
        target = load_target(
            config.target.model_path, config.target.dtype, trust_remote_code=config.target.trust_remote_code
        )
        return HFGenerator(target, sampling, cfg.generate_batch_size)
    urls = [u.rstrip("/") for u in gen.server_urls]
    if gen.generator == "sglang":
        if not urls:
            from eyas.engines.sglang import SglangServer

            log = config.paths.dataset_dir / "sglang-generate.log"
            launch = generation_launch(config)
            urls = [stack.enter_context(SglangServer(launch, log, gen.sglang_startup_timeout_s))]
        return SGLangGenerator(urls, sampling, gen.max_in_flight, gen.request_timeout_s)
    return OpenAIGenerator(urls, sampling, gen.max_in_flight, gen.request_timeout_s, model=gen.openai_model,
                           endpoint=gen.openai_endpoint, tokenizer=tokenizer)  # fmt: skip


def _last_user(turns: list[dict]) -> list[dict] | None:
    """The turns up to and including the last user turn (what the target answers), or None without one."""
    last = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    return None if last is None else turns[: last + 1]


def _regenerated(config: RunConfig, rows, tokenizer, key, progress):
    cfg = config.dataset
    items, skipped, prompts = [], {}, {}
    for r in rows:
        turns = _last_user(r["conversations"])
        if turns is None:
            skipped[r["id"]] = "no user turn to answer"
            continue
        ids = prompt_token_ids(tokenizer, turns)
        if len(ids) >= cfg.max_length:
            skipped[r["id"]] = PROMPT_TOO_LONG
            continue
        items.append(Item(r["id"], ids, turns))
        prompts[r["id"]] = ids
    with ExitStack() as stack:
        generator = _generator(config, tokenizer, stack)
        log = ResponseLog(config.paths.dataset_dir / f"responses-{key}.log")
        records, acct = regenerate(items, generator, log, max_attempts=cfg.generation.max_attempts, skipped=skipped,
                                   progress=progress)  # fmt: skip
    samples = {}
    for item in items:
        record = records.get(item.id)
        if record and record["status"] == "answered":
            out = record["output_ids"]
            samples[item.id] = (item.prompt_ids + out, [0] * len(item.prompt_ids) + [1] * len(out), out)
    return samples, acct, generator.name


def _as_given(rows, tokenizer) -> tuple[dict, Accounting]:
    samples, skipped = {}, {}
    for r in rows:
        if not any(t["role"] == "assistant" for t in r["conversations"]):
            skipped[r["id"]] = "no assistant turn to train on"
            continue
        ids, mask = render_conversation(tokenizer, r["conversations"], where=f"conversation {r['id']}")
        samples[r["id"]] = (ids, mask, None)
    acct = Accounting(input=len(rows), answered=len(samples), skipped=len(skipped))
    acct.skipped_reasons = {k: list(skipped.values()).count(k) for k in set(skipped.values())}
    acct.check()
    return samples, acct


def build_dataset(config: RunConfig, *, progress: Callable | None = None) -> DatasetReport:
    """Regenerate (or take as given), tokenize and write the table; reuse it when the cache key matches."""
    t0 = time.time()
    cfg, target_path, out = config.dataset, config.target.model_path, config.paths.dataset_dir
    table_path = config.paths.tokenized
    key = dataset_cache_key(cfg, target_path)
    if table_path.exists() and read_tokenized_meta(table_path).get("eyas.cache_key") == key:
        report = json.loads((out / REPORT_FILE).read_text())
        return DatasetReport(**{**report, "reused": True})

    conversations, shape = read_conversations(cfg.prompts_path, cfg.num_samples)
    rows = [{**r, "conversations": turn_options(r["conversations"], cfg.system_prompt, cfg.reasoning)}
            for r in conversations]  # fmt: skip
    tokenizer = load_tokenizer(target_path, trust_remote_code=config.target.trust_remote_code)
    if cfg.responses == "as_given":
        samples, acct = _as_given(rows, tokenizer)
        generator = "none"
    else:
        samples, acct, generator = _regenerated(config, rows, tokenizer, key, progress)
        if acct.failed > cfg.generation.max_failed_fraction * acct.input:
            raise DatasetError(
                f"regeneration: {acct.failed} of {acct.input} prompts failed every attempt "
                f"({acct.failed_reasons}), more than dataset.generation.max_failed_fraction="
                f"{cfg.generation.max_failed_fraction}; the answers so far are kept in the log: fix the servers "
                "and re-run the stage, which asks only for the missing ones"
            )
    kept = [r for r in rows if r["id"] in samples]
    ids, masks, truncated = [], [], 0
    for row in kept:
        full, mask, _ = samples[row["id"]]
        if len(full) > cfg.max_length:
            truncated += 1
            if len(full) - cfg.max_length > len(full) // 2:
                raise DatasetError(
                    f"sample {row['id']}: {len(full)} tokens, truncation to dataset.max_length="
                    f"{cfg.max_length} drops most of it; raise max_length or shorten the prompt"
                )
            full, mask = full[: cfg.max_length], mask[: cfg.max_length]
        ids.append(full)
        masks.append(mask)
    report = _check_and_write(cfg, kept, ids, masks, truncated, key, table_path, t0, acct.skipped_reasons)
    report.shape, report.responses, report.generator = shape, cfg.responses, generator
    report.accounting = acct.to_dict()
    report.generation_temperature = cfg.generation.temperature
    atomic_write_bytes(out / REPORT_FILE, json.dumps(report.to_dict(), indent=2).encode())
    _write_responses(out / RESPONSES_FILE, kept, {k: v[2] for k, v in samples.items()}, tokenizer)
    return report


def _check_and_write(
    cfg, rows, ids, masks, truncated, key, table_path: Path, t0: float, skipped: dict[str, int] | None = None
) -> DatasetReport:
    """`skipped`: conversations that gave no sample, by reason (a prompt that alone fills max_length, no user
    turn to answer, no assistant turn to train on): each counts as a sample with nothing to train on."""
    skipped = skipped or {}
    num_skipped = sum(skipped.values())
    empty, total = sum(1 for m in masks if not any(m)) + num_skipped, len(masks) + num_skipped
    if empty > cfg.max_empty_mask_fraction * total:
        reasons = "".join(f"; {n} x {reason}" for reason, n in sorted(skipped.items()))
        raise DatasetError(
            f"dataset: {empty} of {total} samples have an all-zero loss mask (no response token, "
            f"or a prompt that alone fills max_length{reasons}), "
            f"more than dataset.max_empty_mask_fraction={cfg.max_empty_mask_fraction}; the target answered "
            f"with EOS at once, max_length cuts the responses, or the conversations lack the turns "
            f"dataset.responses={cfg.responses!r} needs: check the prompts and the chat template"
        )
    out = table_path.parent
    out.mkdir(parents=True, exist_ok=True)
    sample_ids = [str(r["id"]) for r in rows]
    chash = content_hash(ids, masks, sample_ids)
    report = DatasetReport(
        num_samples=len(ids),
        num_tokens=sum(map(len, ids)),
        num_loss_tokens=sum(map(sum, masks)),
        num_empty_mask=empty,
        num_truncated=truncated,
        content_hash=chash,
        seconds=round(time.time() - t0, 2),
    )
    atomic_write_bytes(out / REPORT_FILE, json.dumps(report.to_dict(), indent=2).encode())
    write_tokenized_table(table_path, sample_ids, ids, masks, dataset_hash=chash, cache_key=key)
    return report


def _write_responses(path: Path, rows, responses: dict, tokenizer) -> None:
    lines = []
    for row in rows:
        turns = list(row["conversations"])
        if responses.get(row["id"]) is not None:  # regenerated: the last user turn, then the target's answer
            turns = _last_user(turns) + [
                {"role": "assistant", "content": tokenizer.decode(responses[row["id"]], skip_special_tokens=True)}
            ]
        lines.append(json.dumps({"id": row["id"], "conversations": turns}))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())


def read_dataset_report(dataset_dir: str | Path) -> dict | None:
    """report.json of a built dataset (DatasetReport's fields), or None when there is none."""
    return read_json_record(Path(dataset_dir) / REPORT_FILE)
