"""Where a reply's speed came from: the share of its model steps each drafting source made
(copies from this conversation, the datastore of the model's earlier replies, a trained
drafter, plain steps), and whether most of the tokens drafting added were earlier text
repeated. Read from a reply's stats JSON (GenerationStats.to_json), live or stored."""

from __future__ import annotations

from dataclasses import dataclass, field

# A composite's step kind ("medusa+lookup+datastore": the offers it joined, the one that
# drafts the step first) -> the source the step counts for.
KIND_SOURCE = {"copy": "conversation", "lookup": "conversation", "datastore": "datastore",
               "medusa": "medusa", "kangaroo": "kangaroo", "off": "plain"}
# A drafter that is not a composition drafts every step it drafts from one source ("copy" is
# a step kind, never a method).
METHOD_SOURCE = {k: v for k, v in KIND_SOURCE.items() if k != "copy"}
LABELS = {"conversation": "copies from this conversation", "datastore": "datastore",
          "medusa": "Medusa", "kangaroo": "Kangaroo", "plain": "plain steps"}
# Sources whose tokens are text that already existed: this conversation or earlier replies.
REPEATED = ("conversation", "datastore")


@dataclass(frozen=True)
class SourceMix:
    """One reply's model steps and accepted draft tokens by source."""

    steps: dict[str, int]  # source -> model steps it drafted (plain: steps nothing drafted)
    gained: dict[str, int]  # source -> draft tokens the model accepted from its steps
    store_joined: int = 0  # datastore tokens accepted inside steps another source drafted
    # source -> steps another source drafted first and it joined (its tokens grafted on)
    joined: dict[str, int] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return sum(self.steps.values())

    def shares(self) -> list[tuple[str, float]]:
        """(source, share of the steps), the largest first."""
        total = self.total_steps or 1
        ranked = sorted(self.steps.items(), key=lambda kv: (-kv[1], kv[0]))
        return [(source, n / total) for source, n in ranked if n]

    @property
    def top(self) -> str:
        """The source that made most steps."""
        return self.shares()[0][0] if self.total_steps else "plain"

    @property
    def repeated_share(self) -> float:
        """Share of the accepted draft tokens that repeated earlier text (this conversation
        or the datastore); 0 when drafting added nothing."""
        total = sum(self.gained.values())
        if not total:
            return 0.0
        repeated = sum(self.gained.get(s, 0) for s in REPEATED) + self.store_joined
        return min(1.0, repeated / total)


def mix_of(method: str, stats: dict) -> SourceMix | None:
    """The mix of a reply decoded with `method` (as stored: "auto:medusa+lookup" for Auto)
    from its stats JSON; None for a reply stored without the figures it needs."""
    if not stats or "drafting_steps" not in stats:
        return None
    kinds = stats.get("step_kinds") or {}
    if kinds:
        steps, gained, joined = {}, {}, {}
        joined_kept = 0  # tokens kept in steps another source drafted first
        for kind, n in kinds.items():
            first, *rest = kind.split("+")
            source = KIND_SOURCE.get(first, first)
            kept = stats.get("kind_accepted", {}).get(kind, 0)
            steps[source] = steps.get(source, 0) + n
            gained[source] = gained.get(source, 0) + kept
            joined_kept += kept if "datastore" in rest else 0
            for part in dict.fromkeys(KIND_SOURCE.get(r, r) for r in rest):
                if part != source:
                    joined[part] = joined.get(part, 0) + n
        # datastore tokens beyond those of its own steps came inside joined steps
        beyond = stats.get("datastore_accepted", 0) - gained.get("datastore", 0)
        return SourceMix(steps, gained, min(max(0, beyond), joined_kept), joined)
    source = METHOD_SOURCE.get(method.split(":")[0], method)
    total, drafting = stats.get("steps", 0), stats["drafting_steps"]
    accepted = sum(a * n for a, n in enumerate(stats.get("accepted_histogram", [])[1:]))
    steps = {source: drafting, "plain": total - drafting} if source != "plain" else \
        {"plain": total}
    return SourceMix(steps, {source: accepted})


def label(source: str) -> str:
    return LABELS.get(source, source)
