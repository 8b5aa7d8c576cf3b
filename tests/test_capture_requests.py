"""The first requests ``jitwarm capture`` sends a ready server (precompile/warm_requests.py), on the stand-in server.

The stand-in (tests/workers/capture_stand_in.py) answers ``/v1/models`` and every POST under ``/v1/``, notes each
request, and "compiles" a unit at the first request that asks for logprobs, as vLLM's logprobs op does; at its
stopping signal it stores the units and writes the ledger at stop, as jitwarm's plugin does in the server. The real
server's first requests are tests/test_real_server.py's.
"""

from __future__ import annotations

import json

import pytest
from workers.capture_harness import error_lines
from workers.capture_stand_in import DEFAULT_UNIT, FIRST_USE_UNIT

from jitwarm.precompile import warm_requests
from jitwarm.precompile.manifest import read_manifest

#: The stand-in compiles at the first request that asks for logprobs.
FIRST_USE = {"STAND_IN_FIRST_USE": "1"}


def sent(stand_in) -> list[dict]:
    path = stand_in.out / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_capture_sends_the_first_requests_after_ready_and_captures_what_they_compiled(stand_in, tmp_path):
    done = stand_in.capture(stand_in.vllm_line(), "--json", env=FIRST_USE)

    assert done.returncode == 0, done.stderr
    requests = sent(stand_in)
    assert [r["path"] for r in requests] == [r.path for r in warm_requests.DEFAULT]
    assert all(r["body"]["model"] == "stand-in/model" for r in requests)  # the first model /v1/models lists
    assert any("logprobs" in r["body"] for r in requests) and any("messages" in r["body"] for r in requests)
    assert any({"top_p", "top_k"} <= r["body"].keys() for r in requests)
    assert any(isinstance(r["body"].get("prompt"), list) for r in requests)  # a batch
    units = {r["unit"] for r in read_manifest(stand_in.manifest) if r["kind"] == "jit_cache"}
    assert units == {DEFAULT_UNIT, FIRST_USE_UNIT}  # stored at the stopping signal
    out = json.loads(done.stdout)
    assert out["warm_requests"] == 4 and out["units"] == {"inductor": 2} and out["unrecorded"] == []
    assert out["compiled_after_ready"]["families"]["inductor"] == 1, out["compiled_after_ready"]
    assert "sending 4 first requests" in done.stderr
    # what the start answered is kept beside the manifest, in the order sent, each with the body as sent
    kept = [json.loads(line) for line in open(out["answers"])]
    assert out["answers"] == str(stand_in.manifest.with_name("server.answers.jsonl"))
    assert [(a["path"], a["body"], a["status"]) for a in kept] == [(r["path"], r["body"], 200) for r in requests]
    assert [warm_requests.comparable(a["answer"]) for a in kept] == [
        [{"text": json.dumps(r["body"].get("prompt", r["body"].get("messages"))), "message": None, "logprobs": None,
          "finish_reason": "length"}] for r in requests]


def test_the_ledger_command_says_what_compiled_after_ready_per_family(stand_in, tmp_path):
    ledger = tmp_path / "ledger.json"
    done = stand_in.capture(stand_in.vllm_line(), env={**FIRST_USE, "JITWARM_LEDGER": str(ledger)})
    assert done.returncode == 0, done.stderr

    said = stand_in.run("ledger", str(tmp_path / "ledger.stop.json"))
    assert said.returncode == 0, said.stderr
    assert "jitwarm: ledger: compiled after ready: 1 (inductor 1)" in said.stdout.splitlines()
    gate = stand_in.run("ledger", str(tmp_path / "ledger.stop.json"), "--require-zero")
    assert gate.returncode == 1
    assert "jitwarm: the 4 first requests compiled 1 more (inductor 1), captured too" in done.stdout


def test_warm_requests_replays_the_operators_requests_instead(stand_in, tmp_path):
    mine = tmp_path / "requests.jsonl"
    mine.write_text('# my traffic\n{"path": "/v1/completions", "body": {"prompt": "Hi", "logprobs": 1}}\n\n'
                    '{"path": "/v1/chat/completions", "body": {"model": "named", "messages": []}}\n')
    done = stand_in.capture(stand_in.vllm_line(), "--warm-requests", str(mine))

    assert done.returncode == 0, done.stderr
    assert sent(stand_in) == [{"path": "/v1/completions", "body": {"prompt": "Hi", "logprobs": 1,
                                                                   "model": "stand-in/model"}},
                              {"path": "/v1/chat/completions", "body": {"model": "named", "messages": []}}]


def test_a_request_the_server_refuses_is_a_warning_naming_it(stand_in, tmp_path):
    mine = tmp_path / "requests.jsonl"
    mine.write_text('{"path": "/nowhere", "body": {}}\n')
    done = stand_in.capture(stand_in.vllm_line(), "--warm-requests", str(mine))

    assert done.returncode == 0, done.stderr
    assert "warm request requests.jsonl:1 (/nowhere) answered HTTP 404" in done.stderr


@pytest.mark.parametrize(("text", "said"), [
    (None, "cannot read it"),
    ("", "no request in it"),
    ("{not json\n", ":1: not JSON"),
    ('{"path": "/v1/completions"}\n', ":1: each line is an object"),
    ('{"path": "v1/completions", "body": {}}\n', ":1: each line is an object"),
    ('# a comment\n{"path": "/v1/completions", "body": {}, "extra": 1}\n', ":2: each line is an object"),
    ("[1, 2]\n", ":1: each line is an object"),
])
def test_a_bad_warm_requests_file_is_exit_2_in_one_line_before_the_server_starts(stand_in, tmp_path, text, said):
    mine = tmp_path / "requests.jsonl"
    if text is not None:
        mine.write_text(text)
    done = stand_in.capture(stand_in.vllm_line(), "--warm-requests", str(mine))

    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and said in error_lines(done)[0], done.stderr
    assert not stand_in.started() and not stand_in.manifest.exists()
