"""Speed and acceptance statistics of one generation."""

from __future__ import annotations

from dataclasses import dataclass, field

CTAR_WINDOWS = 6


@dataclass
class GenerationStats:
    """Filled by the decode loop; read by the CLI, the UI and the benchmark."""

    prompt_tokens: int = 0  # tokens fed to prefill (after any truncation)
    prompt_dropped: int = 0  # tokens cut from the prompt's start to fit the context
    tokens: int = 0  # new tokens produced
    steps: int = 0  # forward passes of the full model after prefill
    ttft_s: float = 0.0  # time to first token (prefill + first choice)
    elapsed_s: float = 0.0  # wall time of the whole generation
    accepted: list[int] = field(default_factory=list)  # per step: draft tokens accepted
    drafted: list[int] = field(default_factory=list)  # per step: draft tokens proposed
    stop_reason: str = ""  # "eos" | "stop" | "length" | "cancelled"
    datastore_drafted: int = 0  # draft tokens that came from the datastore of past replies
    datastore_accepted: int = 0  # of which the model kept
    # A composite drafter's mix (engine.drafters.composite): steps of each kind ("copy",
    # "datastore", "medusa+lookup", ...) and the draft tokens accepted in them
    step_kinds: dict[str, int] = field(default_factory=dict)
    kind_accepted: dict[str, int] = field(default_factory=dict)
    step: str = ""  # how the decode steps ran (engine/decode/target.py: lean-compiled, ...)
    # seconds a composite spent choosing its steps (offers, the rule, joining trees): part of
    # elapsed_s, reported so that its share of the reply can be seen
    planning_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens added per full-model step: accepted drafts plus the model's own token."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 0.0

    def accepted_histogram(self) -> list[int]:
        """counts[k] = number of steps that added k tokens (k >= 1)."""
        counts = [0] * (max(self.accepted, default=0) + 2)
        for a in self.accepted:
            counts[a + 1] += 1
        return counts

    def ctar(self, windows: int = CTAR_WINDOWS) -> list[float]:
        """CTAR(w) for w = 1..windows: share of steps whose first w draft tokens were all
        accepted (a step that drafted fewer than w tokens counts as a miss)."""
        if not self.accepted:
            return [0.0] * windows
        n = len(self.accepted)
        return [sum(a >= w for a in self.accepted) / n for w in range(1, windows + 1)]

    def to_json(self) -> dict:
        """The `stats` object of `chat --json` (design.md §2) plus a few extras."""
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "ttft_s": round(self.ttft_s, 4),
            "mean_accepted": round(self.mean_accepted, 4),
            "prompt_tokens": self.prompt_tokens,
            "prompt_dropped": self.prompt_dropped,
            "elapsed_s": round(self.elapsed_s, 4),
            "stop_reason": self.stop_reason,
            "accepted_histogram": self.accepted_histogram(),
            "ctar": [round(c, 4) for c in self.ctar()],
            "datastore_drafted": self.datastore_drafted,
            "datastore_accepted": self.datastore_accepted,
            "drafting_steps": sum(d > 0 for d in self.drafted),
            "step_kinds": dict(self.step_kinds),
            "kind_accepted": dict(self.kind_accepted),
            "step": self.step,
            "planning_s": round(self.planning_s, 4),
        }
