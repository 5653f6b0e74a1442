"""Stop strings on the decode instance.

Decode decides every finish (`DecodeScheduler._commit`), stop strings included, so that no token
after a match is committed, streamed, counted or charged, whatever a DFlash step accepted in one
run. It matches on the text of each sequence's committed tokens, rendered with the classes the
router renders it with (`IncrementalDetokenizer`, `StopStringMatcher`), so the router's text ends
exactly where decode stopped. The tokenizer is loaded on the first request with stop strings: an
instance that never sees one never loads it.
"""

from __future__ import annotations

from glm53.server.config import ClusterConfig
from glm53.server.sampling import SamplingParams
from glm53.server.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class StopText:
    """One sequence's committed text, watched for its stop strings."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.matcher = StopStringMatcher(params.stop)

    def add(self, token: int) -> str | None:
        """Commit one (non-stop-token) token's text; the stop string it completes, if any."""
        self.matcher.feed(self.detok.add([token]))
        return self.matcher.matched

    def end(self) -> str | None:
        """At a length finish: the text held back (an incomplete character) may complete a match."""
        self.matcher.feed(self.detok.flush())
        return self.matcher.matched


class StopStrings:
    def __init__(self, cluster: ClusterConfig):
        self.cluster = cluster
        self._tokenizer: Tokenizer | None = None

    def new(self, params: SamplingParams) -> StopText | None:
        if not params.stop:
            return None
        if self._tokenizer is None:
            from glm53.server.embedded_model import resolve_paths

            self._tokenizer = Tokenizer.from_dir(resolve_paths(self.cluster)[0])
        return StopText(self._tokenizer, params)
