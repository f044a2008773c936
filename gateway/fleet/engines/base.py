"""The engine adapter interface: everything that differs between engine kinds, behind one small API.

An adapter turns a fleet's `EngineSpec` into one replica's command line and environment, names
the endpoint that reports the engine's load and parses it into `EngineLoad`, maps a gateway
priority level onto the engine's `priority` body field (and caps a client's own value in the
engine's direction), and speaks the engine's dialect for the request path: its prefill/decode
connector (`connector`, one module each), how an answer is continued from its text, how a LoRA
adapter is named in `model`, where its tokenizer is, and which body fields and headers steer it
(only the gateway may send those). Error bodies need no adapter: one function
(`gateway.errors.normalize_error_body`) reads vLLM's `{"error": {...}}`, SGLang's flat
`{"object": "error", ...}` and anything else. Adapters are stateless, one per engine kind
(`get_adapter`), plus the simulator told to speak SGLang's API (`adapter_for_spec`). A new engine
kind is one module here and its test (`openai.py`, any OpenAI-compatible server, is the smallest).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gateway.config import EngineSpec
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines.connector import Connector
from gateway.fleet.replica import Role

# Names of the auxiliary ports a replica may need besides its HTTP port.
KV_EVENTS_PORT = "kv_events"
NIXL_SIDE_CHANNEL_PORT = "nixl_side_channel"
BOOTSTRAP_PORT = "bootstrap"
# Managed engines publish KV events under this topic, set explicitly on both ends.
KV_EVENTS_TOPIC = "kv-events"


@dataclass(frozen=True, slots=True)
class ReplicaSlot:
    """One replica's place in its fleet: what an adapter needs to write its command line."""

    index: int
    name: str
    role: Role
    host: str
    port: int
    gpu_ids: tuple[int, ...] | None = None
    gpu_sharers: int = 1  # replicas on this replica's most shared GPU, itself included
    aux_ports: Mapping[str, int] = field(default_factory=dict)
    kv_events: bool = False

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a subscriber connects to this replica's KV events (None when they are off)."""
        if not self.kv_events:
            return None
        port = self.aux_ports.get(KV_EVENTS_PORT)
        if port is None:
            return f"ipc://{kv_events_ipc_dir()}/kv-{self.port}.sock"
        return f"tcp://{connect_host(self.host)}:{port}"


def connect_host(host: str) -> str:
    """An address to reach a server bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def kv_events_port_needed(spec: EngineSpec) -> bool:
    """A TCP port for the replica's KV events: only for engines reachable beyond loopback (a
    loopback engine publishes on a Unix socket instead, see `kv_events_config`)."""
    return spec.kv_events and not is_loopback(spec.host)


def kv_events_ipc_dir() -> Path:
    """The private directory of loopback engines' KV event sockets (one per user)."""
    return Path(tempfile.gettempdir()) / f"kvgate-{os.getuid()}"


def prepare_ipc_endpoint(endpoint: str | None) -> None:
    """Create the directory of an `ipc://` endpoint, readable by this user only, before an
    engine binds there; refuse a directory that someone else owns or can enter."""
    if endpoint is None or not endpoint.startswith("ipc://"):
        return
    directory = Path(endpoint.removeprefix("ipc://")).parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{directory} must be a directory of this user's with mode 0700")


def valued_flags(*pairs: tuple[str, object]) -> list[str]:
    """`flag value` for each pair whose value is set (None: the engine's default)."""
    return [arg for flag, value in pairs if value is not None for arg in (flag, str(value))]


def compact_json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def kv_events_config(slot: ReplicaSlot) -> str:
    """vLLM's (and SGLang's) `--kv-events-config`. Both engines' ZMQ publisher BINDS only an
    endpoint holding `*` or `::` or an `ipc://` path, and otherwise CONNECTS (vLLM 0.26
    vllm/distributed/kv_events.py, SGLang sglang/srt/disaggregation/kv_events.py), so an
    address like tcp://127.0.0.1:PORT reaches no subscriber. A loopback engine binds a Unix
    socket in a private directory (reachable by this user only, where a loopback TCP port is
    open to every local user); an engine bound wider binds `tcp://*:PORT`. The topic is set
    explicitly (the engines' default is the empty string) and subscribed to by the gateway."""
    endpoint = slot.kv_events_endpoint
    assert endpoint is not None, "kv_events_config for a replica without KV events"
    bind = endpoint if endpoint.startswith("ipc://") else f"tcp://*:{slot.aux_ports[KV_EVENTS_PORT]}"
    return compact_json(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": bind, "topic": KV_EVENTS_TOPIC}
    )


def split_fraction(total: float, sharers: int) -> str:
    """A per-replica memory fraction, rounded down so the replicas never sum above `total`."""
    return f"{math.floor(total / sharers * 1000) / 1000:g}"


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Sample:
    labels: str  # the raw text between the braces; parse with `labels()` only when needed
    value: float

    def label_map(self) -> dict[str, str]:
        return dict(_LABEL.findall(self.labels))


