"""The real servers' captures send, after the default first requests, greedy ones whose answers a restored start
must repeat: capture keeps what its cold start answered (``server.answers.jsonl``, precompile/warm_requests.py),
so the restored start's answers are compared with a cold start's without starting a second cold server.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jitwarm.precompile import warm_requests


def write_requests(path: Path, extra: Iterable[tuple[str, dict[str, Any]]]) -> Path:
    """``--warm-requests`` ``path``: capture's default first requests, then ``extra`` (``(path, body)`` each)."""
    lines = [{"path": r.path, "body": r.body} for r in warm_requests.DEFAULT]
    lines += [{"path": where, "body": body} for where, body in extra]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def greedy(body: dict[str, Any]) -> bool:
    """True for a request any start of the same model answers alike: temperature 0 (OpenAI's or sglang's own)."""
    return body.get("temperature", body.get("sampling_params", {}).get("temperature")) == 0


def kept(path: str | Path) -> list[dict[str, Any]]:
    """What capture kept of its start's answers (:func:`jitwarm.precompile.capture.answers_path`)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def compared(cold: Sequence[dict[str, Any]], restored: Sequence[warm_requests.Answered]) -> tuple[list, list]:
    """The cold start's and the restored start's greedy answers, each as :func:`warm_requests.comparable` sees it."""
    assert [a["body"] for a in cold] == [a.body for a in restored]  # the same requests, in the same order
    return ([warm_requests.comparable(a["answer"]) for a in cold if greedy(a["body"])],
            [warm_requests.comparable(a.answer) for a in restored if greedy(a.body)])
