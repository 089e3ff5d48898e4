"""``POST /v1/runs/{run}/checkpoints`` with a ``request_id`` through the real routes: the
checkpoint keeps it, ``GET …/checkpoints?request_id=`` finds it, and the request sent again is
answered with its own checkpoint, not a second one (docs/api.md, "Several service URLs")."""

from __future__ import annotations

from tests.api.conftest import Api


async def test_a_request_sent_again_is_answered_with_its_checkpoint(api: Api) -> None:
    await api.seed(["a", "b"])
    other = await api.checkpoint(wait=True, request_id="other-client")
    first = await api.checkpoint(wait=True, request_id="r-1")
    assert first["request_id"] == "r-1" and first["status"] == "committed"
    assert first["checkpoint_id"] == other["checkpoint_id"] + 1
    again = await api.checkpoint(wait=True, request_id="r-1")
    assert again["checkpoint_id"] == first["checkpoint_id"] and again["status"] == "committed"
    assert sorted(again["staging_keys"]) == sorted(first["staging_keys"])
    listed = await api.call(
        "GET", f"/v1/runs/{api.run}/checkpoints", "analyst", 200, params={"request_id": "r-1"}
    )
    assert [c["checkpoint_id"] for c in listed.json()["checkpoints"]] == [first["checkpoint_id"]]
    none = await api.call(
        "GET", f"/v1/runs/{api.run}/checkpoints", "analyst", 200, params={"request_id": "r-2"}
    )
    assert none.json()["checkpoints"] == []
    # No request id: a new checkpoint every time, as before.
    plain = await api.checkpoint(wait=True)
    assert plain["checkpoint_id"] == first["checkpoint_id"] + 1 and plain["request_id"] is None
    bad = await api.checkpoint(400, request_id="no spaces")
    assert bad["error"]["code"] == "invalid_request"


async def test_a_request_whose_checkpoint_is_pending_is_told_so(api: Api) -> None:
    """Its checkpoint still pending (begun here by the catalog, as by a replica that has not
    answered yet): ``wait=false`` is answered with it (202), ``wait=true`` with
    ``checkpoint_in_progress``; another request id too, as before."""
    await api.seed(["a"])
    pending = await api.service.catalog.begin_checkpoint(api.run, api.epoch, request_id="p-1")
    found = await api.checkpoint(202, wait=False, request_id="p-1")
    assert (found["checkpoint_id"], found["status"]) == (pending, "pending")
    assert found["request_id"] == "p-1"
    for body in ({"wait": True, "request_id": "p-1"}, {"wait": False, "request_id": "p-2"}):
        refused = await api.checkpoint(409, **body)
        assert refused["error"]["code"] == "checkpoint_in_progress"
        assert refused["error"]["details"]["checkpoint_id"] == pending
