from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.log import Log, open_log

LogFactory = Callable[..., Awaitable[Log]]


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
async def log_factory(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LogFactory]:
    """Opens started logs of one backend over the same storage; closes them all at the end."""
    if request.param == "kafka":
        bootstrap = request.getfixturevalue("kafka_bootstrap")
        # Topics outlive a test on a shared broker: give each test its own prefix.
        url = f"kafka://{bootstrap}?topic_prefix=t{uuid.uuid4().hex[:10]}."
    else:
        url = f"embedded://{tmp_path / 'data'}"
    opened: list[Log] = []

    async def factory(**options: Any) -> Log:
        log = open_log(url, **options)
        await log.start()
        opened.append(log)
        return log

    try:
        yield factory
    finally:
        for log in opened:
            await log.close()


@pytest.fixture
async def log(log_factory: LogFactory) -> Log:
    return await log_factory()