def scan_exposition(text: str, names: Iterable[str]) -> dict[str, list[Sample]]:
    """Samples of the wanted metric names from Prometheus text, found with `str.find`.

    An engine's exposition has hundreds of histogram lines; a full parser costs tens of
    milliseconds per scrape, while the load figures need only a handful of series.
    """
    text = "\n" + text
    found: dict[str, list[Sample]] = {}
    for name in names:
        samples: list[Sample] = []
        needle = "\n" + name
        pos = text.find(needle)
        while pos != -1:
            start = pos + len(needle)
            end = text.find("\n", start)
            line = text[start:] if end == -1 else text[start:end]
            if line[:1] == "{":
                close = line.rfind("}")
                labels, rest = line[1:close], line[close + 1 :]
            else:
                labels, rest = "", line
            parts = rest.split()
            # `name_bucket{...` or `name_total` share the prefix: only an exact name matches.
            if parts and (line[:1] in ("{", " ", "\t")):
                with contextlib.suppress(ValueError):
                    samples.append(Sample(labels, float(parts[0])))
            pos = -1 if end == -1 else text.find(needle, end)
        found[name] = samples
    return found


def total(samples: list[Sample]) -> float:
    return sum(s.value for s in samples)


def mean(samples: list[Sample]) -> float:
    return total(samples) / len(samples) if samples else 0.0


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of `name` in a command line (`--flag value` or `--flag=value`), if given."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


class EngineAdapter(ABC):
    """What kvgate needs to know about one engine kind."""

    kind: ClassVar[str]
    connector: Connector | None = None
    """How this engine's prefill/decode pairs hand a prompt's KV over (None: no disaggregation)."""
    continues: ClassVar[bool] = True
    """Whether an answer can be continued from its text (`continuation`): failover needs it."""
    load_path: str | None
    """The endpoint `parse_load` understands (None: the engine reports no load)."""
    health_path: ClassVar[str] = "/health"
    lora_load_path: ClassVar[str] = "/v1/load_lora_adapter"
    """Where the engine loads a LoRA adapter at run time (body: lora_name, lora_path)."""
    uses_gpus: ClassVar[bool] = True
    # What steers the engine (PD transfer targets, data-parallel placement, engine request ids,
    # code it would run, fault injection): a client's copy is removed (gateway/path/sanitize.py).
    control_fields: ClassVar[frozenset[str]] = frozenset()
    control_headers: ClassVar[frozenset[str]] = frozenset()
    control_header_prefixes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def aux_port_names(self, spec: EngineSpec, role: Role) -> tuple[str, ...]:
        """The auxiliary ports (beyond HTTP) a replica with this role needs, each distinct."""

    def aux_port_span(self, spec: EngineSpec, name: str) -> int:
        """How many consecutive ports the auxiliary port `name` occupies (its first is passed)."""
        return 1

    @abstractmethod
    def command(
        self, spec: EngineSpec, model: str, slot: ReplicaSlot, served_model_name: str | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """The replica's argv and the environment variables to set on top of the gateway's."""

    @abstractmethod
    def parse_load(self, body: bytes) -> EngineLoad:
        """The load figures in a `load_path` response (`updated_at` left for the caller to stamp)."""

    @abstractmethod
    def engine_priority(self, level: int) -> int:
        """The body `priority` value for a gateway priority level (higher level = more important)."""

    def cap_priority(self, given: int, level: int) -> int:
        """A client's own body `priority`, lowered to at most as important as gateway level `level`
        in this engine's direction (vLLM runs lower values first, SGLang higher ones)."""
        ceiling = self.engine_priority(level)
        higher_first = self.engine_priority(1) > self.engine_priority(0)
        return min(given, ceiling) if higher_first else max(given, ceiling)

    def lora_model(self, base: str, adapter: str) -> str:
        """The `model` an OpenAI request names to be served by LoRA `adapter` of model `base`."""
        return adapter

    def lora_adapter(self, base: str, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model)."""
        return None if model == base else model

    # Whether the engine schedules by a body `priority` (in `engine_priority`'s direction).
    schedules_by_priority: ClassVar[bool] = True
    # Whether the engine finds a model's tokenizer in the Hugging Face cache when no hint names one.
    hub_tokenizer: ClassVar[bool] = True

    def lora_loaded(self, status: int, text: str) -> bool:
        """Whether the answer to a run-time LoRA load says the adapter is served now. vLLM answers
        400 when the adapter is there already: as good as loaded."""
        return status == 200 or (status == 400 and "already been loaded" in text)

    def tokenizer_hint(self, spec: EngineSpec, model: str) -> str | None:
        """Where a launched engine's tokenizer is, if its command line says: `--tokenizer`."""
        return flag_value(spec.extra_args, "--tokenizer")

    def continuation(self, body: Mapping[str, Any], chat: bool, start: str) -> dict[str, Any]:
        """`body` asking the engine to go on from the answer text `start` (vLLM and SGLang read the
        same fields): a chat's final assistant message left open, or a prompt extended."""
        doc = dict(body)
        if chat:
            doc["messages"] = [*body["messages"], {"role": "assistant", "content": start}]
            doc["continue_final_message"] = True
            doc["add_generation_prompt"] = False
        else:
            doc["prompt"] = body["prompt"] + start
        return doc

    def gpu_env(self, slot: ReplicaSlot) -> dict[str, str]:
        if slot.gpu_ids is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in slot.gpu_ids)}
