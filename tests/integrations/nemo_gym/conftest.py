"""Fixtures of the NeMo Gym integration's tests: the in-process service of the SDK's tests."""

from tests.participants.conftest import World, world

__all__ = ["World", "world"]
