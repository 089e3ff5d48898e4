"""The controller's fence (docs/design.md §5): a checkpoint or restore request carries the
run's controller epoch, and only the current one may act."""

from __future__ import annotations

from rolloutlog.errors import StaleController

__all__ = ["check_controller_epoch"]


def check_controller_epoch(run: str, controller_epoch: int, current: int) -> None:
    """``StaleController`` unless ``controller_epoch`` is the run's ``current`` one (0: nobody
    has taken the controller over yet)."""
    if current == 0:
        raise StaleController(
            f"run {run!r} has no controller yet: take over the controller first",
            run=run,
            controller_epoch=controller_epoch,
            current_epoch=current,
        )
    if controller_epoch != current:
        raise StaleController(
            f"controller epoch {controller_epoch} of run {run!r} is stale (current: {current})",
            run=run,
            controller_epoch=controller_epoch,
            current_epoch=current,
        )
