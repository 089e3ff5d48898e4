"""Auth: every route declares a role, tokens are checked per role, no tokens means loopback only."""

from __future__ import annotations

import hmac
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from rolloutlog.api import PUBLIC_PATHS, Role, Settings, Tokens, create_app, route_roles
from rolloutlog.api._tokens import IMPLIES
from rolloutlog.api.cli import main as cli_main
from rolloutlog.errors import InvalidRequest
from tests.api.conftest import RUN, TOKENS, Api, bearer, open_api
from tests.api.test_e2e import Server

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


# -- tokens scoped to runs, through a real server -------------------------------------------------

#: What every scoped token of the tests holds its role for: a prefix and an exact name.
SCOPE = ("exp-*", "exact-run")
#: A token per role scoped to ``SCOPE`` (the admin's from the environment, the others' from the
#: token file: both formats, for real).
SCOPED = {role.value: f"{role.value}-scoped-token-01" for role in Role}


def scoped_env(scoped: Mapping[str, str] = SCOPED) -> dict[str, str]:
    """The variable that holds the scoped admin token (``TOKEN:RUN,PREFIX-*``)."""
    return {"ROLLOUTLOG_TOKEN_ADMIN": f"{scoped['admin']}:{','.join(SCOPE)}"}


SCOPED_ENV = scoped_env()


def scoped_token_file(
    path: Path, tokens: Mapping[str, str] = TOKENS, scoped: Mapping[str, str] = SCOPED
) -> Path:
    """A TOML token file: per role the unscoped token of ``tokens`` and (but for admin, whose
    scoped token is a variable's) a table ``{token, runs}`` scoped to ``SCOPE``."""
    runs = ", ".join(f'"{r}"' for r in SCOPE)
    lines = []
    for role in Role:
        table = f', {{token = "{scoped[role.value]}", runs = [{runs}]}}'
        extra = "" if role is Role.ADMIN else table
        lines.append(f'{role.value} = ["{tokens[role.value]}"{extra}]')
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def scoped_server(root: Path, *extra: str) -> Iterator[Server]:
    """``rolloutlog serve`` with ``TOKENS`` and ``SCOPED`` (file and environment)."""
    server = Server(root / "data", scoped_token_file(root / "tokens.toml"), *extra)
    with pytest.MonkeyPatch.context() as env:
        for name, value in SCOPED_ENV.items():
            env.setenv(name, value)
        server.start()
    try:
        yield server
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, httpx.Client]]:
    with (
        scoped_server(tmp_path_factory.mktemp("scopes")) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        yield server, client


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


#: Who asks: each role's token unscoped, scoped and asking in its scope, scoped and asking out.
HOLDERS = [(role, where) for where in ("out", "in", "unscoped") for role in Role]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("index", "method", "path"),
    [(i, m, p) for i, ((m, p), v) in enumerate(EXPECTED.items()) if v is not None],
)
def test_every_route_with_every_role_in_and_out_of_its_scope(
    real: tuple[Server, httpx.Client], index: int, method: str, path: str
) -> None:
    """Every protected route x every role x (in scope / out of scope / unscoped): a role that
    does not imply the route's is refused as before; a scoped token on a run out of its scope
    gets 403 with the error envelope naming the role and the run, and changes nothing there."""
    _, client = real
    role = EXPECTED[(method, path)]
    assert role is not None
    inside, outside = f"exp-m{index}", f"other-m{index}"
    for run in (inside, outside):
        made = client.post("/v1/runs", json={"run": run, "partitions": 2}, headers=bearer("admin"))
        assert made.status_code == 201, made.text
    before = client.get(f"/v1/runs/{outside}", headers=bearer("admin")).json()
    for holder, where in HOLDERS:
        token = TOKENS[holder.value] if where == "unscoped" else SCOPED[holder.value]
        run = outside if where == "out" else inside
        body: dict[str, object] = {}
        if path == "/v1/runs" and method == "POST":  # the run it creates is the one it names
            body = {"run": f"{run}-new-{holder.value}-{where}", "partitions": 1}
        kw = {"json": body} if method == "POST" else {}
        url = _concrete(path.replace("{run}", run))
        reply = client.request(method, url, headers=_as(token), **kw)  # type: ignore[arg-type]
        named = "{run}" in path or method == "POST"  # GET /v1/runs names none: it filters
        case = (holder.value, where, reply.status_code, reply.text)
        if role not in IMPLIES[holder]:
            assert reply.status_code == 403, case
            assert reply.json()["error"]["details"]["role"] == role.value, case
        elif where == "out" and named:
            assert reply.status_code == 403, case
            error = reply.json()["error"]
            assert error["code"] == "forbidden", case
            assert error["details"] == {"role": role.value, "run": body.get("run", run)}, case
        else:
            assert reply.status_code not in (401, 403), case
        if path == "/v1/runs" and method == "GET" and role in IMPLIES[holder]:
            listed = {r["run"] for r in reply.json()["runs"]}
            assert inside in listed, case
            assert (outside in listed) == (where == "unscoped"), case
    after = client.get(f"/v1/runs/{outside}", headers=bearer("admin"))
    assert after.status_code == 200, after.text  # an out-of-scope DELETE deleted nothing
    assert after.json()["counts"] == before["counts"]
    assert after.json()["controller_epoch"] == before["controller_epoch"]
    if method == "POST" and path == "/v1/runs":
        made = client.get("/v1/runs", params={"limit": 10_000}, headers=bearer("admin")).json()
        assert not [r["run"] for r in made["runs"] if r["run"].startswith(f"{outside}-new")]


