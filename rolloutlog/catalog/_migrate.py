"""Apply the catalog's Alembic migrations programmatically, in one transaction."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy.engine import Connection

from rolloutlog.catalog._schema import VERSION_TABLE
from rolloutlog.errors import CatalogVersionError

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config() -> Config:
    """An Alembic config for the shipped migrations (no ``alembic.ini`` needed)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def head_revision() -> str:
    """The newest schema revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the catalog ships at least one migration"
    return head


def current_revision(connection: Connection) -> str | None:
    """The revision the catalog's database is at (None for an empty database)."""
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def upgrade(connection: Connection) -> tuple[str | None, str]:
    """Upgrade to head inside ``connection``'s transaction; return (from, to) revisions.

    Raises ``CatalogVersionError`` when the database is at a revision this code does not know,
    i.e. it was migrated by a newer rolloutlog.
    """
    config = alembic_config()
    script = ScriptDirectory.from_config(config)
    head = script.get_current_head()
    assert head is not None
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    found = context.get_current_heads()
    for revision in found:
        try:
            known = script.get_revision(revision)
        except (RevisionError, CommandError):
            known = None
        if known is None:
            raise CatalogVersionError(
                f"the catalog is at schema revision {revision!r}, which this rolloutlog does "
                f"not know (its newest is {head!r}): it was written by a newer rolloutlog; "
                "upgrade rolloutlog rather than downgrading the catalog",
                revision=revision,
                head=head,
            )
    before = found[0] if found else None
    if before != head:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    return before, head
