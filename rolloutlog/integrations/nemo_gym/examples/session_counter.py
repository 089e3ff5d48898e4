"""``example_session_state_mgmt`` made restorable: its counters, exported.

NeMo Gym's stateful counter (``StatefulCounterResourcesServer``) keeps one integer per NeMo Gym
session in ``session_id_to_counter``, in its process. After a SIGKILL a restarted server accepts
the old session cookie (its secret is deterministic) but the counter is gone, and ``/verify``
gives 0.0. Declared exported, the count is recorded before each reply and put back for the
replacement attempt, which then gets the reward an uninterrupted run gets::

    counter:
      resources_servers:
        example_session_state_mgmt:
          entrypoint: app.py
          domain: agent
          rolloutlog:
            mode: exported
            state: "rolloutlog.integrations.nemo_gym.examples.session_counter:CounterState"

This class is all a user writes for a server whose state is a dict keyed by NeMo Gym's session
id; ``rolloutlog.integrations.nemo_gym._exported`` says when each method runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CounterState"]


class CounterState:
    """Export, restore and retire over the server's own ``session_id_to_counter``."""

    def __init__(self, server: Any) -> None:
        self.counters: dict[str, int] = server.session_id_to_counter

    def export(self, session_id: str) -> int | None:
        return self.counters.get(session_id)

    def restore(self, session_id: str, state: int) -> None:
        self.counters[session_id] = state

    def retire(self, session_id: str) -> None:
        self.counters.pop(session_id, None)
