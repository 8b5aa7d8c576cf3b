"""The first requests ``jitwarm capture`` sends a ready server: what a server compiles on first use, compiled then.

A server's start is not all it compiles: vLLM's logprobs op is ``@torch.compile`` (``v1/sample/ops/logprobs.py:10``)
and compiles at the first request that asks for logprobs, on every fresh or restored node (Dynamo, Inductor, g++).
Capture sends, after ready and before it stops the server, requests that take those paths: a completion with
logprobs, a chat completion, sampling with ``top_p`` and ``top_k``, and a batch (a list prompt). vLLM and sglang
both speak ``/v1/completions`` and ``/v1/chat/completions``.

``--warm-requests FILE`` replaces them with an operator's own, one JSON object a line (``#`` lines and blank lines
skipped)::

    {"path": "/v1/completions", "body": {"prompt": "Hello", "max_tokens": 8, "logprobs": 5}}
    {"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Hi"}]}}

``path`` is the server's URL path (``/`` first), ``body`` the JSON it is POSTed; a body without ``model`` gets the
first model the server's ``/v1/models`` lists. The file is read before the server starts: a bad one is a usage
error (exit 2), one line.

Capture keeps what the cold start answered (:func:`write_answers`, beside the manifest): a request with
``"temperature": 0`` is answered alike by any start that computes the same model, so a restored node sent the same
requests must give the same answers (:func:`comparable`), the check that a restored artifact is the model's.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import UsageError

#: Seconds one request may take: the first that asks for logprobs compiles the op (half a minute on a busy CPU box).
REQUEST_TIMEOUT_S = 600.0
#: The most of a file read (an operator's requests, not a data set).
_MAX_BYTES = 16 << 20
#: A server answers HTTP errors with a short JSON body; the most of it said.
_SAID = 300
#: The most of an answer that is not JSON kept.
_MAX_ANSWER = 4096


@dataclass(frozen=True)
class WarmRequest:
    """One POST: the server's URL ``path`` and its JSON ``body`` (``model`` filled in when absent)."""

    path: str
    body: dict[str, Any]
    what: str


#: What a server compiles on first use (the module docstring): greedy with logprobs, chat, top-p/top-k sampling,
#: and a batch of three prompts in one request.
DEFAULT = (
    WarmRequest("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 5},
                "a completion with logprobs"),
    WarmRequest("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
                "a chat completion"),
    WarmRequest("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0.8, "top_p": 0.9,
                                    "top_k": 5}, "sampling with top_p and top_k"),
    WarmRequest("/v1/completions", {"prompt": ["Hello", "The capital of France is", "1, 2, 3,"], "max_tokens": 4,
                                    "logprobs": 2}, "a batch of three prompts"),
)


def read(path: str | Path) -> tuple[WarmRequest, ...]:
    """The requests of an operator's file (see the module docstring); UsageError naming the line that is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"--warm-requests {path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > _MAX_BYTES:
        raise UsageError(f"--warm-requests {path}: over {_MAX_BYTES >> 20} MiB: give the requests to warm, not a "
                         "data set")
    found = []
    for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"--warm-requests {path}:{number}: not JSON ({exc})") from None
        if not isinstance(item, dict) or set(item) - {"path", "body"} or not isinstance(item.get("body"), dict) \
                or not isinstance(item.get("path"), str) or not item["path"].startswith("/"):
            raise UsageError(f"--warm-requests {path}:{number}: each line is an object "
                             '{"path": "/v1/...", "body": {...}} and nothing else')
        found.append(WarmRequest(item["path"], item["body"], f"{Path(path).name}:{number}"))
    if not found:
        raise UsageError(f"--warm-requests {path}: no request in it")
    return tuple(found)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no http_proxy


def _call(url: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    """``(status, answer)`` of a GET (``body`` None) or a JSON POST; OSError when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def served_model(base: str) -> str | None:
    """The first model id the server at ``base`` lists (``/v1/models``), None when it lists none."""
    try:
        status, answer = _call(f"{base}/v1/models", timeout=30)
        models = json.loads(answer).get("data") if status == 200 else None
        return str(models[0]["id"]) if models else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class Answered:
    """What the server answered one request: its ``status`` and JSON ``answer`` (the text where it is not JSON)."""

    request: WarmRequest
    body: dict[str, Any]
    status: int
    answer: Any

    @property
    def failure(self) -> str | None:
        """The warning line for an answer that is not 2xx, else None."""
        if 200 <= self.status < 300:
            return None
        said = (self.answer if isinstance(self.answer, str) else json.dumps(self.answer)).strip()
        return (f"warm request {self.request.what} ({self.request.path}) answered HTTP {self.status}: "
                f"{said.replace(chr(10), ' ')[:_SAID]}")

    def as_json(self) -> dict[str, Any]:
        """One line of :func:`write_answers`: the request as sent and what it was answered."""
        return {"what": self.request.what, "path": self.request.path, "body": self.body, "status": self.status,
                "answer": self.answer}


def send(health_url: str, requests: Sequence[WarmRequest]) -> list[Answered]:
    """Send ``requests`` one after another to the server whose health endpoint is ``health_url``; each answer.

    OSError when the server stops answering at all.
    """
    parts = urllib.parse.urlsplit(health_url)
    base = f"{parts.scheme}://{parts.netloc}"
    model = served_model(base)
    answered = []
    for request in requests:
        body = dict(request.body)
        if "model" not in body and model is not None:
            body["model"] = model
        status, answer = _call(f"{base}{request.path}", body)
        text = answer.decode(errors="replace")
        try:
            parsed: Any = json.loads(text)
        except ValueError:
            parsed = text[:_MAX_ANSWER]
        answered.append(Answered(request, body, status, parsed))
    return answered


def write_answers(path: Path, answered: Sequence[Answered]) -> None:
    """The answers, one JSON object a line (:meth:`Answered.as_json`), written whole; OSError if it cannot."""
    from jitwarm.cache.files import write_atomic

    text = "".join(json.dumps(a.as_json(), sort_keys=True) + "\n" for a in answered)
    write_atomic(path, text.encode(), durable=False)


def comparable(answer: Any) -> Any:
    """What two starts of the same model answer alike to a ``temperature`` 0 request.

    Each choice's text, message, logprobs and finish reason, or sglang's native ``/generate`` output ids; not the
    ids, times and usage that differ per start.
    """
    if isinstance(answer, list):
        return [comparable(a) for a in answer]
    if not isinstance(answer, dict):
        return answer
    if "choices" in answer:
        return [{k: c.get(k) for k in ("text", "message", "logprobs", "finish_reason")}
                for c in answer["choices"]]
    if "output_ids" in answer:
        return answer["output_ids"]
    return answer
