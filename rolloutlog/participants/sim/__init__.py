"""A simulated Gym of real processes, for the demo, the crash suite and the benchmarks.

Each participant kind runs as its own server process (FastAPI on uvicorn, loopback) that records
what a restore needs through the SDK exactly as a real participant would:

- ``policy``: a fake model that "generates" deterministic tokens (``sim_tokens``) at a set
  rate, with generation chunks for long calls (never for constrained ones), a ledger row before
  each delivery, lineage by fingerprint over restored rows, and restored cuts continued;
- ``agent``: one session per episode, lazy snapshots before each model call and after each
  tool round, resumed from its projection;
- ``resources``: ``counter`` (exported: its counter must be restored for the right reward),
  ``verifier`` (stateless) and ``restart`` (restart-only);
- ``environment``: single-turn agent episodes through the §7 stages.

``Gym`` starts ``rolloutlog serve`` and the six participant processes, kills and restarts them,
and parks episodes at named hold points; ``Collector`` drives rollouts with the trainer client
and checks every reward. Importing this package starts nothing.
"""

from rolloutlog.participants.sim._collector import Collector, CollectorReport, Rollout
from rolloutlog.participants.sim._gym import PARTICIPANTS, Gym, die_with_parent, free_port
from rolloutlog.participants.sim._model import (
    RESOURCES_KINDS,
    expected_answer,
    expected_reward,
    make_task,
    make_tasks,
    request_digest,
    sim_tokens,
)

__all__ = [
    "PARTICIPANTS",
    "RESOURCES_KINDS",
    "Collector",
    "CollectorReport",
    "Gym",
    "Rollout",
    "die_with_parent",
    "expected_answer",
    "free_port",
    "expected_reward",
    "make_task",
    "make_tasks",
    "request_digest",
    "sim_tokens",
]
