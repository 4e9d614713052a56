"""Regeneration through served engines: the request each generator sends, the forms an OpenAI-compatible server
accepts, and the worker threads that share the prompts among the servers with a circuit breaker.

    stats = serve(todo, generator, keep, max_attempts=4)     # generator: SGLangGenerator | OpenAIGenerator

- sglang: SGLang's POST /generate with `input_ids` (managers/io_struct.py GenerateReqInput), so the tokens trained
  on are the ones the target produced (`output_ids` of the answer): no re-tokenization.
- openai: any OpenAI-compatible server. Its preferred form is `/v1/completions` with the prompt's token ids, or
  `/v1/chat/completions` with the messages, both with `return_token_ids` (vLLM >= 0.10.2 answers with
  `choices[0].token_ids`, vllm/entrypoints/openai/protocol.py; SGLang's /v1 takes ids as the prompt). Other
  servers refuse what the OpenAI API does not define: `transformers serve` answers `return_token_ids` with HTTP
  422 ("Unexpected fields in the request", transformers/cli/serving/utils.py BaseHandler._validate_request) and a
  prompt of token ids with HTTP 400 ("prompt must be a string.", serving/completion.py). So the first requests to
  each server go down a ladder of forms (`FORMS`), richest first, until one is not refused (a 4xx answer); that
  form is kept for the server, for every later prompt (the refusals are paid once a server, not once a prompt),
  and `fallbacks` says what was dropped and why. Without `return_token_ids` the answer's text is re-tokenized
  (`token_ids_source: retokenized`: the ids may differ from the ones the target sampled); a prompt sent as text
  is tokenized by the server itself.

Every server URL gets `max_in_flight` worker threads that take requests from one queue, so a slow server takes
less of the work. A failed request is retried (up to `max_attempts`, backoff 0.5 s doubling to 8 s, on any
server), except a refusal (HTTP 4xx but 408 and 429): the same request would be refused again, so it is recorded
failed at once. An answer the server aborted (HTTP 200 with finish_reason "abort" and the tokens decoded until
then) is a failed request, never a response. Circuit breaker: a server whose last `BREAKER_FAILURES` requests
all failed (a refusal counts only while the server has answered nothing: a wrong model name; afterwards it is
the prompt's fault) is taken out for the rest of the run, its requests going to the others; with no server
left the stage stops at once (`NoServerLeft`), naming each server and its last answer.
"""

from __future__ import annotations

import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable

import httpx

BREAKER_FAILURES = 8
TRANSIENT_4XX = (408, 429)  # request timeout, too many requests: the same request may pass later


@dataclass
class Item:
    """One prompt to answer: its id, its tokens, its turns (for a chat endpoint)."""

    id: str
    prompt_ids: list[int]
    turns: list[dict]


@dataclass
class Answer:
    output_ids: list[int]
    finish_reason: str
    token_ids_source: str  # "local" (hf), "server" (ids from the server), "retokenized" (text re-encoded)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0


class RequestFailed(RuntimeError):
    """One request did not produce an answer. `status`: the HTTP status of the answer (None: no answer at all);
    a refusal (4xx but 408, 429) is not retried."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def refused(self) -> bool:
        return self.status is not None and 400 <= self.status < 500 and self.status not in TRANSIENT_4XX


class NoServerLeft(RuntimeError):
    """Every server was taken out by the circuit breaker; `taken_out`: url -> why."""

    def __init__(self, taken_out: dict[str, str], not_answered: int):
        self.taken_out, self.not_answered = taken_out, not_answered
        super().__init__("; ".join(f"{url} {why}" for url, why in taken_out.items()))


def post(url: str, body: dict, timeout_s: float) -> dict:
    """POST JSON; any failure is a RequestFailed with the HTTP status (None when nothing answered)."""
    try:
        resp = httpx.post(url, json=body, timeout=timeout_s)
    except httpx.TimeoutException as err:
        raise RequestFailed(f"POST {url}: no answer within {timeout_s} s") from err
    except httpx.TransportError as err:  # refused, reset, DNS
        raise RequestFailed(f"POST {url}: cannot reach the server ({type(err).__name__}: {err})") from err
    if resp.status_code != 200:
        raise RequestFailed(f"POST {url}: HTTP {resp.status_code}: {resp.text[:300]}", resp.status_code)
    try:
        return resp.json()
    except ValueError as err:
        raise RequestFailed(f"POST {url}: the answer is not JSON ({err}): {resp.text[:200]!r}", 200) from err


def _aborted(message) -> str:
    """The reason of an answer the server aborted, which is no response: SGLang answers a request stopped by
    /abort_request (Scheduler.abort_request sets FINISH_ABORT(), managers/schedule_batch.py) or dropped from its
    waiting queue with HTTP 200, the tokens decoded so far and finish_reason {"type": "abort", "message": ...}
    (TokenizerManager._handle_abort_finish_reason turns only an abort with a status code into an HTTP error);
    its /v1 endpoints and vLLM's say finish_reason "abort"."""
    return f"aborted by the server (finish_reason abort{f': {message}' if message else ''})"


