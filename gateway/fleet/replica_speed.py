"""How fast a replica really is, measured from the requests the gateway sent it.

A fleet is not uniform (an H100 beside an H200, a replica sharing its GPU, another model revision),
and a policy that costs work in seconds needs each replica's own rate. Each figure is an
exponentially weighted average over the replica's recent completed requests:

- **Prefill**: a request's prefill service time is from when the engine could start on it (its
  send, or the latest first token of a request sent before it, if later: prefills queue) to its
  own first token. Requests sent after it do not count: a short prompt interleaved with a long
  one's chunked prefill finishes first, and taking its first token as the long prompt's start
  once made a 30k-token document look prefilled in a tenth of its time. The rate is uncached
  tokens over service time, both summed: requests whose prefills shared one engine step (service
  times near 0 for all but the first) add up to the step's time, and per-request overheads are
  part of the rate (a replica serving cache hits looks slower per token than one prefilling
  documents). A least-squares split into overhead and per-token time was tried first: under
  bursts most service times are 0, the fitted slope fell near 0, the replica looked many times
  faster than it was and drew every request (routing-bursty: p95 5x radix's).
- **Prefill by size** (`by_size`): the same sums per class of uncached size (`size_class`: sizes
  within 4x of each other), for comparing replicas on like requests (`gateway.policy`'s
  `relative_prefill_speeds`). The overall rate depends on a replica's mix: per-request overheads
  weigh on short prompts, so a replica that happened to serve documents reads faster than one
  serving chats on the same GPU (routing-long --quick: 6.6k against 3.5k tokens/s) and drew
  the next documents. Only requests that did not queue behind another's prefill count here: chats
  that waited for a document and were prefilled in its last step have service times near 0, the
  step's time went to the document's class, and their class read 17x the pool's pace; their
  replica then drew 317 of 400 requests (routing-long, seed 5, on a loaded host).
- **Decode**: output tokens after the first against the time from first token to the end: the
  per-stream rate a client sees, batch effects included.

Figures are None until `MIN_SAMPLES` requests informed them, and policies then use their defaults.
"""

from __future__ import annotations

from bisect import bisect_right

MIN_SAMPLES = 8
# Weight of the newest request: about the last 1/ALPHA requests count.
ALPHA = 0.05
# Recent requests' (sent, first token) kept to find where a request's prefill could start: the
# latest first tokens (an older one is before most requests' sends, so it starts none).
RECENT = 64


def size_class(tokens: int) -> int:
    """The class of an uncached prompt size: 128-511 tokens are class 4, 512-2047 class 5, 2048-8191
    class 6, 8192-32767 class 7 (sizes within 4x of each other share one)."""
    return tokens.bit_length() // 2


class ReplicaSpeed:
    __slots__ = (
        "_count",
        "_decode_n",
        "_decode_s",
        "_decode_tokens",
        "_firsts",
        "_s",
        "_sents",
        "_su",
        "by_size",
        "decode_tokens_per_s",
        "prefill_tokens_per_s",
    )

    def __init__(self) -> None:
        self._count = 0
        # Ordered by first token, so a request's search starts at its own and stops at its send.
        self._firsts: list[float] = []
        self._sents: list[float] = []  # the same requests' sends
        self._s = self._su = 0.0
        self._decode_n = 0
        self._decode_s = self._decode_tokens = 0.0
        self.prefill_tokens_per_s: float | None = None
        self.decode_tokens_per_s: float | None = None
        # size_class -> [uncached tokens, service seconds, requests], decaying with every request
        self.by_size: dict[int, list[float]] = {}

    def observe(self, sent: float, first: float, end: float, uncached: int, output_tokens: int) -> None:
        """One completed request: sent, first token and end (one clock, seconds), its uncached prompt
        tokens and its output tokens."""
        firsts, sents = self._firsts, self._sents
        start = sent  # or the latest first token in (sent, first] of a request sent by then
        i = bisect_right(firsts, first)
        k = i - 1
        while k >= 0 and firsts[k] > sent:
            if sents[k] <= sent:
                start = firsts[k]
                break
            k -= 1
        firsts.insert(i, first)
        sents.insert(i, sent)
        if len(firsts) > RECENT:
            del firsts[0], sents[0]
        service = max(0.0, first - start)
        keep = 1.0 - ALPHA
        self._count += 1
        self._s = self._s * keep + service
        self._su = self._su * keep + uncached
        if self._count >= MIN_SAMPLES and self._su > 0 and self._s > 0:
            self.prefill_tokens_per_s = self._su / self._s
        for sums in self.by_size.values():
            sums[0] *= keep
            sums[1] *= keep
            sums[2] *= keep
        if start == sent:  # not queued behind another's prefill: its service time is its own
            sums = self.by_size.setdefault(size_class(uncached), [0.0, 0.0, 0.0])
            sums[0] += uncached
            sums[1] += service
            sums[2] += 1.0
        if output_tokens >= 2 and end > first:
            self._decode_n += 1
            self._decode_tokens = self._decode_tokens * keep + (output_tokens - 1)
            self._decode_s = self._decode_s * keep + (end - first)
            if self._decode_n >= MIN_SAMPLES:
                self.decode_tokens_per_s = self._decode_tokens / self._decode_s
