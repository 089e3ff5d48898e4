"""Traces (OpenTelemetry): the spans rolloutlog opens, W3C trace context in and out of HTTP
requests, and the service's exporter configured from the standard ``OTEL_*`` variables.

Tracing is on once a tracer provider is installed: ``configure_tracing`` installs one in the
service when an exporter is configured; a trainer or participant process installs its own (any
OpenTelemetry set-up; the SDK and the trainer client use the global provider). While it is off,
``span`` hands back one shared no-op context manager and ``client_span`` the headers as they
are, so a disabled point costs a check of one global (``benchmarks/tracing_overhead.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import time
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Span, SpanKind
from opentelemetry.util.types import AttributeValue

from rolloutlog.errors import ConfigurationError

__all__ = [
    "StageParent",
    "client_span",
    "configure_tracing",
    "current_trace_id",
    "flush_tracing",
    "path_template",
    "set_attributes",
    "span",
    "stage_parent",
    "traced",
    "tracer_provider",
    "tracing",
    "use_tracer_provider",
]

_NAME = "rolloutlog"
P = ParamSpec("P")
R = TypeVar("R")
_NOOP = contextlib.nullcontext()
#: A provider installed by ``use_tracer_provider`` (tests) instead of the global one.
_override: trace.TracerProvider | None = None
#: (provider, its tracer): a tracer is made once per provider, not per span.
_cached: tuple[object, trace.Tracer] | None = None
#: The provider ``configure_tracing`` installed (flushed by ``flush_tracing``).
_configured: Any = None


if hasattr(trace, "_TRACER_PROVIDER"):
    # ``get_tracer_provider()`` looks ``OTEL_PYTHON_TRACER_PROVIDER`` up in the environment on
    # every call until a provider is set (measured: ~1.9 us, most of the disabled path's cost);
    # the global it fills is read instead, after one call that loads a provider the environment
    # names.
    trace.get_tracer_provider()

    def _global() -> object:
        return trace._TRACER_PROVIDER

else:  # pragma: no cover - another opentelemetry-api layout

    def _global() -> object:
        return trace.get_tracer_provider()


def _provider() -> trace.TracerProvider | None:
    """The provider spans go to, or None while tracing is off."""
    if _override is not None:
        return _override
    provider = _global()
    if provider is None or isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        return None
    return cast(trace.TracerProvider, provider)


def tracer_provider() -> trace.TracerProvider | None:
    """The provider spans go to (for FastAPI's server spans), or None while tracing is off."""
    return _provider()


def tracing() -> bool:
    """Whether spans are recorded (a tracer provider is installed)."""
    return _provider() is not None


def _tracer(provider: trace.TracerProvider) -> trace.Tracer:
    global _cached
    cached = _cached
    if cached is None or cached[0] is not provider:
        cached = (provider, provider.get_tracer(_NAME))
        _cached = cached
    return cached[1]


def span(
    name: str, attributes: Mapping[str, AttributeValue] | None = None
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around a block, current inside it (its children nest under it); a no-op while
    tracing is off."""
    provider = _provider()
    if provider is None:
        return _NOOP
    return _tracer(provider).start_as_current_span(name, attributes=attributes)


_IDS = {"runs": "{run}", "episodes": "{episode}", "participants": "{participant}"}


def path_template(path: str) -> str:
    """A request path with its names and ids replaced (``/v1/runs/{run}/restores/{id}``): the
    name of a client span, as low in cardinality as the server's route."""
    parts = path.split("?", 1)[0].split("/")
    for i in range(1, len(parts)):
        if parts[i - 1] in _IDS and parts[i]:
            parts[i] = _IDS[parts[i - 1]]
        elif parts[i].isdigit():
            parts[i] = "{id}"
    return "/".join(parts)


class client_span:  # lower case: used like a function, as ``span`` is
    """A client span around one HTTP call (``with`` or ``async with``), handing back
    ``headers`` with its ``traceparent``. The span is not made current: it may wrap a response
    streamed through a generator."""

    __slots__ = ("call", "headers", "method", "path")

    def __init__(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.call: Span | None = None

    def __enter__(self) -> Mapping[str, str]:
        provider = _provider()
        if provider is None:
            return self.headers
        template = path_template(self.path)
        self.call = call = _tracer(provider).start_span(
            f"{self.method} {template}",
            kind=SpanKind.CLIENT,
            attributes={"http.request.method": self.method, "url.template": template},
        )
        carrier = dict(self.headers)
        propagate.inject(carrier, context=trace.set_span_in_context(call))
        return carrier

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        call = self.call
        if call is None:
            return
        if exc is not None:
            call.record_exception(exc)
            call.set_status(trace.StatusCode.ERROR, type(exc).__name__)
        call.end()

    async def __aenter__(self) -> Mapping[str, str]:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


def traced(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: the function (sync, or a coroutine function) runs inside a span, so the calls
    it makes share one trace (``resume_run``: take-over, restore, the restore's episodes)."""

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                with span(name):
                    return await function(*args, **kwargs)

            return cast(Callable[P, R], run_async)

        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with span(name):
                return function(*args, **kwargs)

        return run

    return wrap


def set_attributes(attributes: Mapping[str, AttributeValue]) -> None:
    """Attributes on the current span (when one is recording)."""
    if _provider() is None:
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


class StageParent:
    """The span that stages timed after the fact hang under (``StageTimer``): each stage is a
    finished child span named ``<parent>.<stage>``, ending now."""

    __slots__ = ("context", "prefix", "tracer")

    def __init__(self, tracer: trace.Tracer, context: Context, prefix: str) -> None:
        self.tracer = tracer
        self.context = context
        self.prefix = prefix

    def record(self, stage: str, seconds: float) -> None:
        end = time.time_ns()
        child = self.tracer.start_span(
            f"{self.prefix}.{stage}", context=self.context, start_time=end - int(seconds * 1e9)
        )
        child.end(end_time=end)


def stage_parent() -> StageParent | None:
    """The current span as a ``StageParent``, or None while tracing is off."""
    provider = _provider()
    if provider is None:
        return None
    current = trace.get_current_span()
    if not current.is_recording():
        return None
    from opentelemetry import context

    name = getattr(current, "name", None)
    return StageParent(_tracer(provider), context.get_current(), name or _NAME)


def current_trace_id() -> str | None:
    """The current span's trace id (32 hex digits), or None."""
    if _provider() is None:
        return None
    found = trace.get_current_span().get_span_context()
    return trace.format_trace_id(found.trace_id) if found.is_valid else None


@contextlib.contextmanager
def use_tracer_provider(provider: trace.TracerProvider | None) -> Iterator[None]:
    """Send rolloutlog's spans to ``provider`` inside the block instead of the global provider
    (which OpenTelemetry lets a process set once): tests with an in-memory exporter."""
    global _override
    previous, _override = _override, provider
    try:
        yield
    finally:
        _override = previous


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not names:
        # An endpoint alone asks for OTLP, as the OpenTelemetry distributions read it.
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    return [name.strip() for name in names.split(",") if name.strip() not in ("", "none")]


def _exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER={name!r} is not supported: use otlp, console or none"
        )
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        if protocol == "grpc":
            module = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
        else:
            module = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
        exporter = importlib.import_module(module).OTLPSpanExporter
    except ImportError as e:
        raise ConfigurationError.missing_extra(f"OTLP trace export ({protocol})", "otlp", e) from e
    return exporter()  # endpoint, headers, timeout: from the OTEL_EXPORTER_OTLP_* vars


def configure_tracing(env: Mapping[str, str] | None = None) -> bool:
    """Install a tracer provider exporting the service's spans when the environment asks for
    it (``OTEL_TRACES_EXPORTER`` ``otlp``/``console``, or an ``OTEL_EXPORTER_OTLP_*ENDPOINT``),
    unless the process has one already. ``OTEL_SERVICE_NAME`` (default ``rolloutlog``),
    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_TRACES_SAMPLER`` are read by the SDK. Returns whether
    spans are recorded."""
    global _configured
    env = os.environ if env is None else env
    if _configured is not None or tracing():
        return tracing()
    names = _exporter_names(env)
    if not names:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name, env) for name in names]
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": _NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = provider
    return True


def flush_tracing() -> None:
    """Export the spans ``configure_tracing``'s provider still holds (at a service's stop)."""
    if _configured is not None:
        _configured.force_flush()
