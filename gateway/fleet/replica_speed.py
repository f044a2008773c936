"""How fast a replica really is, measured from the requests the gateway sent it.

A fleet is not uniform (an H100 beside an H200, a replica sharing its GPU, another model revision),
and a policy that costs work in seconds needs each replica's own rate. Two figures, each an
exponentially weighted average over the replica's recent completed requests:

- **Prefill**: a request's prefill service time is from when the engine could start on it (its
  send, or the latest first token of a request sent before it, if later: prefills queue) to its
  own first token. Requests sent after it do not count: a short prompt interleaved with a long
  one's chunked prefill finishes first, and taking its first token as the long prompt's start
  once made a 30k-token document look prefilled in a tenth of its time. Service time against
  uncached prompt tokens is fitted as `overhead + tokens / rate` by least squares over decaying
  sums, so short cache hits (mostly overhead) and cold prompts (mostly tokens) both inform it;
  requests whose prefills shared one engine step (service times near 0 for all but the first)
  average out in the sums.
- **Decode**: output tokens after the first against the time from first token to the end: the
  per-stream rate a client sees, batch effects included.

Figures are None until `MIN_SAMPLES` requests informed them, and policies then use their defaults.
"""

from __future__ import annotations

from collections import deque

MIN_SAMPLES = 8
# Weight of the newest request: about the last 1/ALPHA requests count.
ALPHA = 0.05
# Below this spread of uncached sizes (coefficient of variation) no slope can be fitted: the mean
# service time per token is used instead, overhead included (a pessimistic rate).
MIN_SIZE_CV = 0.1
# Recent requests' (sent, first token) kept to find where a request's prefill could start.
RECENT = 64


class ReplicaSpeed:
    __slots__ = (
        "_count",
        "_decode_n",
        "_decode_s",
        "_decode_tokens",
        "_n",
        "_recent",
        "_s",
        "_su",
        "_sus",
        "_suu",
        "decode_tokens_per_s",
        "prefill_overhead_s",
        "prefill_tokens_per_s",
    )

    def __init__(self) -> None:
        self._count = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=RECENT)
        self._n = self._s = self._su = self._suu = self._sus = 0.0
        self._decode_n = 0
        self._decode_s = self._decode_tokens = 0.0
        self.prefill_tokens_per_s: float | None = None
        self.prefill_overhead_s: float | None = None
        self.decode_tokens_per_s: float | None = None

    def observe(self, sent: float, first: float, end: float, uncached: int, output_tokens: int) -> None:
        """One completed request: sent, first token and end (one clock, seconds), its uncached prompt
        tokens and its output tokens."""
        start = sent
        for s, f in self._recent:
            if s <= sent and start < f <= first:
                start = f
        self._recent.append((sent, first))
        service = max(0.0, first - start)
        keep = 1.0 - ALPHA
        self._count += 1
        self._n = self._n * keep + 1.0
        self._s = self._s * keep + service
        self._su = self._su * keep + uncached
        self._suu = self._suu * keep + uncached * uncached
        self._sus = self._sus * keep + uncached * service
        if self._count >= MIN_SAMPLES:
            self._fit()
        if output_tokens >= 2 and end > first:
            self._decode_n += 1
            self._decode_tokens = self._decode_tokens * keep + (output_tokens - 1)
            self._decode_s = self._decode_s * keep + (end - first)
            if self._decode_n >= MIN_SAMPLES:
                self.decode_tokens_per_s = self._decode_tokens / self._decode_s

    def _fit(self) -> None:
        n, mean_u, mean_s = self._n, self._su / self._n, self._s / self._n
        if mean_u <= 0:
            return
        var_u = self._suu / n - mean_u * mean_u
        slope = 0.0
        if var_u > (MIN_SIZE_CV * mean_u) ** 2:
            slope = (self._sus / n - mean_u * mean_s) / var_u
        if slope <= 0:  # no spread, or noise hid the size effect: overhead folded into the rate
            slope, overhead = mean_s / mean_u, 0.0
        else:
            overhead = max(0.0, mean_s - slope * mean_u)
        if slope > 0:
            self.prefill_tokens_per_s = 1.0 / slope
            self.prefill_overhead_s = overhead
