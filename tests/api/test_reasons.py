"""Restart reasons through a real checkpoint and restore: the manifest and the plan name the cause."""

from __future__ import annotations

from tests import factories as f
from tests.api.conftest import Api


async def test_a_verify_step_open_at_the_deadline_names_its_resources_server(api: Api) -> None:
    await api.seed(["v1"])
    await api.register("res-0", "resources")
    await api.append(
        f.session_started("v1", "res-0:v1", mode="exported", verify="wait"),
        f.boundary("v1", "close_agent", {"turn": 3}, nxt="verify"),
        f.step_started("v1", "verify", mode="wait"),
    )
    reply = await api.checkpoint(deadline_s=0.3)
    assert reply["counts"]["restart"] == 1
    run = f"/v1/runs/{api.run}"
    manifest = (await api.call("GET", f"{run}/checkpoints/1/manifest", "analyst", 200)).json()
    (entry,) = [e for e in manifest["episodes"] if e["episode"] == "v1"]
    reason = "verify step of resources server res-0 still open at the 0.3 s deadline"
    assert (entry["action"], entry["reason"]) == ("restart", reason)
    restore = await api.restore()
    plan = (await api.call("GET", f"{run}/restores/{restore['restore_id']}", "analyst", 200)).json()
    (planned,) = [e for e in plan["episodes"] if e["episode"] == "v1"]
    assert (planned["action"], planned["reason"]) == ("restart", reason)
