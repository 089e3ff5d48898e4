"""The trainer side of rolloutlog: REST clients, the checkpoint schedule, resuming a run."""

from rolloutlog.trainer._async_client import AsyncTrainerClient
from rolloutlog.trainer._client import DEFAULT_URL, TrainerClient
from rolloutlog.trainer._resume import Dispatch, ResumePlan, resume_run, resume_run_sync
from rolloutlog.trainer._scheduler import CheckpointScheduler
from rolloutlog.trainer._types import (
    CheckpointInfo,
    EpisodeResult,
    RestoreEpisode,
    RestoreInfo,
    ServiceError,
    StagingKeyList,
    error_from_body,
    error_from_response,
)

__all__ = [
    "DEFAULT_URL",
    "AsyncTrainerClient",
    "CheckpointInfo",
    "CheckpointScheduler",
    "Dispatch",
    "EpisodeResult",
    "RestoreEpisode",
    "RestoreInfo",
    "ResumePlan",
    "ServiceError",
    "StagingKeyList",
    "TrainerClient",
    "error_from_body",
    "error_from_response",
    "resume_run",
    "resume_run_sync",
]
