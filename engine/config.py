"""Frozen configuration dataclasses shared by the engine, the trainer, the CLI and the UI."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import QuickdraftError

# int4 / int8w: weight-only low-bit on Quickdraft's or PyTorch's kernels
# (engine/weights/quant.py); gguf: a GGUF file's own blocks, as stored
# (engine/weights/gguf_model.py); nf4 / int8: bitsandbytes;
# fp16: what GPUs without native bf16 compute in.
QUANT_CHOICES = ("auto", "gguf", "int4", "int8w", "nf4", "int8", "bf16", "fp16", "fp32")
# auto: CUDA when present, else Apple's GPU (mps), else the CPU (engine/devices.py)
DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
ACCEPTANCE_CHOICES = ("auto", "greedy", "lossless", "typical")
# auto: the lean step where the family is covered (compiled once the app starts compiling),
# else transformers; eager: the lean step, never compiled; transformers: the model's own
STEP_CHOICES = ("auto", "eager", "transformers")
MAX_TOP_LOGPROBS = 20  # alternatives a reply may report per token (OpenAI's cap)


NAME_CHARS = 255  # the longest name of a file or folder that file systems take


def _one_of(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise QuickdraftError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how."""

    source: str = "default"  # "default", a local folder, or a Hugging Face repo id
    quant: str = "auto"  # one of QUANT_CHOICES; "auto" picks per device and memory
    device: str = "auto"  # one of DEVICE_CHOICES; "auto" = CUDA, else mps, else the CPU
    trust_remote_code: bool = False  # run code shipped with a hub model (off: secure default)
    revision: str | None = None  # hub branch, tag or commit; None = the default branch
    step: str = "auto"  # one of STEP_CHOICES: how decode steps run (engine/decode/target.py)
    # int4/int8w on a CPU: also keep bf16 copies of the weights for steps of many tokens,
    # where this CPU runs them faster (about 2.6 bytes per parameter in all for int4)
    wide_copies: bool = False
    # --quant auto on a CPU: measure the choice again instead of using the remembered one
    requantize: bool = False

    def __post_init__(self) -> None:
        _one_of("quantization", self.quant, QUANT_CHOICES)
        _one_of("device", self.device, DEVICE_CHOICES)
        _one_of("step", self.step, STEP_CHOICES)
        if not isinstance(self.source, str) or not self.source.strip():
            raise QuickdraftError("no model given: use 'default', a local folder or a repo id")
        if "\0" in self.source or any(len(part) > NAME_CHARS
                                       for part in self.source.replace("\\", "/").split("/")):
            raise QuickdraftError(f"{self.source[:60]!r}… is not the name of a model, a folder "
                                  f"or a file (a name holds at most {NAME_CHARS} characters)")


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen and when generation ends."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples from softmax(logits / T)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = no limit
    max_new_tokens: int = 256  # hard cap on generated tokens
    stop: tuple[str, ...] = ()  # generation ends before any of these strings is emitted
    seed: int | None = None  # fixes the sampling RNG; None = fresh randomness
    acceptance: str = "auto"  # drafters only: see ACCEPTANCE_CHOICES and engine.decode.verify
    typical_eps: float = 0.09  # typical acceptance: hard probability floor (Medusa paper)
    typical_delta: float = 0.3  # typical acceptance: entropy-scaled floor (Medusa paper)
    # OpenAI's penalties, over the reply's own tokens: a token's logit loses presence_penalty
    # once it occurs and frequency_penalty per occurrence (each in [-2, 2])
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    logprobs: int | None = None  # None: none reported; k: each token's and the k likeliest

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise QuickdraftError("temperature must be >= 0")
        if not 0 <= self.top_p <= 1:
            raise QuickdraftError("top-p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise QuickdraftError(f"{name.replace('_', ' ')} must be in [-2, 2]")
        if any(not -100 <= b <= 100 for _t, b in self.logit_bias):
            raise QuickdraftError("a logit bias must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise QuickdraftError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_k < 0:
            raise QuickdraftError("top-k must be >= 0")
        if self.max_new_tokens < 1:
            raise QuickdraftError("max new tokens must be >= 1")
        _one_of("acceptance", self.acceptance, ACCEPTANCE_CHOICES)
        if self.acceptance == "greedy" and not self.greedy:
            # Greedy verification while undrafted steps sample would be neither rule.
            raise QuickdraftError(
                "greedy acceptance needs temperature 0: use lossless or typical to sample")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shapes_logits(self) -> bool:
        """Whether a bias or a penalty changes the model's logits before the choice."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)

    @property
    def acceptance_mode(self) -> str:
        """The acceptance rule drafters use: greedy at T=0, lossless sampling otherwise."""
        if self.greedy:
            return "greedy"
        return "lossless" if self.acceptance == "auto" else self.acceptance


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation."""

    role: str  # "system", "user", "assistant" or "tool" (a tool's result)
    content: str
    # an assistant turn's tool calls, as chat templates read them: {"type": "function",
    # "function": {"name": str, "arguments": dict}} each
    tool_calls: tuple[dict, ...] = ()
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None  # a tool turn: the function that answered

    def as_dict(self) -> dict:
        """The turn as a chat template reads it (only the fields it has)."""
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class ChatPrompt:
    """What the model is asked to continue: messages plus an optional system prompt."""

    messages: tuple[ChatMessage, ...] = field(default_factory=tuple)
    system: str | None = None  # None = the model template's own default
    # functions the model may call, as chat templates read them ({"type": "function",
    # "function": {"name", "description", "parameters"}} each); () = none offered
    tools: tuple[dict, ...] = ()
