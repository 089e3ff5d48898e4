"""What the trainer client returns, and the errors it raises (the service's own error classes,
rebuilt by ``rolloutlog.errors.error_from_wire``)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, overload

import httpx

from rolloutlog.errors import RolloutlogError, ServiceError, error_from_body, error_from_wire

__all__ = [
    "CheckpointInfo",
    "EpisodeResult",
    "RestoreEpisode",
    "RestoreInfo",
    "ServiceError",
    "StagingKeyList",
    "error_from_body",
    "error_from_response",
]


def error_from_response(response: httpx.Response) -> RolloutlogError:
    """The error of an ``httpx`` error reply (``rolloutlog.errors.error_from_wire``)."""
    return error_from_wire(response.status_code, response.content)


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint as the service reports it."""

    checkpoint_id: int
    status: str
    counts: Mapping[str, int]
    offsets: tuple[Mapping[str, Any], ...] = ()
    #: Every staging key (a tuple, or a ``StagingKeyList`` when composed from what changed).
    staging_keys: Sequence[str] | None = None
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CheckpointInfo:
        keys = body.get("staging_keys")
        return cls(
            checkpoint_id=int(body["checkpoint_id"]),
            status=str(body["status"]),
            counts=dict(body.get("counts", {})),
            offsets=tuple(body.get("offsets", ())),
            staging_keys=tuple(keys) if keys is not None else None,
            timings_ms=dict(body.get("timings_ms", {})),
            raw=dict(body),
        )


class StagingKeyList(Sequence[str]):
    """A checkpoint's staging keys composed from what changed, listed when first read.

    A trainer that never reads them pays what changed, not every live rollout's keys (listing
    192,000 keys took 40-65 ms on the benchmark machine, each checkpoint). Reading one after
    later checkpoints still gives its own checkpoint's keys (``_KeyHistory`` keeps what each
    later reply changed while a list of an earlier checkpoint is alive)."""

    __slots__ = ("__weakref__", "_count", "_history", "_listed", "_version")

    def __init__(self, history: _KeyHistory, version: int, count: int) -> None:
        self._history: _KeyHistory | None = history
        self._version = version
        self._count = count
        self._listed: tuple[str, ...] | None = None

    def _list(self) -> tuple[str, ...]:
        if self._listed is None:
            assert self._history is not None
            self._listed = self._history.keys_at(self._version)
            self._history = None
        return self._listed

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._list()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __contains__(self, key: object) -> bool:
        history = self._history
        if history is not None and history.version == self._version:
            return key in history.current
        return key in self._list()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self._list() == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StagingKeyList({list(self._list())!r})"


class _KeyHistory:
    """One run's newest staging keys (``current``, amended in place per reply) and, while a
    ``StagingKeyList`` of an earlier version is alive, what each later reply changed: that list
    is the newest keys with those changes undone."""

    def __init__(self, keys: set[str]) -> None:
        self.current = keys
        self.version = 0
        #: version -> (added, removed) by the reply that made ``version + 1``.
        self.changes: dict[int, tuple[frozenset[str], frozenset[str]]] = {}
        self.lists: weakref.WeakValueDictionary[int, StagingKeyList] = weakref.WeakValueDictionary()

    def amend(self, added: Sequence[str], removed: Sequence[str]) -> None:
        oldest = min(self.lists, default=self.version)
        if oldest < self.version or self.version in self.lists:
            self.changes[self.version] = (frozenset(added), frozenset(removed))
        for version in [v for v in self.changes if v < oldest]:
            del self.changes[version]  # no list of it or older is alive
        self.current.difference_update(removed)
        self.current.update(added)
        self.version += 1

    def keys_at(self, version: int) -> tuple[str, ...]:
        if version == self.version:
            return tuple(self.current)
        keys = set(self.current)
        for step in range(self.version - 1, version - 1, -1):
            added, removed = self.changes[step]
            keys.difference_update(added)
            keys.update(removed)
        return tuple(keys)

    def list(self, count: int) -> StagingKeyList:
        keys = StagingKeyList(self, self.version, count)
        self.lists[self.version] = keys
        return keys


