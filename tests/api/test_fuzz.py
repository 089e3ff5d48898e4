"""A property-based fuzz of the OpenAPI schema with schemathesis against a real server: whatever
the generated request, the service never answers with a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from rolloutlog.api import create_app
from tests import factories as f
from tests.api.conftest import TOKENS, bearer, wire
from tests.api.test_e2e import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root: Path = tmp_path_factory.mktemp("fuzz")
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    # Appends are validated in a worker process here: its refusals cross the process boundary.
    server = Server(root / "data", tokens, "--validation-workers", "1")
    server.start()
    try:
        # Some state for the fuzzer to hit: a run with episodes, a checkpoint and a restore.
        with httpx.Client(base_url=server.url, headers=bearer("admin"), timeout=30) as client:
            client.post("/v1/runs", json={"run": "run", "partitions": 2})
            client.post("/v1/runs/run/participants", json={"id": "env-0", "kind": "environment"})
            client.post("/v1/runs/run/events", json=wire(f.started("a"), f.boundary("a")))
            epoch = client.post("/v1/runs/run/controller").json()["controller_epoch"]
            client.post("/v1/runs/run/checkpoints", json={"controller_epoch": epoch})
            client.post(
                "/v1/runs/run/restores", json={"controller_epoch": epoch, "checkpoint_id": 1}
            )
        yield server
    finally:
        assert server.stop() == 0


OPERATIONS = [
    result.ok()
    for result in schemathesis.openapi.from_dict(create_app().openapi()).get_all_operations()
]


@pytest.mark.parametrize(
    "operation", OPERATIONS, ids=[f"{op.method.upper()} {op.path}" for op in OPERATIONS]
)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_makes_the_service_fail(
    fuzz_server: Server, operation: Any, mode: GenerationMode
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=10,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def call(case: Any) -> None:
        case.call_and_validate(
            base_url=fuzz_server.url,
            headers=bearer("admin"),
            checks=[not_a_server_error],
            timeout=30,
        )

    try:
        call()
    except Unsatisfiable:
        pytest.skip("nothing in this operation's request can be made invalid")
