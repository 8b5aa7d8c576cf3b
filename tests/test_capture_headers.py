"""Inductor's precompiled headers at both ends: ``jitwarm capture`` runs a vLLM server with them off unless the line's
environment says otherwise, records the setting, and ``prestart`` warns where the node's setting would make the
restored start run a compiler (precompile/servers/vllm/caches.py ``headers_differ``)."""

from __future__ import annotations

import pytest

from jitwarm.precompile.manifest import capture_of, read_manifest
from jitwarm.precompile.servers.vllm.caches import PCH_ENV, headers_differ

#: What a capture with the headers off records (vLLM's AOT tree: C++ modules, no header) and with them on.
AOT = "torch_aot_compile/17b2d2c1/inductor_cache"
OFF = {"vllm_compile": [f"{AOT}/rg/crgw5rvy", f"{AOT}/fxgraph/sp/fspj43/onqtv", "torch_aot_compile/17b2d2c1/rank_0_0"]}
ON = {**OFF, "inductor": ["precompiled_headers/c5ab12"]}


@pytest.mark.parametrize(("given", "recorded"), [(None, "0"), ("1", "1")])
def test_capture_turns_the_headers_off_unless_given_and_records_it(stand_in, given, recorded):
    env = {} if given is None else {PCH_ENV: given}
    done = stand_in.capture(stand_in.vllm_line(), env=env)

    assert done.returncode == 0, done.stderr
    assert capture_of(read_manifest(stand_in.manifest))["environment"][PCH_ENV] == recorded
    assert f"{PCH_ENV}={recorded}" in done.stdout  # the next step names the server's environment


@pytest.mark.parametrize(("units", "node", "warned"), [
    (OFF, {PCH_ENV: "0"}, None),
    (OFF, {}, "built with Inductor's precompiled headers off and this node's are on"),  # torch's default: on
    (OFF, {PCH_ENV: "1"}, "this node's are on"),
    (ON, {}, None),
    (ON, {PCH_ENV: "0"}, "precompiled headers are not used"),
    ({"vllm_modelinfo": ["vllm-model_executor-models-llama-LlamaForCausalLM.json"]}, {}, None),  # no C++ module
])
def test_prestart_warns_where_the_nodes_setting_differs_from_the_captures(units, node, warned):
    said = headers_differ(units, node, captured={PCH_ENV: "0"} if units is OFF else None)

    assert (said == []) if warned is None else (len(said) == 1 and warned in said[0] and PCH_ENV in said[0]), said


def test_units_without_a_capture_record_say_nothing_of_how_their_kernels_were_built():
    """A hand-made tree or an older manifest has no capture record: no header among its units is no evidence that
    capture turned the headers off, and a node on torch's default is not warned."""
    assert headers_differ(OFF, {}, captured=None) == [] and headers_differ(OFF, {}, captured={}) == []
