"""Auth: every route declares a role, tokens are checked per role, no tokens means loopback only."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from rolloutlog.api import PUBLIC_PATHS, Role, Settings, Tokens, create_app, route_roles
from rolloutlog.api.cli import main as cli_main
from rolloutlog.errors import InvalidRequest
from tests.api.conftest import RUN, TOKENS, Api, bearer, open_api

#: The role of every route of docs/design.md §8 (plus the analyst's participant list and the
#: trainer's restore list). A new route must be added here with its role.
EXPECTED = {
    ("GET", "/healthz"): None,
    ("GET", "/readyz"): None,
    ("GET", "/metrics"): None,
    ("POST", "/v1/runs"): Role.TRAINER,
    ("GET", "/v1/runs"): Role.ANALYST,
    ("GET", "/v1/runs/{run}"): Role.ANALYST,
    ("DELETE", "/v1/runs/{run}"): Role.TRAINER,
    ("POST", "/v1/runs/{run}/participants"): Role.PARTICIPANT,
    ("GET", "/v1/runs/{run}/participants"): Role.ANALYST,
    ("POST", "/v1/runs/{run}/events"): Role.PARTICIPANT,
    ("POST", "/v1/runs/{run}/controller"): Role.TRAINER,
    ("POST", "/v1/runs/{run}/checkpoints"): Role.TRAINER,
    ("GET", "/v1/runs/{run}/checkpoints"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/checkpoints/latest"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/checkpoints/{checkpoint_id}"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/checkpoints/{checkpoint_id}/manifest"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/checkpoints/pending/exports"): Role.PARTICIPANT,
    ("POST", "/v1/runs/{run}/restores"): Role.TRAINER,
    ("GET", "/v1/runs/{run}/restores"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/restores/{restore_id}"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/restores/{restore_id}/episodes"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/episodes/{episode}/projection"): Role.PARTICIPANT,
    ("GET", "/v1/runs/{run}/restores/{restore_id}/projections"): Role.PARTICIPANT,
    ("GET", "/v1/runs/{run}/episodes"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/stats"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/quarantine"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/episodes/{episode}"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/episodes/{episode}/events/{offset}"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/projector"): Role.ANALYST,
    ("GET", "/v1/runs/{run}/results"): Role.ANALYST,  # a trainer token holds analyst
    ("POST", "/v1/runs/{run}/results/ack"): Role.TRAINER,
    ("GET", "/docs"): None,
    ("GET", "/docs/oauth2-redirect"): None,
    ("GET", "/ui"): None,
    ("GET", "/ui/runs/{run}"): None,
    ("GET", "/ui/runs/{run}/episodes/{episode}"): None,
}


def test_every_route_declares_exactly_its_role() -> None:
    app = create_app(Settings(tokens=Tokens.from_mapping(TOKENS, "test")))
    for route in app.routes:
        if not isinstance(route, APIRoute):
            assert getattr(route, "path", None) in PUBLIC_PATHS, f"unchecked route {route}"
    assert route_roles(app) == EXPECTED


def _concrete(path: str) -> str:
    return (
        path.replace("{run}", RUN)
        .replace("{checkpoint_id}", "1")
        .replace("{restore_id}", "1")
        .replace("{episode}", "a")
        .replace("{offset}", "0")
    )


@pytest.mark.parametrize(("method", "path"), [k for k, v in EXPECTED.items() if v is not None])
async def test_every_protected_route_refuses_missing_bad_and_wrong_tokens(
    api: Api, method: str, path: str
) -> None:
    await api.seed(["a"])
    ends = await api.log_ends()
    role = EXPECTED[(method, path)]
    assert role is not None
    url = _concrete(path)
    kw = {"json": {}} if method == "POST" else {}
    missing = await api.client.request(method, url, **kw)  # type: ignore[arg-type]
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "unauthorized"
    assert missing.headers["www-authenticate"] == "Bearer"
    bad = await api.client.request(
        method,
        url,
        headers={"Authorization": "Bearer not-a-real-token-at-all"},
        **kw,  # type: ignore[arg-type]
    )
    assert bad.status_code == 401
    basic = await api.client.request(
        method,
        url,
        headers={"Authorization": f"Basic {TOKENS[role.value]}"},
        **kw,  # type: ignore[arg-type]
    )
    assert basic.status_code == 401
    for other in ("participant", "trainer", "analyst"):
        if other == role.value or (other == "trainer" and role is Role.ANALYST):
            continue  # a trainer reads what an analyst reads
        wrong = await api.client.request(method, url, headers=bearer(other), **kw)  # type: ignore[arg-type]
        assert wrong.status_code == 403, (other, wrong.text)
        assert wrong.json()["error"]["code"] == "forbidden"
    allowed_roles = [role.value, "admin"] + (["trainer"] if role is Role.ANALYST else [])
    for allowed in allowed_roles:
        response = await api.client.request(method, url, headers=bearer(allowed), **kw)  # type: ignore[arg-type]
        assert response.status_code not in (401, 403), (allowed, response.text)
    assert method != "GET" or await api.log_ends() == ends  # analyst routes never write


async def test_public_routes_need_no_token(api: Api) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert (await api.client.get(path)).status_code == 200


async def test_without_tokens_only_loopback_clients_are_served(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path / "data"))
    async with app.router.lifespan_context(app):
        local = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=local, base_url="http://t") as client:
            assert (await client.get("/v1/runs")).status_code == 200
        remote = httpx.ASGITransport(app=app, client=("10.1.2.3", 5000))
        async with httpx.AsyncClient(transport=remote, base_url="http://t") as client:
            response = await client.get("/v1/runs")
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "forbidden"
            assert (await client.get("/healthz")).status_code == 200


def test_tokens_from_json_toml_and_environment(tmp_path: Path) -> None:
    json_file = tmp_path / "tokens.json"
    json_file.write_text('{"trainer": ["trainer-secret-0001"], "admin": "admin-secret-00001"}')
    tokens = Tokens.from_file(json_file)
    assert tokens.roles_of("trainer-secret-0001") == {Role.TRAINER}
    assert tokens.roles_of("admin-secret-00001") == {Role.ADMIN}
    assert tokens.roles_of("nope") == frozenset()
    toml_file = tmp_path / "tokens.toml"
    toml_file.write_text('analyst = "analyst-secret-0001"\nparticipant = ["p-secret-000000001"]\n')
    from_toml = Tokens.from_file(toml_file)
    assert from_toml.roles_of("p-secret-000000001") == {Role.PARTICIPANT}
    env = Tokens.from_env({"ROLLOUTLOG_TOKEN_TRAINER": "env-trainer-00001, env-trainer-00002"})
    assert env.roles_of("env-trainer-00002") == {Role.TRAINER}
    both = Tokens.load(toml_file, {"ROLLOUTLOG_TOKEN_ADMIN": "env-admin-0000001"})
    assert both.roles_of("env-admin-0000001") == {Role.ADMIN}
    assert both.roles_of("analyst-secret-0001") == {Role.ANALYST}
    assert not Tokens.from_env({}).enabled


@pytest.mark.parametrize(
    "content",
    ['{"trainer": "short"}', '{"root": "long-enough-token-01"}', '{"trainer": 7}', "[1, 2]", "{"],
)
def test_bad_token_files_are_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(InvalidRequest):
        Tokens.from_file(path)


def test_serve_refuses_a_public_address_without_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for role in Role:
        monkeypatch.delenv(f"ROLLOUTLOG_TOKEN_{role.value.upper()}", raising=False)
    status = cli_main(["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)])
    assert status == 2
    message = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0 without tokens" in message
    assert "--tokens FILE" in message
    assert "ROLLOUTLOG_TOKEN_TRAINER" in message
    assert not (tmp_path / "catalog.sqlite3").exists()


def test_serve_refuses_a_bad_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens.json"
    path.write_text('{"trainer": "short"}')
    assert cli_main(["serve", "--tokens", str(path), "--data-dir", str(tmp_path)]) == 2
    assert "shorter than 16" in capsys.readouterr().err


async def test_admin_token_passes_every_role(tmp_path: Path) -> None:
    async with open_api(
        Settings(data_dir=tmp_path, tokens=Tokens.from_mapping(TOKENS, "t"))
    ) as api:
        assert (await api.call("POST", "/v1/runs", "admin", 201, json={"run": RUN})).json()
        assert (await api.call("GET", "/v1/runs", "admin", 200)).json()["runs"]
