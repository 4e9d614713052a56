"""The circuit breaker of served regeneration (eyas.dataset.served._Breaker): which failures take a server out.
The whole path against real servers is in test_transformers_serve.py and test_regeneration.py."""

from __future__ import annotations

from eyas.dataset.served import BREAKER_FAILURES, RequestFailed, _Breaker

URL = "http://a"


def test_a_server_is_taken_out_after_its_failures_in_a_row_only():
    breaker = _Breaker([URL])
    for _ in range(BREAKER_FAILURES - 1):
        breaker.failure(URL, RequestFailed("POST http://a/generate: HTTP 500: boom", 500))
    breaker.success(URL)  # an answer between them: the count starts again
    for _ in range(BREAKER_FAILURES - 1):
        breaker.failure(URL, RequestFailed("POST http://a/generate: cannot reach the server (ConnectError: x)"))
    assert not breaker.is_out(URL)
    breaker.failure(URL, RequestFailed("POST http://a/generate: cannot reach the server (ConnectError: y)"))
    assert breaker.is_out(URL) and breaker.out[URL] == (
        f"was taken out after {BREAKER_FAILURES} failed requests in a row; its last answer: POST http://a/generate: "
        "cannot reach the server (ConnectError: y)"
    )


def test_a_refusal_counts_only_while_the_server_has_answered_nothing():
    """A server refusing everything from the start (a wrong model name) is taken out; one that answers others and
    refuses a prompt (too long for its context) is not: the prompt is at fault."""
    refusal = RequestFailed("POST http://a/v1/completions: HTTP 400: maximum context length", 400)
    assert refusal.refused and not RequestFailed("HTTP 429: slow down", 429).refused
    assert not RequestFailed("HTTP 503", 503).refused and not RequestFailed("no answer").refused
    fresh, answering = _Breaker([URL]), _Breaker([URL])
    answering.success(URL)
    for _ in range(2 * BREAKER_FAILURES):
        fresh.failure(URL, refusal)
        answering.failure(URL, refusal)
    assert fresh.is_out(URL) and not answering.is_out(URL)
