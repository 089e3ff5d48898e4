"""The fault-injection suite: every test causes a real fault (a stopped or killed process, a reset
connection, a full disk, a bad record) and asserts the invariant: an acknowledged event is in the
log and in the fold, or its append was refused; the service stays up (or refuses to start with one
clear line) and recovers by itself when the fault ends."""

# Deployments and a real service per test, as the crash suite has them (one definition).
from tests.e2e.conftest import deployment, service  # noqa: F401