class SGLangGenerator:
    """SGLang's /generate with input_ids; the answer's output_ids are the tokens kept."""

    name = "sglang"

    def __init__(self, urls: list[str], sampling: Sampling, in_flight: int, timeout_s: float):
        self.urls, self.sampling, self.in_flight, self.timeout_s = list(urls), sampling, in_flight, timeout_s
        self.fallbacks: dict[str, list[str]] = {}

    def answer(self, url: str, item: Item) -> Answer:
        params = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                  "max_new_tokens": self.sampling.max_new_tokens}  # fmt: skip
        body = {"input_ids": item.prompt_ids, "rid": f"eyas-gen-{uuid.uuid4().hex}", "sampling_params": params}
        answer = post(f"{url}/generate", body, self.timeout_s)
        ids = answer.get("output_ids") if isinstance(answer, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise RequestFailed(f"answer without output_ids: {str(answer)[:200]}", 200)
        finish = (answer.get("meta_info") or {}).get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise RequestFailed(_aborted(finish.get("message")), 200)
        return Answer(ids, str(finish.get("type", "unknown")), "server")


@dataclass(frozen=True)
class Form:
    """How a request to an OpenAI-compatible server is written: the prompt as token ids (completions) or as text,
    with or without `return_token_ids`."""

    ids_prompt: bool
    return_token_ids: bool


FORMS = {  # richest first; a server keeps the first form it does not refuse
    "completions": (Form(True, True), Form(True, False), Form(False, True), Form(False, False)),
    "chat": (Form(False, True), Form(False, False)),
}
RETOKENIZED = "the answers' text is re-tokenized (token_ids_source: retokenized: the ids may differ from the ones the target sampled)"  # fmt: skip
AS_TEXT = "the prompt is sent as its text, which the server tokenizes itself"


def dropped(kept: Form, refused: dict[Form, str]) -> list[str]:
    """What keeping `kept` after the refusals `refused` (form -> the answer) gives up, and the answers saying so."""
    notes = []
    if not kept.return_token_ids:
        why = next((a for f, a in refused.items() if f.return_token_ids and f.ids_prompt == kept.ids_prompt), "")
        notes.append(f"return_token_ids refused ({why or next(iter(refused.values()))}): {RETOKENIZED}")
    if not kept.ids_prompt and any(f.ids_prompt for f in refused):
        why = next((a for f, a in refused.items() if f.ids_prompt and not f.return_token_ids), "")
        notes.append(f"token ids as the prompt refused ({why or next(iter(refused.values()))}): {AS_TEXT}")
    return notes


class OpenAIGenerator:
    """An OpenAI-compatible server: /v1/completions with token ids (or /v1/chat/completions with messages), in the
    richest form each server accepts (module docstring)."""

    name = "openai"

    def __init__(self, urls, sampling: Sampling, in_flight: int, timeout_s: float, *, model: str, endpoint: str,
                 tokenizer):  # fmt: skip
        self.urls, self.sampling, self.in_flight, self.timeout_s = list(urls), sampling, in_flight, timeout_s
        self.model, self.endpoint, self.tokenizer = model, endpoint, tokenizer
        self.forms: dict[str, Form] = {}  # url -> the form it accepted
        self.fallbacks: dict[str, list[str]] = {}  # url -> what its form gave up, and why
        self._probing = {url: threading.Lock() for url in self.urls}

    def answer(self, url: str, item: Item) -> Answer:
        form = self.forms.get(url)
        if form is not None:
            return self._ask(url, item, form)
        with self._probing[url]:  # one worker finds the form; the others wait for it
            if url in self.forms:
                return self._ask(url, item, self.forms[url])
            refused: dict[Form, str] = {}
            for form in FORMS[self.endpoint]:
                try:
                    answer = self._ask(url, item, form)
                except RequestFailed as err:
                    if err.status is None:  # no answer: nothing learned about the forms
                        raise
                    if not err.refused:  # past the server's request checks: the form is taken
                        self._settle(url, form, refused)
                        raise
                    refused[form], last = str(err).removeprefix(f"POST {url}{self._path()}: "), err
                    continue
                self._settle(url, form, refused)
                return answer
            raise RequestFailed(f"every form of request refused; the last: {last}", last.status)

    def _settle(self, url: str, form: Form, refused: dict[Form, str]) -> None:
        """The server took `form` (it answered, or failed past its request checks): kept for every later prompt."""
        self.forms[url] = form
        if refused:
            self.fallbacks[url] = dropped(form, refused)

    def _path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def _ask(self, url: str, item: Item, form: Form) -> Answer:
        body = {"model": self.model, "max_tokens": self.sampling.max_new_tokens,
                "temperature": self.sampling.temperature, "top_p": self.sampling.top_p}  # fmt: skip
        if form.return_token_ids:  # vLLM (>= 0.10.2) then puts the generated ids in choices[0].token_ids
            body["return_token_ids"] = True
        if self.endpoint == "chat":
            body["messages"] = item.turns
        else:
            body["prompt"] = item.prompt_ids if form.ids_prompt else prompt_text(self.tokenizer, item.prompt_ids)
        answer = post(f"{url}{self._path()}", body, self.timeout_s)
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError) as err:
            raise RequestFailed(f"answer without choices[0]: {str(answer)[:200]}", 200) from err
        reason = str(choice.get("finish_reason") or "unknown")
        if reason == "abort":
            raise RequestFailed(_aborted(None), 200)
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return Answer(ids, reason, "server")
        text = (choice.get("message") or {}).get("content") if self.endpoint == "chat" else choice.get("text")
        if not isinstance(text, str):
            raise RequestFailed(f"answer without text or token_ids: {str(choice)[:200]}", 200)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if reason == "stop" and self.tokenizer.eos_token_id is not None:
            ids = ids + [self.tokenizer.eos_token_id]  # the end token the server does not return as text
        return Answer(ids, reason, "retokenized")


