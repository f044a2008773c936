"""The whole tree (`Settings`), with `KVGATE_*` environment overrides and the checks across its parts."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway.config.control import ControlConfig, StateConfig, TelemetryConfig
from gateway.config.epp import EppConfig
from gateway.config.pools import PoolConfig
from gateway.config.routes import RouteConfig
from gateway.config.scheduler import SchedulerConfig
from gateway.config.server import ServerConfig, TenantConfig
from gateway.config.upstream import (
    BreakerConfig,
    HealthConfig,
    RetryConfig,
    ScrapeConfig,
    UpstreamConfig,
    parse_target,
)


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_origin(annotation) is list or annotation is list


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The settings block an annotation holds (itself, a list's item, an optional one), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


class _EnvSource(EnvSettingsSource):
    """`KVGATE_*` variables, where a list may also be written comma-separated (`a,b`)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            if isinstance(value, str) and field is not None and _is_list(field.annotation):
                return [item.strip() for item in value.split(",") if item.strip()]
            raise


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid")

    server: ServerConfig = Field(
        default_factory=ServerConfig, description="The OpenAI API's listener and client limits"
    )
    control: ControlConfig = Field(default_factory=ControlConfig, description="The admin API's own listener")
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig, description="Connections to engines")
    retry: RetryConfig = Field(default_factory=RetryConfig, description="Retries before the first byte")
    health: HealthConfig = Field(default_factory=HealthConfig, description="Health checks of replicas")
    breaker: BreakerConfig = Field(
        default_factory=BreakerConfig, description="Each replica's circuit breaker"
    )
    scrape: ScrapeConfig = Field(
        default_factory=ScrapeConfig, description="Engine load, read from each replica"
    )
    state: StateConfig = Field(default_factory=StateConfig, description="State shared by several gateways")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Queueing and admission")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Metrics and traces")
    epp: EppConfig = Field(default_factory=EppConfig, description="kvgate epp, the Endpoint Picker")
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="Clients with their own keys and limits (besides server.api_keys)"
    )
    pools: list[PoolConfig] = Field(default_factory=list, description="The engines, one pool per model")
    routes: list[RouteConfig] = Field(
        default_factory=list, description="Model names mapped to pools (a pool's own model needs none)"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment wins over the file (the file arrives as init kwargs).
        return (_EnvSource(settings_cls), init_settings)

    @model_validator(mode="after")
    def _admin_key(self) -> Settings:
        """`server.admin_key`, from before the control plane had its own listener, still works."""
        old, new = self.server.admin_key, self.control.admin_key
        if old and new and old != new:
            raise ValueError("server.admin_key (deprecated) and control.admin_key differ: keep control's")
        if old and not new:
            self.control.admin_key = old
        return self

    def deprecations(self) -> list[str]:
        """What the settings use that is deprecated, one line each, to be logged at start."""
        if self.server.admin_key:
            return ["server.admin_key is deprecated: use control.admin_key (KVGATE_CONTROL__ADMIN_KEY)"]
        return []

    @model_validator(mode="after")
    def _objectives(self) -> Settings:
        classes = [c.name for c in self.scheduler.classes]
        for objective, name in self.epp.objectives.items():
            if name not in classes:
                raise ValueError(f"epp.objectives.{objective}: {name!r} is not a class of {classes}")
        return self

    @model_validator(mode="after")
    def _cross_refs(self) -> Settings:
        pool_names = [p.name for p in self.pools]
        if len(set(pool_names)) != len(pool_names):
            raise ValueError(f"pools: each pool needs a name of its own: {pool_names}")
        pools = {p.name: p for p in self.pools}
        for i, route in enumerate(self.routes):
            for j, rule in enumerate(route.rules):
                names = [wp.name for wp in rule.pools]
                if len(set(names)) != len(names):
                    raise ValueError(f"routes.{i}.rules.{j}: a pool may appear once per rule: {names}")
                for wp in rule.pools:
                    if wp.name not in pool_names:
                        raise ValueError(f"routes.{i}.rules.{j}: unknown pool {wp.name!r}")
                    pool = pools[wp.name]
                    declared = {a.name for a in pool.adapter_specs}
                    if wp.adapter is not None and wp.adapter not in declared and not pool.lora.discover:
                        raise ValueError(
                            f"routes.{i}.rules.{j}: pool {wp.name!r} declares no adapter {wp.adapter!r} "
                            "(pools[].lora.adapters, engines.lora.modules, or lora.discover)"
                        )
        models = {p.model for p in self.pools}
        for i, p in enumerate(self.pools):
            clash = sorted(models & {a.name for a in p.adapter_specs})
            if clash:
                raise ValueError(
                    f"pools.{i} ({p.name}).lora: adapter names {clash} are also pool model names"
                )
        if isinstance(self.server.ready, list):
            unknown = [name for name in self.server.ready if name not in pool_names]
            if unknown or not self.server.ready:
                what = unknown or "an empty list"
                raise ValueError(f"server.ready: {what}: expected names of pools {pool_names}")
        _check_ports(self)
        classes = {c.name for c in self.scheduler.classes}
        for i, t in enumerate(self.tenants):
            if t.max_priority is not None and t.max_priority not in classes:
                raise ValueError(
                    f"tenants.{i} ({t.name}).max_priority: {t.max_priority!r} is not one of "
                    f"scheduler.classes {sorted(classes)}"
                )
        return self

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)


_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _same_socket(a: tuple[str, int], b: tuple[str, int], *, listeners: bool) -> bool:
    """Are `a` (a listener) and `b` (another listener, else an engine's address) one port of this
    host? A wildcard listener takes the port on every address; an engine's address is this host's
    only when it is a loopback or wildcard one, or the listener's own."""
    (host_a, port_a), (host_b, port_b) = a, b
    if port_a != port_b:
        return False
    local = _LOOPBACK | _WILDCARDS
    if host_a == host_b or (host_a in local and host_b in local):
        return True
    return listeners and (host_a in _WILDCARDS or host_b in _WILDCARDS)


def _check_ports(settings: Settings) -> None:
    """No two of the gateway's listeners, its launched engines (with a `base_port`) and the engines it
    is told to reach share a port of this host: a control port that is also an engine's address
    would send the engine's requests to the admin API."""
    listeners: list[tuple[str, tuple[str, int]]] = []
    if settings.server.port:
        listeners.append(("server.port", (settings.server.host, settings.server.port)))
    if settings.control.admin_key and settings.control.port:
        listeners.append(("control.port", (settings.control.host, settings.control.port)))
    for i, pool in enumerate(settings.pools):
        spec = pool.engines
        if spec is not None and spec.base_port:
            for n in range(spec.replicas):
                listeners.append((f"pools.{i}.engines.base_port", (spec.host, spec.base_port + n)))
    targets: list[tuple[str, tuple[str, int]]] = []
    for i, pool in enumerate(settings.pools):
        for j, ep in enumerate(pool.endpoints):
            target = parse_target(ep.url)
            targets.append((f"pools.{i}.endpoints.{j} ({ep.url})", (target.host, target.port)))
    for k, (name, address) in enumerate(listeners):
        clashes = [o for o, there in listeners[k + 1 :] if _same_socket(address, there, listeners=True)]
        clashes += [o for o, there in targets if _same_socket(address, there, listeners=False)]
        if clashes:
            raise ValueError(
                f"{name} {address[1]} is also {clashes[0]}'s port: each listener and engine needs its own"
            )
