"""The public surface of the log and projections packages is what their ``__init__`` names; a
change to it is deliberate (catalog, api, trainer and participants pin theirs beside their tests)."""

from __future__ import annotations

import rolloutlog.log
import rolloutlog.projections


def test_log_surface() -> None:
    assert sorted(rolloutlog.log.__all__) == sorted(
        [
            *(
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
            ),
            "DEFAULT_MAX_RECORD_BYTES",
            "DEFAULT_PARTITIONS",
            "Event",
            "Log",
            "OPAQUE_FIELD",
            "Opaque",
            "Participant",
            "ParticipantKind",
            "Position",
            "Record",
            "SERVICE_EVENT_TYPES",
            "attempt_started_record",
            "capture_key",
            "decode_event",
            "decode_record",
            "encode_event",
            "encode_record",
            "encode_record_dict",
            "episode_id_problem",
            "ledger_digest",
            "marker_record",
            "name_problem",
            "open_log",
            "peek_record",
            "parse_capture_key",
            "partition_for",
            "record_episode",
            "record_meta",
            "record_payload",
            "record_payload_size",
            "record_payload_start",
            "record_restore_id",
            "run_name_problem",
            "split_record",
            "task_digest",
            "token_count",
            "validate_event",
            "validate_events",
        ]
    )
    for name in rolloutlog.log.__all__:
        assert hasattr(rolloutlog.log, name), name


def test_projections_surface() -> None:
    assert sorted(rolloutlog.projections.__all__) == [
        "BoundaryView",
        "CheckpointResult",
        "Coordinator",
        "EpisodeFold",
        "EpisodeProjection",
        "EpisodeStatus",
        "GenerationCut",
        "LedgerEntry",
        "RecordView",
        "RestoreResult",
        "SessionView",
        "ledger_digest",
        "project_episode",
        "project_events",
        "select_records",
        "token_count",
    ]
    for name in rolloutlog.projections.__all__:
        assert hasattr(rolloutlog.projections, name), name
