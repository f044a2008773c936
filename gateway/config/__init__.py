"""All of kvgate's settings: one validated tree, from a YAML file plus `KVGATE_*` overrides.

Environment variables override the file, nested keys joined by `__`
(`KVGATE_SERVER__PORT=9000`); a list is JSON (`'["a","b"]'`) or comma-separated (`a,b`).
Validation happens once at start; `load_config` raises `ConfigError` whose message is one line
naming the bad key and why.

One import, `from gateway.config import X`, for every name; the models live in modules by concern:
`server` (the data plane's listener, tenants), `control` (control plane, shared state, telemetry),
`upstream` (engine URLs, connections, retries, health, breaker, load scrapes), `scheduler`,
`engines` (managed fleets), `endpoints` (unmanaged and discovered replicas), `prefix` (policy,
prefix index, canonicalization), `pools`, `routes`, `settings` (the whole tree and the checks
across it), `loading` (file, overrides, one-line errors) and `reference` (docs/settings.md,
generated from the models).
"""

from gateway.config.base import ConfigError, Strict
from gateway.config.control import ControlConfig, StateConfig, TelemetryConfig
from gateway.config.endpoints import (
    DiscoveryConfig,
    EndpointConfig,
    KubernetesDiscoveryConfig,
    KVEventsSource,
)
from gateway.config.engines import (
    ChunkedPrefill,
    EngineLora,
    EngineSpec,
    KVOffload,
    LoraModuleSpec,
    PDRoles,
    SimOptions,
)
from gateway.config.epp import EppConfig
from gateway.config.loading import load_config
from gateway.config.pools import (
    AdapterSpec,
    ClientPassthrough,
    FailoverConfig,
    PDConfig,
    PoolConfig,
    PoolLoraConfig,
    Task,
)
from gateway.config.prefix import CanonicalizeConfig, CanonicalizeRule, PolicyConfig, PrefixConfig
from gateway.config.reference import REFERENCE_COMMAND, setting_keys, settings_reference
from gateway.config.routes import (
    MAX_WEIGHT,
    MIN_POSITIVE_WEIGHT,
    HeaderMatch,
    RouteConfig,
    RouteRule,
    RouteWeight,
    StickyConfig,
    WeightedPool,
    check_weight,
)
from gateway.config.scheduler import PriorityClass, SchedulerConfig
from gateway.config.server import ServerConfig, TenantConfig
from gateway.config.settings import Settings
from gateway.config.upstream import (
    BreakerConfig,
    HealthConfig,
    RetryConfig,
    ScrapeConfig,
    Target,
    UpstreamConfig,
    UpstreamTLS,
    parse_target,
)

__all__ = [
    "MAX_WEIGHT",
    "MIN_POSITIVE_WEIGHT",
    "REFERENCE_COMMAND",
    "AdapterSpec",
    "BreakerConfig",
    "CanonicalizeConfig",
    "CanonicalizeRule",
    "ChunkedPrefill",
    "ClientPassthrough",
    "ConfigError",
    "ControlConfig",
    "DiscoveryConfig",
    "EndpointConfig",
    "EngineLora",
    "EngineSpec",
    "EppConfig",
    "FailoverConfig",
    "HeaderMatch",
    "HealthConfig",
    "KVEventsSource",
    "KVOffload",
    "KubernetesDiscoveryConfig",
    "LoraModuleSpec",
    "PDConfig",
    "PDRoles",
    "PolicyConfig",
    "PoolConfig",
    "PoolLoraConfig",
    "PrefixConfig",
    "PriorityClass",
    "RetryConfig",
    "RouteConfig",
    "RouteRule",
    "RouteWeight",
    "SchedulerConfig",
    "ScrapeConfig",
    "ServerConfig",
    "Settings",
    "SimOptions",
    "StateConfig",
    "StickyConfig",
    "Strict",
    "Target",
    "Task",
    "TelemetryConfig",
    "TenantConfig",
    "UpstreamConfig",
    "UpstreamTLS",
    "WeightedPool",
    "check_weight",
    "load_config",
    "parse_target",
    "setting_keys",
    "settings_reference",
]
