"""Regeneration: the target writes the assistant turn of each prompt, through one of three generators, into a
crash-safe log that a re-run resumes.

    generator = open_generator(config.dataset.generation, target_path, tokenizer)   # hf | sglang | openai
    log = ResponseLog(RUN/dataset/responses-<key>.log)
    accounting = regenerate(items, generator, log, max_attempts=4, progress=cb)

Generators (one interface: `answer(url, item) -> Answer`, or `answer_batch(items)` for the local one):
- hf: transformers in this process, batched greedy or sampled decoding (small targets, the demo);
- sglang, openai: served engines (eyas.dataset.served: the requests, the forms an OpenAI-compatible server
  accepts, the worker threads with retries and a circuit breaker). Where the server returns no token ids the
  text is re-tokenized and the report says so (`token_ids_source: retokenized`: the ids may differ from the
  ones the target sampled; `fallbacks` names the server and the answer that refused them).

The log (`ResponseLog`): one record a line, `xxh3-128:<digest> {id, status, output_ids, finish_reason,
token_ids_source, attempts, reason}`, the digest that of the JSON after it (eyas.checksum); lines are written and flushed one by
one and fsynced at least every second, so a kill -9 loses at most the requests in flight (a torn last line
is dropped on reading; a damaged line before it is an error naming it). A re-run asks only for the prompts
without an answered record; an id answered twice keeps its first answer, so no prompt is answered twice in
the table. Accounting: answered + failed + skipped = input, with reasons. When the circuit breaker has taken
out every server, the stage stops at once with a DatasetError naming each server and its last answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from eyas.checksum import checksum_bytes
from eyas.dataset.prompts import DatasetError
from eyas.dataset.served import (
    Answer,
    Item,
    NoServerLeft,
    OpenAIGenerator,
    RequestFailed,
    Sampling,
    SGLangGenerator,
    serve,
)

__all__ = ["Accounting", "Answer", "HFGenerator", "Item", "OpenAIGenerator", "RequestFailed", "ResponseLog",
           "Sampling", "SGLangGenerator", "regenerate"]  # fmt: skip

log = logging.getLogger("eyas.dataset")
LOG_EVERY_S = 30.0
FSYNC_EVERY_S = 1.0


@dataclass
class Accounting:
    input: int
    answered: int = 0
    failed: int = 0
    skipped: int = 0
    failed_reasons: dict[str, int] = field(default_factory=dict)
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    retried: int = 0
    resumed_answered: int = 0  # answered records found in the log at start
    token_ids_source: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, list[str]] = field(default_factory=dict)  # server -> what it refused, what that means
    servers_taken_out: dict[str, str] = field(default_factory=dict)  # server -> why (the circuit breaker)

    def check(self) -> None:
        if self.answered + self.failed + self.skipped != self.input:
            raise DatasetError(
                f"regeneration accounting: {self.answered} answered + {self.failed} failed + {self.skipped} "
                f"skipped != {self.input} input prompts; expected every prompt accounted for once"
            )

    def to_dict(self) -> dict:
        return asdict(self)


# ---- the log ----------------------------------------------------------------------------------------------


def _sealed(record: dict) -> bytes:
    body = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
    return checksum_bytes(body).encode() + b" " + body + b"\n"


class ResponseLog:
    """Append-only, checksummed records of the answers; see the module docstring."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file = None
        self._last_sync = 0.0

    def read(self) -> dict[str, dict]:
        """id -> its record: the first answered one, else the last failed one. A torn last line is cut off."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        complete, newline, tail = data.rpartition(b"\n")  # bytes after the last newline: a write cut short
        records: dict[str, dict] = {}
        for i, line in enumerate(complete.split(b"\n") if newline else []):
            record = self._parse(line)
            if record is None:
                raise DatasetError(
                    f"{self.path}: line {i + 1} is damaged (not a record, or its checksum differs); expected only a "
                    "last line without its newline after a crash: delete that line to re-ask its prompt, or move "
                    "the file away to regenerate everything"
                )
            known = records.get(record["id"])
            if known is None or (known["status"] != "answered" and record["status"] == "answered"):
                records[record["id"]] = record
        if tail:
            with open(self.path, "r+b") as f:  # drop the torn tail so appends start on a clean line
                f.truncate(len(complete) + len(newline))
        return records

    @staticmethod
    def _parse(line: bytes) -> dict | None:
        claimed, _, body = line.partition(b" ")
        if checksum_bytes(body).encode() != claimed:
            return None
        try:
            record = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return record if isinstance(record, dict) and "id" in record and "status" in record else None

    def append(self, record: dict) -> None:
        line = _sealed(record)
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "ab")
            self._file.write(line)
            self._file.flush()
            if time.monotonic() - self._last_sync >= FSYNC_EVERY_S:
                os.fsync(self._file.fileno())
                self._last_sync = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


# ---- generators -------------------------------------------------------------------------------------------


class HFGenerator:
    """The target through transformers in this process, batched (left padding); cut after the first EOS."""

    name = "hf"
    in_flight = 0

    def __init__(self, target, sampling: Sampling, batch_size: int, seed: int = 0):
        self.target, self.sampling, self.batch_size, self.seed = target, sampling, batch_size, seed

    def answer_batch(self, items: list[Item]) -> list[Answer]:
        import torch

        eos = self.target.eos_token_id
        pad = eos if eos is not None else 0
        prompts = [it.prompt_ids for it in items]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sample = self.sampling.temperature > 0
        extra = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p} if sample else {}
        if sample:
            torch.manual_seed(self.seed)
        with torch.no_grad():
            gen = self.target.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=self.sampling.max_new_tokens, do_sample=sample,
                pad_token_id=pad, eos_token_id=eos, **extra,
            )  # fmt: skip
        answers = []
        for row in gen[:, width:].tolist():
            reason = "length"
            if eos is not None and eos in row:
                row, reason = row[: row.index(eos) + 1], "stop"
            answers.append(Answer(row, reason, "local"))
        return answers


# ---- the loop ---------------------------------------------------------------------------------------------


def _record(item: Item, answer: Answer | None, attempts: int, reason: str = "") -> dict:
    if answer is None:
        return {"id": item.id, "status": "failed", "attempts": attempts, "reason": reason}
    return {"id": item.id, "status": "answered", "output_ids": answer.output_ids, "attempts": attempts,
            "finish_reason": answer.finish_reason, "token_ids_source": answer.token_ids_source}  # fmt: skip


class _Progress:
    def __init__(self, total: int, done: int, callback: Callable | None):
        self.total, self.done, self.first, self.tokens, self.callback = total, done, done, 0, callback
        self.start = self.last_log = time.monotonic()
        self.lock = threading.Lock()
        self._send()

    def add(self, tokens: int) -> None:
        with self.lock:
            self.done += 1
            self.tokens += tokens
            self._send()

    def _send(self) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate, new = self.tokens / elapsed, self.done - self.first
        eta = round((self.total - self.done) * elapsed / new, 1) if new else None
        info = {"samples_done": self.done, "samples_total": self.total, "tokens_per_s": round(rate, 1), "eta_s": eta}
        if self.callback:
            self.callback(info)
        if time.monotonic() - self.last_log >= LOG_EVERY_S:
            self.last_log = time.monotonic()
            log.info("regeneration: %d/%d answered, %.1f tokens/s, ETA %s s", self.done, self.total, rate, eta)


def regenerate(
    items: list[Item],
    generator,
    response_log: ResponseLog,
    *,
    max_attempts: int,
    skipped: dict[str, str] | None = None,
    progress: Callable | None = None,
) -> tuple[dict[str, dict], Accounting]:
    """Answer every item not answered in the log yet; (id -> record, accounting over items + skipped)."""
    skipped = skipped or {}
    records = response_log.read()
    todo = [it for it in items if (records.get(it.id) or {}).get("status") != "answered"]
    acct = Accounting(input=len(items) + len(skipped), resumed_answered=len(items) - len(todo))
    bar = _Progress(len(items), len(items) - len(todo), progress)
    new: dict[str, dict] = {}

    def keep(record: dict) -> None:
        response_log.append(record)
        new[record["id"]] = record
        if record["status"] == "answered":
            bar.add(len(record["output_ids"]))

    try:
        if isinstance(generator, HFGenerator):
            for start in range(0, len(todo), generator.batch_size):
                chunk = todo[start : start + generator.batch_size]
                for item, answer in zip(chunk, generator.answer_batch(chunk), strict=True):
                    keep(_record(item, answer, 1))
        else:
            stats = serve(todo, generator, keep, max_attempts, _record)
            acct.retried, acct.servers_taken_out, acct.fallbacks = stats.retried, stats.taken_out, generator.fallbacks
    except NoServerLeft as err:
        raise DatasetError(
            f"regeneration stopped: no server left to ask, {err.not_answered} of {len(todo)} prompts not answered; "
            + "; ".join(f"{url} {why}" for url, why in err.taken_out.items())
            + f"; the {len(items) - len(todo) + sum(r['status'] == 'answered' for r in new.values())} answers so far "
            f"are kept in {response_log.path}: fix or restart the server (its last answer says what went wrong) and "
            "re-run the stage, which asks only for the missing ones"
        ) from err
    finally:
        response_log.close()
    for url, notes in acct.fallbacks.items():
        log.warning("regeneration: %s: %s", url, "; ".join(notes))
    for url, why in acct.servers_taken_out.items():
        log.warning("regeneration: %s %s; the other servers answered its prompts", url, why)
    records.update(new)
    final = {it.id: records[it.id] for it in items if it.id in records}
    acct.answered = sum(1 for r in final.values() if r["status"] == "answered")
    failed = [r for r in final.values() if r["status"] == "failed"]
    acct.failed = len(failed) + (len(items) - len(final))
    acct.failed_reasons = dict(Counter(r["reason"] for r in failed))
    acct.skipped = len(skipped)
    acct.skipped_reasons = dict(Counter(skipped.values()))
    acct.token_ids_source = dict(Counter(r["token_ids_source"] for r in final.values() if r["status"] == "answered"))
    acct.check()
    return final, acct
