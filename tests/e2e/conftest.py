"""Fixtures of the crash suite: every scenario runs on both deployments (embedded log + SQLite
catalog; Kafka (Tansu here) + PostgreSQL), with the service and the participants as real
processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path

import pytest

from rolloutlog.participants.sim import Gym
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS
from tests.e2e._gym import Episodes, gym_for
from tests.e2e._harness import Appends, Deployment, Puppet, Replicas, Service, kafka_log_url

RUN = "crash"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed scenario on a simulated Gym reports the end of every process's log (the
    service's and each participant's): what a participant did is in no traceback."""
    report = yield
    gym = getattr(item, "funcargs", {}).get("gym")
    if report.failed and report.when == "call" and isinstance(gym, Gym):
        for name in ["service", *gym.processes]:
            report.sections.append((f"{name}'s log, its end", gym.log_tail(name)))
    return report


@pytest.fixture(
    params=[
        "embedded",
        pytest.param("kafka", marks=[pytest.mark.kafka, pytest.mark.postgres]),
    ]
)
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Deployment:
    data_dir = tmp_path / "data"
    if request.param == "embedded":
        return Deployment("embedded", data_dir)
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    catalog_url = request.getfixturevalue("postgres_schema")
    return Deployment("kafka", data_dir, kafka_log_url(bootstrap), str(catalog_url))


#: For a module whose tests run on the Kafka deployment only.
KAFKA_ONLY = pytest.mark.parametrize("deployment", ["kafka"], indirect=True)


async def start_replicas(
    deployment: Deployment, workdir: Path, count: int, tokens: bool = True
) -> Replicas:
    replicas = Replicas(deployment, workdir, count, tokens=tokens)
    try:
        await replicas.start()
    except BaseException:
        replicas.stop()
        raise
    return replicas


@pytest.fixture
async def three(deployment: Deployment, tmp_path: Path) -> AsyncIterator[Replicas]:
    """Three replicas of ``deployment`` (stopped after)."""
    replicas = await start_replicas(deployment, tmp_path, 3)
    try:
        yield replicas
    finally:
        replicas.stop()


@pytest.fixture
async def service(deployment: Deployment, tmp_path: Path) -> AsyncIterator[Service]:
    running = Service(deployment, tmp_path)
    await running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
async def appends() -> AsyncIterator[Appends]:
    """Appends to ``RUN`` over HTTP; its client is closed however the test ends (one a failed
    assertion left open was collected during a later test, whose warnings check failed)."""
    made = Appends(RUN)
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def trainer(service: Service) -> AsyncIterator[AsyncTrainerClient]:
    """A trainer client of a fresh run (4 partitions) whose controller it has taken over."""
    async with AsyncTrainerClient(service.url, token=TOKENS["admin"], timeout_s=60) as client:
        await client.create_run(RUN, partitions=4)
        await client.take_over(RUN)
        yield client


@pytest.fixture
def puppets(service: Service, tmp_path: Path) -> Iterator[Callable[[str], Puppet]]:
    """Starts participant processes; whatever is still running at the end is SIGKILLed."""
    started: list[Puppet] = []

    def start(name: str) -> Puppet:
        puppet = Puppet(service, RUN, tmp_path, name)
        started.append(puppet)
        return puppet

    yield start
    for puppet in started:
        if puppet.proc.poll() is None:
            puppet.kill()
        else:
            puppet.close()


@pytest.fixture
def policy_workers() -> int:
    """Worker processes of the Gym's policy server (a scenario parametrizes it to 2)."""
    return 1


@pytest.fixture
async def gym(deployment: Deployment, policy_workers: int) -> AsyncIterator[Gym]:
    """The simulated Gym (service and six participant processes) on the deployment; the counter
    server verifies in ``replay`` mode, the stateless verifier in ``wait`` mode."""
    running = gym_for(deployment, verifier_verify="wait", policy_workers=policy_workers)
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def gym_trainer(gym: Gym) -> AsyncIterator[AsyncTrainerClient]:
    async with AsyncTrainerClient(gym.service_url, timeout_s=60) as client:
        await client.take_over(gym.run)
        yield client


@pytest.fixture
async def episodes(gym: Gym) -> AsyncIterator[Episodes]:
    dispatched = Episodes(gym)
    try:
        yield dispatched
    finally:
        await dispatched.close()