def test_every_configured_token_is_compared_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A presented token is compared with every configured one, scoped or not, by
    ``hmac.compare_digest`` and nothing else, whether it matches the first, the last or none:
    how long a check takes does not say which configured token, or how much of one, matched."""
    tokens = Tokens.from_file(scoped_token_file(tmp_path / "tokens.toml")).merged(
        Tokens.from_env(SCOPED_ENV)
    )
    configured = [entry.token for entry in tokens.entries]
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("rolloutlog.api._tokens.hmac.compare_digest", compare_digest)
    first, last = configured[0].decode(), configured[-1].decode()
    for presented in (first, last, first[:-1] + "x", "not-a-token-of-this-service"):
        compared.clear()
        tokens.access_of(presented)
        assert compared == [(presented.encode(), token) for token in configured], presented


def test_scoped_tokens_from_toml_json_and_the_environment(tmp_path: Path) -> None:
    tokens = Tokens.from_file(scoped_token_file(tmp_path / "tokens.toml")).merged(
        Tokens.from_env(SCOPED_ENV)
    )
    for role in Role:
        unscoped, scoped = (
            tokens.access_of(TOKENS[role.value]),
            tokens.access_of(SCOPED[role.value]),
        )
        for run in ("exp-1", "exp-", "exact-run", "other", "exact-run-2", "exp"):
            in_scope = run.startswith("exp-") or run == "exact-run"
            assert unscoped.allows(role, run)
            assert scoped.allows(role, run) == in_scope, (role, run)
        assert scoped.roles == {role} and scoped.allows(role)  # holds the role, on some runs
    json_file = tmp_path / "tokens.json"
    json_file.write_text(
        '{"analyst": {"token": "json-scoped-analyst-1", "runs": "solo"},'
        ' "trainer": ["plain-trainer-token-1", {"token": "json-every-run-0001", "runs": ["*"]}]}'
    )
    from_json = Tokens.from_file(json_file)
    assert from_json.access_of("json-scoped-analyst-1").runs_for(Role.ANALYST).covers("solo")
    assert not from_json.access_of("json-scoped-analyst-1").allows(Role.ANALYST, "solo-2")
    assert from_json.access_of("json-every-run-0001").allows(Role.TRAINER, "anything")
    # A variable: tokens separated by commas as before, a scoped token on a line of its own.
    env = Tokens.from_env(
        {
            "ROLLOUTLOG_TOKEN_TRAINER": "env-plain-token-001, env-plain-token-002\n"
            " env-scoped-token-01 : exp-* , solo\n"
        }
    )
    assert env.access_of("env-plain-token-002").allows(Role.TRAINER, "x")
    assert env.access_of("env-scoped-token-01").allows(Role.TRAINER, "solo")
    assert not env.access_of("env-scoped-token-01").allows(Role.TRAINER, "solo2")
    # The same token under two entries holds what both grant.
    both = Tokens.from_env(
        {
            "ROLLOUTLOG_TOKEN_ANALYST": "twice-listed-token-1:a-*",
            "ROLLOUTLOG_TOKEN_TRAINER": "twice-listed-token-1:b",
        }
    )
    runs = both.access_of("twice-listed-token-1").runs_for(Role.ANALYST)
    assert (runs.covers("a-1"), runs.covers("b"), runs.covers("c")) == (True, True, False)
    assert "twice-listed" not in repr(both)  # a token is never shown


SECRET = "secret-part-never-shown-0001"


@pytest.mark.parametrize(
    "environ",
    [
        {"ROLLOUTLOG_TOKEN_TRAINER": f"{SECRET}:exp-*,bad/run"},
        {"ROLLOUTLOG_TOKEN_TRAINER": f"{SECRET}:"},
        {"ROLLOUTLOG_TOKEN_TRAINER": f"{SECRET}:-x*"},
        {"ROLLOUTLOG_TOKEN_TRAINER": f"{SECRET},another-token-000001:exp-*"},
        {"ROLLOUTLOG_TOKEN_TRAINER": f"{SECRET[:8]}:{SECRET[8:]}/x"},  # an old token with ':'
        {"ROLLOUTLOG_TOKEN_TRAINER": "tiny7:exp-*"},
    ],
)
def test_bad_scopes_are_refused_without_showing_the_token(environ: dict[str, str]) -> None:
    with pytest.raises(InvalidRequest) as refused:
        Tokens.from_env(environ)
    message = str(refused.value)
    assert "ROLLOUTLOG_TOKEN_TRAINER" in message or "trainer token 1" in message, message
    for part in (SECRET, SECRET[:8], SECRET[8:], "tiny7"):
        assert part not in message, message


@pytest.mark.parametrize(
    "content",
    [
        '{"trainer": {"token": "long-enough-token-01"}}',
        '{"trainer": {"token": "long-enough-token-01", "runs": []}}',
        '{"trainer": {"token": "long-enough-token-01", "runs": ["a b"]}}',
        '{"trainer": {"token": "long-enough-token-01", "runs": [7]}}',
        '{"trainer": {"token": "long-enough-token-01", "runs": ["a"], "role": "admin"}}',
        '{"trainer": [{"token": "short", "runs": ["a"]}]}',
    ],
)
def test_bad_scoped_entries_in_token_files_are_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(InvalidRequest, match="trainer token 1") as refused:
        Tokens.from_file(path)
    assert "long-enough-token-01" not in str(refused.value)
