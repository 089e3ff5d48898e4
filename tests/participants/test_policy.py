"""The policy's lineage rules: the ledger shared by worker processes, the context digest, the
oldest contributing policy version, constrained requests classified from the request, and cut
skips and refusals counted as metrics and logged."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from rolloutlog.participants import (
    GenerationPrefix,
    MemoryLedger,
    Policy,
    SharedLedger,
    constrained_request,
    fingerprint,
)
from rolloutlog.participants._ledger import LedgerRowInfo
from tests.participants.conftest import RUN, World


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def row(call_id: str, fp: str, context: str = "ctx", worker: str | None = "w0") -> LedgerRowInfo:
    return LedgerRowInfo(call_id, None, fp, context, 1, 0, 3, "d", None, False, worker)


def _put_in_another_process(path: str) -> None:
    ledger = SharedLedger(path, "w1")
    ledger.put("e1", row("c1", "fp-1", worker="w1"))
    ledger.close()


def test_a_row_recorded_by_one_worker_process_resolves_in_another(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.sqlite")
    SharedLedger(path, "supervisor").close()
    process = multiprocessing.get_context("spawn").Process(
        target=_put_in_another_process, args=(path,)
    )
    process.start()
    process.join(30)
    assert process.exitcode == 0
    here = SharedLedger(path, "w0")
    [found] = here.matching("e1", "fp-1")
    assert (found.call_id, found.recorded_by) == ("c1", "w1")
    assert here.get("e1", "c1") == found and here.matching("e2", "fp-1") == []
    # restored rows never overwrite what is there; a cut is claimed once across workers
    assert (
        here.install("e1", [row("c1", "other", worker=None), row("c0", "fp-0", worker=None)]) == 2
    )
    assert here.get("e1", "c1") == found and here.get("e1", "c0") is not None
    other = SharedLedger(path, "w1")
    assert here.claim("cut:e1-a1") and not other.claim("cut:e1-a1")
    here.close()
    other.close()


async def test_parents_resolve_by_fingerprint_and_context_digest(world: World) -> None:
    policy = Policy(world.transport, RUN, "policy-ctx", policy_version=2)
    await policy.register()
    await policy.record_call("e1", "c1", [1, 2], fingerprint="fp-1", context_digest="ctx-0")
    assert policy.resolve_parent("e1", "fp-1", context_digest="ctx-0") is not None
    assert policy.resolve_parent("e1", "fp-1") is not None  # no digest given: not checked
    before = metric(
        "rolloutlog_policy_parents_total", participant="policy-ctx", outcome="context_mismatch"
    )
    # same model turns, another context before them: not this request's parent
    assert policy.resolve_parent("e1", "fp-1", context_digest="ctx-edited") is None
    # two rows with one fingerprint: never a guess
    await policy.record_call("e1", "c2", [3], fingerprint="fp-1", context_digest="ctx-0")
    assert policy.resolve_parent("e1", "fp-1", context_digest="ctx-0") is None
    assert policy.parents == {"local": 2, "context_mismatch": 1, "ambiguous": 1}
    after = metric(
        "rolloutlog_policy_parents_total", participant="policy-ctx", outcome="context_mismatch"
    )
    assert after == before + 1


async def test_a_parent_recorded_by_another_worker_resolves_here(
    world: World, tmp_path: Path
) -> None:
    path = str(tmp_path / "ledger.sqlite")
    first = Policy(world.transport, RUN, "policy-0.w0", ledger=SharedLedger(path, "w0"))
    second = Policy(world.transport, RUN, "policy-0.w1", ledger=SharedLedger(path, "w1"))
    for policy in (first, second):
        await policy.register()
    parent = await first.record_call(
        "e1", "c1", [1, 2, 3], fingerprint=fingerprint(["a"]), context_digest="ctx-0"
    )
    found = second.resolve_parent("e1", fingerprint(["a"]), context_digest="ctx-0")
    assert found == parent and second.parents == {"other_worker": 1}
    child = await second.record_call(
        "e1", "c2", [4], fingerprint=fingerprint(["a", "b"]), context_digest="ctx-1",
        parent_call_id="c1",
    )  # fmt: skip
    assert (child.prev_len, child.cum_len, child.recorded_by) == (3, 4, "w1")


async def test_a_continued_call_carries_the_oldest_contributing_policy_version(
    world: World,
) -> None:
    policy = Policy(world.transport, RUN, "policy-ver", policy_version=7, chunk_tokens=2)
    await policy.register()
    cut = GenerationPrefix("c1", None, "req-1", (1, 2), False, 5, None)
    generation = policy.generation("e1", "c1", request_digest="req-1", cut=cut)
    assert generation.policy_version == 5
    await generation.feed([3, 4])
    row = await policy.record_call(
        "e1",
        "c1",
        generation.token_ids,
        fingerprint="fp",
        context_digest="ctx",
        policy_version=generation.policy_version,
    )
    assert row.policy_version == 5  # so max_policy_lag sees the version-5 tokens
    # a fresh call is stamped with this server's version, and never a newer one than it
    assert policy.generation("e1", "c2", request_digest="req-2").policy_version == 7
    newer = await policy.record_call(
        "e1", "c3", [9], fingerprint="fp-3", context_digest="ctx", policy_version=9
    )
    assert newer.policy_version == 7


@pytest.mark.parametrize(
    ("request_body", "expected"),
    [
        ({"messages": []}, False),
        ({"tool_choice": "auto", "tools": [{}]}, False),
        ({"tool_choice": "none"}, False),
        ({"tool_choice": "required"}, True),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
        ({"response_format": {"type": "text"}}, False),
        ({"response_format": {"type": "json_object"}}, True),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, True),
        ({"guided_json": {"type": "object"}}, True),
        ({"guided_regex": "[a-z]+"}, True),
        ({"guided_choice": ["yes", "no"]}, True),
        ({"guided_grammar": "root ::= 'a'"}, True),
        ({"guided_json": None}, False),
        ({"extra_body": {"guided_choice": ["a"]}}, True),
        ({"structured_outputs": {"regex": "a+"}}, True),
    ],
)
def test_constrained_requests_are_classified_from_the_request(
    request_body: dict[str, Any], expected: bool
) -> None:
    assert constrained_request(request_body) is expected


async def test_the_caller_flag_overrides_the_classification(world: World) -> None:
    policy = Policy(world.transport, RUN, "policy-flag", chunk_tokens=2)
    await policy.register()
    guided = {"guided_regex": "[0-9]+"}
    assert policy.generation("e1", "c1", request_digest="r", request=guided).constrained
    assert not policy.generation(
        "e1", "c2", request_digest="r", request=guided, constrained=False
    ).constrained
    assert policy.generation("e1", "c3", request_digest="r", constrained=True).constrained
    row = await policy.record_call(
        "e1", "c4", [1], fingerprint="fp", context_digest="ctx", request=guided
    )
    assert row.constrained


async def test_cut_skips_and_refusals_are_metrics_and_logged(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    policy = Policy(world.transport, RUN, "policy-metrics", policy_version=1, chunk_tokens=2)
    await policy.register()
    caplog.set_level(logging.INFO, logger="rolloutlog.participants.policy")
    skipped = "rolloutlog_policy_chunks_skipped_total"
    before = metric(skipped, participant="policy-metrics")
    generation = policy.generation(
        "e1", "c1", request_digest="r", request={"response_format": {"type": "json_object"}}
    )
    await generation.feed(range(5))  # two chunks' worth, never written
    assert (generation.chunks, policy.chunks_skipped) == (0, 2)
    assert metric(skipped, participant="policy-metrics") == before + 2
    assert sum("constrained decoding" in r.message for r in caplog.records) == 1  # once a call

    cut = {"call_id": "c9", "request_digest": "r", "token_ids": [1], "policy_version": 1}
    cases = {
        "delivered": ({**cut}, [{"call_id": "c9"}], "r"),
        "parent_missing": ({**cut, "parent_call_id": "c0"}, [], "r"),
        "request_mismatch": ({**cut}, [], "other"),
        "empty": ({**cut, "token_ids": []}, [], "r"),
        "policy_newer": ({**cut, "policy_version": 2}, [], "r"),
    }
    refused = "rolloutlog_policy_cuts_refused_total"
    for reason, (generation_cut, ledger, digest) in cases.items():
        projection = {"capture_key": "e1-a1", "generation_cut": generation_cut, "ledger": ledger}
        before = metric(refused, participant="policy-metrics", reason=reason)
        assert policy.validate_cut(projection, request_digest=digest) is None
        assert metric(refused, participant="policy-metrics", reason=reason) == before + 1
        assert any(reason in r.message and r.levelname == "WARNING" for r in caplog.records)
    assert policy.cuts_refused == len(cases)
    projection = {"capture_key": "e1-a1", "generation_cut": cut, "ledger": []}
    assert policy.validate_cut(projection, request_digest="r") is not None


def test_the_default_ledger_is_in_memory() -> None:
    ledger = MemoryLedger()
    ledger.put("e1", row("c1", "fp"))
    assert ledger.matching("e1", "fp") == [ledger.get("e1", "c1")]
    assert ledger.claim("x") and not ledger.claim("x")
