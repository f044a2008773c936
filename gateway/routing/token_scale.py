"""A pool's token scale: how many of its engines' tokens a counted token is, and how many tokens a
hashed block of prompt characters holds, as measured on the pool's own traffic.

The prefix index is sized in blocks of characters, the engines in tokens, and characters per token
vary with the text (code, CJK, generated benchmarks); the counting tokenizer may not be the
engines' (the H200 run: 2,112 engine tokens counted as 6,296). So both are learned: characters per
counted token from every prompt measured, engine tokens per counted token from the engines' usage
figures or, without them, their prompt token counters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # typical for English text; only sizes the prefix index until traffic is measured
# Usage figures needed before the engines' own tokens per character replace the gateway's count.
MIN_USAGE_SAMPLES = 8
MIN_USAGE_CHARS = 4096


class TokenScale:
    def __init__(self, pool: str, block_chars: int, moved: Callable[[], None]) -> None:
        self.pool = pool
        self.block_chars = block_chars
        self._moved = moved  # tokens per block moved by over a fifth since the indexes were sized
        self.scale = 1.0  # engine tokens per counted token, once measured
        # Prompt characters and tokens seen.
        self._text_chars = 0
        self._text_tokens = 0
        self._sized_tokens_per_block = 0.0
        # The engines' own prompt tokens (usage.prompt_tokens) against the prompt characters the
        # gateway sent: tokens per character in the engines' units, whatever tokenizer counted.
        self._usage_chars = 0
        self._usage_tokens = 0
        self._usage_samples = 0
        # Without usage figures (streams without include_usage), the engines' prompt token counters
        # (vLLM's /metrics) against the characters routed to each replica since the last scrape.
        self._chars_routed: dict[str, int] = {}
        self._counter_seen: dict[str, tuple[float, int]] = {}
        self._counter_chars = 0
        self._counter_tokens = 0.0

    def tokens_per_block(self) -> float:
        """Engine tokens in one hashed block of prompt text, as measured on this pool's traffic."""
        if self._text_chars < MIN_USAGE_CHARS:
            return self.block_chars / CHARS_PER_TOKEN * self.scale
        return self.block_chars * self._text_tokens / self._text_chars * self.scale

    def sized(self) -> float:
        """Tokens per block for sizing an index now (remembered: a later move resizes)."""
        self._sized_tokens_per_block = tokens = max(1.0, self.tokens_per_block())
        return tokens

    def routed(self, replica: str, chars: int) -> None:
        self._chars_routed[replica] = self._chars_routed.get(replica, 0) + chars

    def forget(self, replica: str) -> None:
        self._chars_routed.pop(replica, None)
        self._counter_seen.pop(replica, None)

    def observe_usage(self, prompt_chars: int, engine_prompt_tokens: int) -> None:
        """An engine counted `engine_prompt_tokens` for a prompt of `prompt_chars` characters (its
        response's usage): once enough are seen, counts are scaled to the engines' tokens."""
        # An engine is not trusted: a figure no tokenizer could give for that text is dropped.
        if prompt_chars <= 0 or not 0 < engine_prompt_tokens <= 4 * prompt_chars + 4096:
            return
        self._usage_chars += prompt_chars
        self._usage_tokens += engine_prompt_tokens
        self._usage_samples += 1
        if self._usage_chars > 1 << 24:  # forget slowly, so the figure follows the traffic
            self._usage_chars //= 2
            self._usage_tokens //= 2
        self._rescale()

    def observe_prompt_counter(self, replica: str, prompt_tokens_total: float) -> None:
        """A scrape of a replica's prompt token counter: what it counted since the last scrape,
        against the prompt characters routed to it meanwhile. Figures are summed over scrapes, so
        a request counted by the gateway before the engine has prefilled it evens out. Used only
        while no response has carried usage figures (those are per request, and no other gateway's
        traffic can mix in)."""
        chars = self._chars_routed.get(replica, 0)
        previous = self._counter_seen.get(replica)
        self._counter_seen[replica] = (prompt_tokens_total, chars)
        if previous is None or prompt_tokens_total < previous[0]:  # first sight, or a restart
            return
        self._counter_tokens += prompt_tokens_total - previous[0]
        self._counter_chars += chars - previous[1]
        if self._counter_chars > 1 << 24:
            self._counter_chars //= 2
            self._counter_tokens /= 2
        self._rescale()

    def learn_token_size(self, chars: int, tokens: int) -> None:
        self._text_chars += chars
        self._text_tokens += tokens
        if self._text_chars > 1 << 24:  # forget slowly, so the figure follows the traffic
            self._text_chars //= 2
            self._text_tokens //= 2
        self._resize_if_moved()

    def _rescale(self) -> None:
        """Scale counts to the engines' tokens per character: from usage figures when there are
        enough, else from the engines' counters."""
        if self._usage_samples >= MIN_USAGE_SAMPLES and self._usage_chars >= MIN_USAGE_CHARS:
            engine_per_char = self._usage_tokens / self._usage_chars
        elif not self._usage_samples and self._counter_chars >= 4 * MIN_USAGE_CHARS and self._counter_tokens:
            # Only where responses carry no usage at all: counters lag the characters routed by the
            # prompts still waiting for prefill, and the first long prompts of a run made them read a
            # hundredth of the true count (every block rounded to 0 tokens: no prefix matched) until
            # enough usage figures came.
            engine_per_char = self._counter_tokens / self._counter_chars
        else:
            return
        # An engine is not trusted: no tokenizer makes more than a token per byte of text.
        if not self._text_tokens or engine_per_char > 4:
            return
        scale = engine_per_char / (self._text_tokens / self._text_chars)
        # Within 5%, the counting tokenizer is the engines' (chat templates add a few tokens).
        scale = 1.0 if abs(scale - 1.0) < 0.05 else scale
        if scale != self.scale:
            if abs(scale - self.scale) > 0.2 * self.scale:
                log.info(
                    "pool %s: the engines count %.3g tokens per counted token (by their own figures): "
                    "token estimates and index sizes follow",
                    self.pool,
                    scale,
                )
            self.scale = scale
            self._resize_if_moved()

    def _resize_if_moved(self) -> None:
        sized = self._sized_tokens_per_block
        if sized and abs(self.tokens_per_block() - sized) > 0.2 * sized:
            self._moved()
