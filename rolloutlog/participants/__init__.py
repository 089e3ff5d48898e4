"""The participant SDK: transports, the four participant kinds, ASGI integration, restores.

Every ``record``-style call returns once its event is durable (the write-ahead rule of
docs/design.md §3): await it before the effect it records leaves the process.
"""

from rolloutlog.participants._asgi import (
    CAPTURE_KEY_HEADER,
    STEP_HEADER,
    ResourcesMiddleware,
    RolloutContextMiddleware,
    context_headers,
    current_context,
    rollout_context,
)
from rolloutlog.participants._environment import (
    STAGES,
    VERIFY_HEADER,
    Environment,
    EnvironmentEpisode,
    Resumed,
)
from rolloutlog.participants._ledger import LedgerStore, MemoryLedger, SharedLedger
from rolloutlog.participants._participant import Participant, RolloutContext, task_digest
from rolloutlog.participants._policy import (
    Generation,
    GenerationPrefix,
    LedgerRowInfo,
    Policy,
    constrained_request,
    fingerprint,
    ledger_digest,
)
from rolloutlog.participants._restore import Restores
from rolloutlog.participants._sessions import Agent, AgentSession, Resources
from rolloutlog.participants._transport import (
    DEFAULT_DEADLINE_S,
    HttpTransport,
    KafkaTransport,
    Transport,
)

__all__ = [
    "CAPTURE_KEY_HEADER",
    "DEFAULT_DEADLINE_S",
    "STAGES",
    "STEP_HEADER",
    "VERIFY_HEADER",
    "Agent",
    "AgentSession",
    "Environment",
    "EnvironmentEpisode",
    "Generation",
    "GenerationPrefix",
    "HttpTransport",
    "KafkaTransport",
    "LedgerRowInfo",
    "LedgerStore",
    "MemoryLedger",
    "Participant",
    "Policy",
    "Resources",
    "ResourcesMiddleware",
    "Restores",
    "Resumed",
    "RolloutContext",
    "RolloutContextMiddleware",
    "SharedLedger",
    "Transport",
    "constrained_request",
    "context_headers",
    "current_context",
    "fingerprint",
    "ledger_digest",
    "rollout_context",
    "task_digest",
]