class StagingKeys:
    """Per run, the staging keys of the newest checkpoint the client took: its next checkpoint
    request names that checkpoint (``staging_keys_since``), and a reply that says only what
    changed from it (``staging_keys_added``/``_removed``, see docs/api.md) is composed with them,
    so a checkpoint's reply costs what changed, not every live rollout's keys (the keys are
    listed when read: ``StagingKeyList``)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, _KeyHistory]] = {}

    def since(self, run: str) -> int | None:
        held = self._held.get(run)
        return held[0] if held is not None else None

    def info(self, run: str, body: Mapping[str, Any]) -> CheckpointInfo:
        """The reply of a checkpoint request for ``run``, with every staging key listed."""
        held = self._held.pop(run, None)
        added = body.get("staging_keys_added")
        if added is None:
            info = CheckpointInfo.from_json(body)
            if info.staging_keys is not None:
                history = _KeyHistory(set(info.staging_keys))
                self._held[run] = (info.checkpoint_id, history)
            elif held is not None:  # pending: the next one may still amend the held keys
                self._held[run] = held
            return info
        since = body.get("staging_keys_since")
        if held is None or held[0] != since:
            raise _inconsistent(
                run,
                f"checkpoint {body.get('checkpoint_id')} of run {run!r}: the service sent the "
                f"staging keys changed since checkpoint {since}, whose keys this client does not "
                "hold",
            )
        history = held[1]
        removed = body.get("staging_keys_removed") or ()
        history.amend(added, removed)
        if len(history.current) != body.get("staging_key_count"):
            raise _inconsistent(
                run,
                f"checkpoint {body.get('checkpoint_id')} of run {run!r}: "
                f"{len(history.current)} staging keys composed, the service counts "
                f"{body.get('staging_key_count')}",
            )
        info = replace(
            CheckpointInfo.from_json(body), staging_keys=history.list(len(history.current))
        )
        self._held[run] = (info.checkpoint_id, history)
        return info


def _inconsistent(run: str, message: str) -> ServiceError:
    """A delta reply this client cannot compose: the checkpoint committed, but its staging keys
    are unknown here (the next checkpoint's reply lists them all again)."""
    return ServiceError(500, "internal", message, {"run": run})


@dataclass(frozen=True)
class RestoreEpisode:
    """One episode of a restore plan."""

    episode: str
    previous_attempt: int
    attempt: int
    capture_key: str
    action: str
    reason: str | None = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RestoreEpisode:
        return cls(
            episode=str(body["episode"]),
            previous_attempt=int(body["previous_attempt"]),
            attempt=int(body["attempt"]),
            capture_key=str(body["capture_key"]),
            action=str(body["action"]),
            reason=body.get("reason"),
        )


@dataclass(frozen=True)
class RestoreInfo:
    """A committed restore (``episodes`` only when fetched with them)."""

    restore_id: int
    checkpoint_id: int
    counts: Mapping[str, int]
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    episodes: tuple[RestoreEpisode, ...] | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RestoreInfo:
        episodes = body.get("episodes")
        return cls(
            restore_id=int(body["restore_id"]),
            checkpoint_id=int(body["checkpoint_id"]),
            counts=dict(body.get("counts", {})),
            timings_ms=dict(body.get("timings_ms", {})),
            episodes=(
                tuple(RestoreEpisode.from_json(e) for e in episodes)
                if episodes is not None
                else None
            ),
            raw={k: v for k, v in body.items() if k != "episodes"},
        )


@dataclass(frozen=True)
class EpisodeResult:
    """A finished episode's result as the service keeps it (``GET /v1/runs/{run}/results``):
    ``result`` is the environment's opaque result, decoded."""

    episode: str
    attempt: int
    capture_key: str
    reward: float | None
    result: Any
    finished_offset: int
    ts: float
    partition: int | None = None
    acknowledged: bool = False

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> EpisodeResult:
        reward = body.get("reward")
        return cls(
            episode=str(body["episode"]),
            attempt=int(body["attempt"]),
            capture_key=str(body["capture_key"]),
            reward=float(reward) if reward is not None else None,
            result=body.get("result"),
            finished_offset=int(body["finished_offset"]),
            ts=float(body["ts"]),
            partition=body.get("partition"),
            acknowledged=bool(body.get("acknowledged", False)),
        )
