"""Triton's log-settings and trace-setting extensions.

Log settings drive this process's live log level: log_verbose_level > 0 is DEBUG, then log_info,
log_warning, log_error switch their levels on (the lowest one on sets the root logger's level;
all off leaves CRITICAL only). Logs always go to stderr in the configured format, so `log_file`
and `log_format` are refused unless they name what is already in effect.

Trace settings are validated, stored globally and per model, and reported as Triton reports
them, for Triton clients; they act on nothing. The service's own tracing (service/tracing.py,
OpenTelemetry over OTLP) samples by the standard OTEL_TRACES_SAMPLER variables instead; mapping
trace_rate / trace_count / trace_level onto a sampler is not done.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from modelyard.common.names import echo
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.service.api.names import quoted
from modelyard.service.errors import InvalidInput

LogValue = bool | int | str

_LEVEL_FLAGS = (("log_info", logging.INFO), ("log_warning", logging.WARNING), ("log_error", logging.ERROR))


@dataclass
class LogSettings:
    """The log settings Triton reports, kept in step with the root logger's level."""

    logger: logging.Logger = field(default_factory=logging.getLogger)

    def current(self) -> dict[str, LogValue]:
        level = self.logger.getEffectiveLevel()
        return {
            "log_file": "",
            "log_info": level <= logging.INFO,
            "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR,
            "log_verbose_level": 1 if level <= logging.DEBUG else 0,
            "log_format": "default",
        }

    def update(self, changes: Mapping[str, LogValue]) -> dict[str, LogValue]:
        """Apply the changes (all or nothing) and return the settings now in effect."""
        settings = self.current()
        for key, value in changes.items():
            if key not in settings:
                raise InvalidInput(f"log setting {quoted(key)} is unknown (known: {', '.join(settings)})")
            expected = type(settings[key])
            if type(value) is not expected:
                raise InvalidInput(
                    f"log setting {quoted(key)} takes a {expected.__name__}, got {quoted(value)}"
                )
            if key == "log_file" and value:
                raise InvalidInput("log setting 'log_file': this server logs to stderr only")
            if key == "log_format" and value != "default":
                raise InvalidInput(
                    "log setting 'log_format': only 'default' (the format is set by --log-format)"
                )
            settings[key] = value
        level = logging.CRITICAL
        if settings["log_verbose_level"]:
            level = logging.DEBUG
        else:
            for key, flag_level in _LEVEL_FLAGS:
                if settings[key]:
                    level = flag_level
                    break
        self.logger.setLevel(level)
        return self.current()


TRACE_DEFAULTS: dict[str, tuple[str, ...]] = {
    "trace_file": ("",),
    "trace_level": ("OFF",),
    "trace_rate": ("1000",),
    "trace_count": ("-1",),
    "log_frequency": ("0",),
    "trace_mode": ("triton",),
}
_TRACE_LEVELS = {"OFF", "TIMESTAMPS", "TENSORS"}


@dataclass
class TraceSettings:
    """Global trace settings and per-model overrides, as Triton keeps them."""

    global_settings: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(TRACE_DEFAULTS))
    per_model: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)

    def current(self, model: str = "") -> dict[str, tuple[str, ...]]:
        return (
            {**self.global_settings, **self.per_model.get(model, {})} if model else dict(self.global_settings)
        )

    def update(self, changes: Mapping[str, tuple[str, ...]], model: str = "") -> dict[str, tuple[str, ...]]:
        """Apply the changes (an empty value clears: a model's falls back to the global one, a
        global one to Triton's default) and return the settings now in effect."""
        for key, values in changes.items():
            _check_trace(key, values)
        target = self.per_model.setdefault(model, {}) if model else self.global_settings
        for key, values in changes.items():
            if values:
                target[key] = values
            elif model:
                target.pop(key, None)
            else:
                target[key] = TRACE_DEFAULTS[key]
        return self.current(model)


def _check_trace(key: str, values: tuple[str, ...]) -> None:
    if key not in TRACE_DEFAULTS:
        raise InvalidInput(f"trace setting {quoted(key)} is unknown (known: {', '.join(TRACE_DEFAULTS)})")
    if not values:
        return
    if key == "trace_level":
        unknown = [v for v in values if v not in _TRACE_LEVELS]
        if unknown or ("OFF" in values and len(values) > 1):
            raise InvalidInput(
                f"trace setting 'trace_level': {quoted(list(values))} (OFF, or TIMESTAMPS and/or TENSORS)"
            )
        return
    if len(values) != 1:
        raise InvalidInput(f"trace setting {quoted(key)} takes one value, got {quoted(list(values))}")
    (value,) = values
    if key == "trace_mode" and value not in ("triton", "opentelemetry"):
        raise InvalidInput(f"trace setting 'trace_mode': {quoted(value)} (triton or opentelemetry)")
    minimum = {"trace_rate": 1, "trace_count": -1, "log_frequency": 0}.get(key)
    if minimum is not None:
        try:
            number = int(value)
        except ValueError:
            number = minimum - 1
        if number < minimum:
            raise InvalidInput(f"trace setting {quoted(key)}: {quoted(value)} is not an integer >= {minimum}")


# -- the RPCs' messages ---------------------------------------------------------------------


def answer_log_settings(logs: LogSettings, request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
    """LogSettings: the request's changes applied, and the settings now in effect."""
    changes: dict[str, LogValue] = {}
    for key, value in request.settings.items():
        kind = value.WhichOneof("parameter_choice")
        if kind is None:
            raise InvalidInput(f"log setting {echo(key)} has no value")
        changes[key] = getattr(value, kind)
    current = logs.update(changes)
    response = pb.LogSettingsResponse()
    for key, setting in current.items():
        entry = response.settings[key]
        if isinstance(setting, bool):
            entry.bool_param = setting
        elif isinstance(setting, int):
            entry.uint32_param = setting
        else:
            entry.string_param = setting
    return response


def answer_trace_setting(traces: TraceSettings, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
    """TraceSetting: the request's changes applied (to its model's, or with no name the global
    settings), and the settings now in effect for it."""
    changes = {key: tuple(value.value) for key, value in request.settings.items()}
    current = traces.update(changes, request.model_name)
    response = pb.TraceSettingResponse()
    for key, values in current.items():
        response.settings[key].value.extend(values)
    return response