def prompt_text(tokenizer, ids: list[int]) -> str:
    """The prompt's text for a server that takes only text and tokenizes it with its special tokens (transformers
    serve: `tokenizer(prompt)`; vLLM's completions: add_special_tokens true): without the leading BOS the
    tokenizer adds again."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] == [bos] and tokenizer(text)["input_ids"][:2] == [bos, bos]:
        return tokenizer.decode(ids[1:], skip_special_tokens=False)
    return text


# ---- the worker threads -----------------------------------------------------------------------------------


@dataclass
class ServeStats:
    retried: int = 0
    taken_out: dict[str, str] = field(default_factory=dict)  # url -> why


class _Breaker:
    """Per server: its failures in a row, whether it ever answered, its last failure."""

    def __init__(self, urls: list[str]):
        self.lock = threading.Lock()
        self.in_a_row = dict.fromkeys(urls, 0)
        self.answered = dict.fromkeys(urls, False)
        self.last: dict[str, str] = {}
        self.out: dict[str, str] = {}
        self.taken_out = {url: threading.Event() for url in urls}  # set when out: wakes its workers' backoff

    def success(self, url: str) -> None:
        with self.lock:
            self.in_a_row[url], self.answered[url] = 0, True

    def failure(self, url: str, err: RequestFailed) -> None:
        with self.lock:
            self.last[url] = str(err)
            if err.refused and self.answered[url]:
                return  # the prompt's fault: this server answers others
            self.in_a_row[url] += 1
            if self.in_a_row[url] >= BREAKER_FAILURES and url not in self.out:
                self.out[url] = (
                    f"was taken out after {self.in_a_row[url]} failed requests in a row; its last answer: {err}"
                )
                self.taken_out[url].set()

    def is_out(self, url: str) -> bool:
        return self.taken_out[url].is_set()


def serve(todo: list[Item], generator, keep: Callable[[dict], None], max_attempts: int,
          record: Callable) -> ServeStats:  # fmt: skip
    """Worker threads per server URL over one queue (module docstring). `record(item, answer, attempts, reason)`
    builds a log record, `keep` stores it. Raises NoServerLeft when every server is taken out."""
    work: queue.Queue = queue.Queue()
    for item in todo:
        work.put((item, 1))
    pending, stats, lock = [len(todo)], ServeStats(), threading.Lock()
    breaker, stop = _Breaker(generator.urls), threading.Event()
    errors: list[BaseException] = []

    def worker(url: str) -> None:
        while not stop.is_set() and not breaker.is_out(url):
            try:
                item, attempt = work.get(timeout=0.05)
            except queue.Empty:
                with lock:
                    if pending[0] == 0:
                        return
                continue
            try:
                done = record(item, generator.answer(url, item), attempt)
                breaker.success(url)
            except RequestFailed as err:
                breaker.failure(url, err)
                if attempt < max_attempts and not err.refused:
                    with lock:
                        stats.retried += 1
                    breaker.taken_out[url].wait(min(0.5 * 2 ** (attempt - 1), 8.0))
                    work.put((item, attempt + 1))
                    continue
                done = record(item, None, attempt, f"{url}: {err}")
            except BaseException as err:  # a bug or an interrupt: stop every worker, raise it once
                errors.append(err)
                stop.set()
                return
            keep(done)
            with lock:
                pending[0] -= 1

    threads = [threading.Thread(target=worker, args=(url,), daemon=True) for url in generator.urls
               for _ in range(generator.in_flight)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    stats.taken_out = dict(breaker.out)
    if pending[0]:
        raise NoServerLeft(stats.taken_out, pending[0])
    return stats
