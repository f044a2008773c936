"""`POST /tokenize` and `POST /detokenize`: routed by `model` to a replica of its pool, the least busy
first, and answered by it. They are cheap, so they skip the scheduler, take no lease and teach the
prefix index nothing. A replica that cannot be reached is passed over for the next.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.errors import GatewayError, client_error, normalize_error_body
from gateway.fleet.replica import Replica
from gateway.path.exchange import Reply
from gateway.path.request_record import RequestRecord
from gateway.path.upstream import Upstream, UpstreamError
from gateway.routing.model_catalog import ModelCatalog, Target

log = logging.getLogger(__name__)


class Tokenize:
    def __init__(
        self, catalog: ModelCatalog, upstream: Upstream, max_attempts: int, retry_after_s: float
    ) -> None:
        self.catalog = catalog
        self.upstream = upstream
        self.max_attempts = max_attempts  # replicas tried at most
        self.retry_after_s = retry_after_s  # what a 503 for want of replicas tells the client

    async def handle(
        self, path: str, headers: Mapping[str, str], raw: bytes, body: dict[str, Any], rec: RequestRecord
    ) -> Reply:
        """Send the client's `body` (its bytes `raw`) on to a replica serving its model; what happened
        goes into `rec`."""
        rec.model = self._model(body)
        target = self.catalog.resolve(rec.model, None, headers, body)
        rec.pool = target.router.name
        if body.get("model") != target.upstream:
            body["model"] = target.upstream
            raw = orjson.dumps(body)
        replicas = _replicas(target)
        if not replicas:
            raise GatewayError(
                503,
                f"no healthy replica in pool `{target.router.name}`",
                "service_unavailable",
                "no_healthy_replica",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        sent = {"Content-Type": "application/json", "X-Request-Id": rec.engine_request_id}
        failure = "no replica answered"
        for replica in replicas[: self.max_attempts]:
            rec.replica = replica.name
            try:
                resp = await self.upstream.open("POST", replica.url + path, raw, sent)
                try:
                    answer = await self.upstream.read(resp)
                except BaseException:
                    resp.close()  # the body was not read to its end: the connection is not reusable
                    raise
                resp.release()
            except UpstreamError as exc:
                log.warning("%s on replica %s failed: %s", path, replica.name, exc)
                failure = exc.client_message(replica.name)
                continue
            if resp.status >= 400:
                answer = normalize_error_body(answer, resp.status)
            headers = {
                "Content-Type": "application/json",
                "x-kvgate-replica": replica.name,
                "x-request-id": rec.request_id,
            }
            return Reply(resp.status, answer, headers)
        raise GatewayError(502, failure, "upstream_error", "upstream_unreachable")

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None or model == "":
            only = self.catalog.only_model()
            if only is not None:
                return only  # one model served: vLLM's `model` is optional here
            raise client_error("you must provide a model parameter", "missing_model", "model")
        if not isinstance(model, str):
            raise client_error("`model` must be a string", "invalid_model", "model")
        return model


def _replicas(target: Target) -> list[Replica]:
    """The replicas that serve the target without a load, the least busy first."""
    router = target.router
    replicas = router.pool.serving("decode")
    if target.adapter is not None:
        replicas = [r for r in replicas if router.lora.has(r.name, target.adapter)]
    return sorted(replicas, key=lambda r: r.inflight_requests + r.remote_inflight_requests)
