"""Each package's public surface is what its ``__init__`` names, pinned here; a change to it is
deliberate. Beside the pins, the rules that keep the rooms apart (docs/design.md §9): no module
imports another package's private module, and the API never reaches into projector state."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import rolloutlog

ROOT = Path(rolloutlog.__file__).resolve().parent

EVENT_TYPES = [
    f"{kind}{suffix}"
    for kind in (
        "AttemptStarted",
        "CheckpointMarker",
        "EpisodeFinished",
        "EpisodeStarted",
        "GenerationChunk",
        "LedgerRow",
        "SessionEnded",
        "SessionStarted",
        "SessionState",
        "StepBoundary",
        "StepStarted",
    )
    for suffix in ("", "Data")
]

SURFACES: dict[str, list[str]] = {
    "rolloutlog.core": [
        "RestoreTransition",
        "BoundaryView",
        "check_controller_epoch",
        "check_envelope",
        "record_holds",
        "envelope_holds",
        "wrong_record_field",
        "CUT_DISPOSITIONS",
        "EpisodeFold",
        "composable",
        "compose_projection",
        "projection_positions",
        "EpisodeProjection",
        "EventFilters",
        "GenerationCut",
        "LedgerEntry",
        "Lineage",
        "ManifestAction",
        "ManifestEntry",
        "PartitionOffset",
        "PlannedEpisode",
        "ProjectionLine",
        "ProjectionStatus",
        "RestoreAction",
        "RestoreEntry",
        "RestorePlan",
        "RestorePolicy",
        "SessionView",
        "apply_policy",
        "restore_transition",
        "check_exclusions",
        "not_exported_reason",
        "plan_restore",
        "planned_cut_dispositions",
        "replay_start",
        "restart_only_reason",
        "resumed_boundary",
        "select_records",
        "served_cut_dispositions",
        "to_continue",
        "verify_projection",
        "wait_expired_reason",
        "DATA_RULES",
        "DATA_SHAPES",
        "DELTA_KEY",
        "DELTA_PREFIX",
        "EVENT_CLASSES",
        "MAX_SEQ",
        "NAME_PATTERN",
        "OPAQUE_FIELD",
        "PAYLOAD_FIELD",
        "REQUIRED",
        "SERVICE_EVENT_TYPES",
        "SERVICE_PARTICIPANT_ID",
        "AttemptStarted",
        "AttemptStartedData",
        "CheckpointMarker",
        "CheckpointMarkerData",
        "DataRule",
        "Envelope",
        "EpisodeFinished",
        "EpisodeFinishedData",
        "EpisodeStarted",
        "EpisodeStartedData",
        "Event",
        "FieldShape",
        "GenerationChunk",
        "GenerationChunkData",
        "LedgerRow",
        "LedgerRowData",
        "Opaque",
        "ParticipantIdentity",
        "ParticipantKind",
        "SessionEnded",
        "SessionEndedData",
        "SessionStarted",
        "SessionStartedData",
        "SessionState",
        "SessionStateData",
        "StepBoundary",
        "StepBoundaryData",
        "StepStarted",
        "StepStartedData",
        "capture_key",
        "compose_state",
        "encode_opaque",
        "SPLICE_BYTES",
        "LINE_OVERHEAD",
        "mapped",
        "episode_id_problem",
        "is_delta",
        "ledger_digest",
        "name_problem",
        "parse_capture_key",
        "partition_for",
        "run_name_problem",
        "state_delta",
        "task_digest",
        "token_count",
    ],
    "rolloutlog.log": [
        *EVENT_TYPES,
        "DEFAULT_MAX_RECORD_BYTES",
        "DELTA_KEY",
        "DEFAULT_PARTITIONS",
        "DataDirLock",
        "Event",
        "Log",
        "MAX_PARTITIONS",
        "NAME_PATTERN",
        "OPAQUE_FIELD",
        "PAYLOAD_FIELD",
        "Opaque",
        "ParticipantIdentity",
        "ParticipantKind",
        "Position",
        "Record",
        "SERVICE_EVENT_TYPES",
        "SERVICE_PARTICIPANT_ID",
        "attempt_started_record",
        "attempt_started_records",
        "encode_record_dict",
        "ledger_digest",
        "mapped_copies",
        "marker_record",
        "peek_record",
        "record_payload",
        "record_payload_size",
        "record_payload_start",
        "task_digest",
        "token_count",
        "capture_key",
        "check_record_size",
        "check_run_name",
        "compose_state",
        "decode_event",
        "decode_record",
        "encode_event",
        "encode_opaque",
        "encode_record",
        "episode_id_problem",
        "fast_record",
        "DATA_RULES",
        "DATA_SHAPES",
        "FieldShape",
        "REQUIRED",
        "is_delta",
        "name_problem",
        "open_log",
        "parse_capture_key",
        "partition_for",
        "record_episode",
        "record_meta",
        "record_restore_id",
        "run_name_problem",
        "split_record",
        "state_delta",
        "validate_event",
        "validate_events",
    ],
    "rolloutlog.projections": [
        "Blocker",
        "BlockerState",
        "BoundaryView",
        "CUT_DISPOSITIONS",
        "CheckpointResult",
        "Coordinator",
        "DEFAULT_LEASE_S",
        "EpisodeFold",
        "EpisodeProjection",
        "ForkRequest",
        "ForkResult",
        "GenerationCut",
        "LedgerEntry",
        "ProjectionLine",
        "ProjectionStatus",
        "RecordView",
        "RestoreResult",
        "RunHealthReport",
        "SessionView",
        "TrackedEpisode",
        "default_replica_id",
        "ledger_digest",
        "project_episode",
        "project_events",
        "select_records",
        "served_cut_dispositions",
        "summarize_health",
        "token_count",
    ],
    "rolloutlog.catalog": [
        "Catalog",
        "Checkpoint",
        "CheckpointStatus",
        "ClusterView",
        "DEFAULT_KEEP_COMMITTED",
        "DEFAULT_PARTITIONS",
        "Episode",
        "EpisodeFinish",
        "EpisodeStart",
        "EpisodeStatus",
        "FORK_CHECKPOINT_ID",
        "FORK_RESTORE_ID",
        "FinishedResult",
        "ForkClaim",
        "ManifestAction",
        "ManifestEntry",
        "ParticipantKind",
        "PartitionOffset",
        "PartitionOwner",
        "QUARANTINE_FIRST_BYTES",
        "QuarantinedRecord",
        "RegisteredParticipant",
        "ReplicaReport",
        "Restore",
        "RestoreAction",
        "RestoreEntry",
        "RestorePart",
        "RestorePlanning",
        "RestoreRequest",
        "Run",
        "RunStats",
        "RunSummary",
        "head_revision",
        "inherited_restore",
        "open_catalog",
    ],
    "rolloutlog.participants": [
        "Agent",
        "AgentSession",
        "CAPTURE_KEY_HEADER",
        "DEFAULT_DEADLINE_S",
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
        "STAGES",
        "STEP_HEADER",
        "SharedLedger",
        "Transport",
        "VERIFY_HEADER",
        "constrained_request",
        "context_headers",
        "current_context",
        "fingerprint",
        "ledger_digest",
        "rollout_context",
        "task_digest",
    ],
    "rolloutlog.trainer": [
        "AsyncTrainerClient",
        "CheckpointInfo",
        "CheckpointScheduler",
        "DEFAULT_URL",  # rolloutlog.wire's
        "Dispatch",
        "EpisodeResult",
        "RestoreEpisode",
        "RestoreInfo",
        "ResumePlan",
        "ServiceError",  # rolloutlog.errors'
        "StagingKeyList",
        "TrainerClient",
        "error_from_body",  # rolloutlog.errors'
        "error_from_response",
        "resume_run",
        "resume_run_sync",
    ],
    "rolloutlog.api": [
        "DEFAULT_HOST",
        "DEFAULT_PORT",
        "PUBLIC_PATHS",
        "Role",
        "Settings",
        "Tokens",
        "create_app",
        "route_roles",
    ],
    "rolloutlog.errors": [
        "AttemptFenced",
        "BackendUnavailable",
        "CatalogError",
        "CatalogVersionError",
        "CheckpointInProgress",
        "CheckpointNotPending",
        "ConfigurationError",
        "DataDirLocked",
        "Forbidden",
        "InvalidEvent",
        "InvalidRequest",
        "LeaseLost",
        "LogError",
        "ParticipantFenced",
        "PayloadTooLarge",
        "RequestTimeout",
        "RestoreConflict",
        "RolloutlogError",
        "RunExists",
        "RunLost",
        "ServiceError",
        "StaleController",
        "Unauthorized",
        "UnknownCheckpoint",
        "UnknownEpisode",
        "UnknownRestore",
        "UnknownRun",
        "error_from_body",
        "error_from_wire",
    ],
    "rolloutlog.wire": [
        "CLIENT_KEEPALIVE_S",
        "DEFAULT_URL",
        "NDJSON",
        "NdjsonSplitter",
        "SERVICE_KEEPALIVE_S",
        "direct_http_url",
        "service_urls",
    ],
    "rolloutlog.integrations.nemo_gym": [
        "CAPTURE_KEY_COOKIE",
        "RESTORE_COOKIE",
        "RESTORE_HEADER",
        "CollectionReport",
        "GymCollector",
        "GymContextMiddleware",
        "GymSettings",
        "Launcher",
        "SessionState",
        "StateHooks",
        "attach_resources",
        "build_app",
        "current_gym_session",
        "episode_id",
        "materialize_rows",
        "resolve_config",
        "restore_id_of",
        "rollout_cookies",
        "rollout_headers",
        "serve",
        "RolloutServerClient",
        "RolloutlogSimpleAgent",
        "RolloutlogVLLMModel",
    ],
}


@pytest.mark.parametrize("package", sorted(SURFACES))
def test_surface(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(SURFACES[package])
    for name in module.__all__:
        if name in getattr(module, "_GYM_NAMES", {}):  # imported on first use: needs NeMo Gym
            continue
        assert hasattr(module, name), name


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _package(path: Path) -> str:
    """The top-level package (``log``, ``catalog``…) a module of rolloutlog belongs to."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else ""


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_no_private_module_crosses_a_package() -> None:
    crossing = []
    for path in _modules():
        own = _package(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "rolloutlog" or len(parts) < 3:
                continue
            if parts[1] != own and any(part.startswith("_") for part in parts[2:]):
                crossing.append(f"{path.relative_to(ROOT)} imports {name}")
    assert crossing == []


#: What ``rolloutlog.core`` may import: the kernel stays free of I/O libraries.
CORE_IMPORTS = ("pydantic", "pydantic_core", "orjson", "rolloutlog.errors", "rolloutlog.core")


def test_the_core_imports_no_io_library() -> None:
    """``core/`` imports the standard library, pydantic, orjson and ``rolloutlog.errors`` only:
    no other room of rolloutlog, no driver, no server (docs/design.md §9)."""
    foreign = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if not name.startswith(CORE_IMPORTS):
                foreign.append(f"{path.relative_to(ROOT)} imports {name}")
    assert foreign == []


def test_the_api_asks_the_coordinator() -> None:
    """The API never reaches into a projector's state: it asks the coordinator's doors."""
    reaching = []
    for path in sorted((ROOT / "api").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in (
                "projectors",
                "trackers",
                "applied",
                "retired",
                "new_starts",
                "new_finishes",
            ):
                reaching.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert reaching == []


def test_no_two_public_classes_share_a_name() -> None:
    """One name per concept (docs/design.md, "Glossary"): a public class's name is defined once
    in the package. An alias kept for a renamed class is not a second definition."""
    where: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
