"""The lean step as the decode loop's target (engine/decode/target.py): the Llama family run from
its own layer function (engine/lean/layer.py) over a preallocated cache, one layer call per
decoder layer, eager or compiled per step size (engine/lean/compiled.py).

A step of n tokens writes cache slots start..start+n-1 in node order, at positions
start + depth (a tree) or start + i (a chain); each query sees the slots before `start`
and, among this step's, its ancestors (a tree) or those before it (a chain). Sliding-window
layers see only positions within their window.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Sequence

import torch

from engine.decode.target import Forward, Target
from engine.devices import staged
from engine.lean import compiled, graphs
from engine.lean.cache import LeanCache
from engine.lean.layer import StepInputs, make_layer
from engine.lean.layer_weights import layer_weights
from engine.lean.rope import RopeTable
from engine.lean.spec import LeanSpec, spec_for
from engine.weights import quant

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per pass: bounds the (heads, n, positions) scores


class LeanTarget(Target):
    """See the module doc. Built from a loaded transformers model, sharing its weights."""

    def __init__(self, model, spec: LeanSpec, act_dtype: torch.dtype):
        base = model.model
        self.model, self.spec = model, spec
        self.device = next(model.parameters()).device
        self.act_dtype = act_dtype  # the residual stream's dtype (bf16 under low-bit)
        # Attention reads the cache in fp32 on a CPU: bf16 arithmetic is emulated on many
        # CPUs, and the cache is small next to the weights there.
        self.cache_dtype = torch.float32 if self.device.type == "cpu" else act_dtype
        self.weights = [layer_weights(spec, block) for block in base.layers]
        self.embedding, self.final_norm = base.embed_tokens, base.norm
        self.head = model.get_output_embeddings()
        self.rope = RopeTable(base.rotary_emb, act_dtype, self.device, spec.context)
        low = quant.low_bit_layers(model)
        self.wide_rows = low[0].wide_rows if low else 0  # steps on bf16 copies, where kept
        self.layer = make_layer(spec, self.wide_rows)
        self.steps = compiled.Steps(self.layer, self.weights)  # layer calls per step size
        # Steps of up to the largest compiled size run as CUDA graphs (engine/lean/graphs.py):
        # what compiling means on a GPU.
        self.graphed = False
        self.graphs_failed = ""  # why capturing failed, once it has
        # The memory pool every graph of this target allocates from (graphs.new_pool), made
        # at the first capture; and the lock that runs one graph at a time (a training run's
        # prompts and a reply may decode at once): graphs sharing a pool must not
        # interleave, and a pool takes one capture at a time.
        self.graph_pool = None
        self._graph_lock = threading.Lock()
        # Finished replies' cache tensors with their graphs: a graphed reply takes them
        # over, so graphs are captured once per size, not once per reply.
        self._spare: list[tuple] = []

    @property
    def name(self) -> str:
        if self.graphed:
            return "lean-graphs"
        return "lean-eager (graphs failed)" if self.graphs_failed else self.steps.state()

    def padded_sizes(self) -> tuple[int, ...]:
        return compiled.SIZES  # eager, compiled and graphed steps alike

    def new_cache(self) -> LeanCache:
        s = self.spec
        spare = self._spare.pop() if self.graphed and self._spare else None
        cache = LeanCache(s.layers, s.kv_heads, s.head_dim, self.cache_dtype, self.device,
                          s.context, storage=spare)
        if self.graphed:  # its tensors come back here once released, or collected
            cache.finalizer = weakref.finalize(cache, self._take_back, cache.storage)
        return cache

    def _take_back(self, storage: tuple) -> None:
        if self.graphed:  # eager steps (capturing failed) take fresh caches
            self._spare.append(storage)

    def release(self, cache) -> None:
        """Hand the cache's tables and graphs to the next reply now (once), rather than
        whenever the garbage collector finds the reply's objects."""
        if cache.finalizer is not None:
            cache.finalizer()

    def forward(self, cache, tokens, start, depths=None, tree_mask=None, states=False,
                last_only=False) -> Forward:
        if len(tokens) > PREFILL_CHUNK:  # a long prompt (no tree): in chunks
            return self._chunked(cache, tokens, start, states, last_only)
        h = self.embed(tokens, start)
        hidden = self._layers(h[0], range(self.spec.layers), cache, start, depths, tree_mask,
                              keep=states)
        x = hidden[-1]
        x = self.final_norm(x[-1:] if last_only else x)
        logits = self.logits(x)
        if not states:
            return Forward(logits)
        return Forward(logits, (*[s[None] for s in hidden[:-1]], self.final_norm(hidden[-1])[None]))

    def _chunked(self, cache, tokens, start, states, last_only) -> Forward:
        parts = [self.forward(cache, tokens[i:i + PREFILL_CHUNK], start + i, states=states,
                              last_only=last_only)
                 for i in range(0, len(tokens), PREFILL_CHUNK)]
        logits = parts[-1].logits if last_only else torch.cat([p.logits for p in parts])
        if not states:
            return Forward(logits)
        layers = zip(*[p.states for p in parts], strict=True)
        return Forward(logits, tuple(torch.cat(layer, dim=1) for layer in layers))

    def compile(self, mode: str = "watch", on_ready: Callable[[], None] | None = None,
                report: Callable | None = None) -> None:
        """Load or build the compiled layer at every step size (engine/lean/compiled.py;
        `mode`: compiled.MODES), built on this model's layer shapes and a scratch cache.
        On CUDA, steps are captured as graphs instead, per size as they first run: nothing
        to build."""
        if self.device.type == "cuda":
            self.graphed = True
            if on_ready is not None:
                on_ready()
            return
        layout = {"spec": dataclasses.asdict(self.spec), "wide_rows": self.wide_rows}
        self.steps.compile(self._example, self._signature(), layout, mode, on_ready, report)

    def _example(self, size: int) -> StepInputs:
        """A step of `size` tokens' arguments, weights excluded (what packages are built
        on). Ordinary tensors, not inference ones: compiling runs the graph outside
        inference_mode (the cache is written in place)."""
        s, kv, d = self.spec, self.spec.kv_heads, self.spec.head_dim
        start = 2 * size  # a window longer than one step: its size stays symbolic
        keys, values = (torch.zeros(kv, 4 * size, d, dtype=self.cache_dtype, device=self.device)
                        for _ in range(2))
        x = torch.zeros(size, s.hidden, dtype=self.act_dtype, device=self.device)
        slots = torch.arange(start, start + size, device=self.device)
        cos, sin = (t.clone() for t in self.rope.rows(slots, start + size - 1))
        mask = step_mask(start, slots, None, size, None)
        return StepInputs(x, cos, sin, mask, keys, values, slots)

    def _signature(self) -> str:
        """Everything a compiled layer depends on besides torch and the CPU."""
        kinds = [kind.key for kind in self.steps.kinds]
        # never a CUDA device: there steps are captured as graphs, not compiled (compile)
        return (f"{self.spec}|{kinds}|{self.act_dtype}|{self.cache_dtype}|"
                f"{self.device.type}|wide {self.wide_rows}")

    def keep_path(self, cache, start, keep, layers=None) -> None:
        cache.keep_path(start, keep, layers)

    def rollback(self, cache, n: int) -> None:
        """Nothing to do: the next step's `start` leaves the last n slots uncounted."""

    def embed(self, tokens, start) -> torch.Tensor:
        ids = staged([list(tokens)], self.device)
        return self.embedding(ids).to(self.act_dtype)

    def run_layers(self, h, layers, cache, start) -> torch.Tensor:
        return self._layers(h[0], layers, cache, start, None, None, keep=False)[-1][None]

    def norm(self, h) -> torch.Tensor:
        return self.final_norm(h)

    def logits(self, h, weight=None) -> torch.Tensor:
        out = self.head(h) if weight is None else torch.nn.functional.linear(h, weight)
        cap = self.spec.final_softcap
        return out if not cap else torch.tanh(out / cap) * cap

    @torch.inference_mode()  # the cache is written in place (inference tensors)
    def _layers(self, x: torch.Tensor, layers: range, cache: LeanCache, start: int,
                depths: Sequence[int] | None, tree_mask: torch.Tensor | None,
                keep: bool) -> list[torch.Tensor]:
        """Run `layers` over x (n, H) at slots start..; the states after each layer (only
        the last unless `keep`; the input first when `keep`)."""
        n = x.shape[0]
        # the layer call: eager, a package, or eager under a graph's capture
        call, size = self.steps.for_size(n, start)
        graphed = self.graphed and compiled.size_for(n) is not None
        if graphed:
            call, size = self.steps.eager, compiled.size_for(n)
        plan = StepPlan(n, size, layers, keep, graphed)
        depths = list(range(n)) if depths is None else list(depths)
        cache.reserve(start + size)
        # The step's host inputs go to the device in one copy each: positions (padding
        # rows repeat the last) and a tree's mask; the slots are made there.
        positions = staged([start + d for d in depths + [depths[-1]] * (size - n)], self.device)
        tree_mask = None if tree_mask is None else staged(tree_mask, self.device)
        slots = torch.arange(start, start + size, device=self.device)
        cos, sin = self.rope.rows(positions, start + max(depths))
        # A graph's shapes never change: its masks span the cache's whole capacity.
        width = cache.capacity if graphed else start + size
        windows = sorted({self.spec.windows[i] for i in layers}, key=str)
        masks = [step_mask(start, positions[:n], tree_mask, size, w, width) for w in windows]
        if size > n:
            x = torch.cat([x, x[-1:].expand(size - n, -1)])

        # A graph keeps its body: it holds the cache's tables, not the cache (whose end
        # hands the tables back to new_cache).
        key_tables, value_tables = cache.keys, cache.values
        layer_windows = self.spec.windows

        def body(x, cos, sin, slots, *masks) -> list[torch.Tensor]:
            by_window = dict(zip(windows, masks, strict=True))
            kept = [x] if keep else []
            for i in layers:
                x = call(i, x, cos, sin, by_window[layer_windows[i]], key_tables[i],
                         value_tables[i], slots)
                if keep:
                    kept.append(x)
            return kept if keep else [x]

        values = [x, cos, sin, slots, *masks]
        out = self._replay(cache, plan.graph_key, body, values) if graphed else None
        if out is None:
            out = body(*values)
        return [state[:n] for state in out]

    def _replay(self, cache, key, body, values) -> list[torch.Tensor] | None:
        """The step as a graph; None (and eager steps from now on, said once) where
        capturing it fails: an operation that cannot be captured, or out of memory."""
        try:
            with self._graph_lock:
                if self.graph_pool is None:
                    self.graph_pool = graphs.new_pool(self.device)
                return graphs.replay(cache.graphs, key, body, values, self.graph_pool)
        except RuntimeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.graphed, self.graphs_failed = False, f"{type(exc).__name__}: {first}"[:300]
            cache.graphs.clear()
            self._spare.clear()
            self.graph_pool = None  # its memory goes back once the last graph is gone
            log.warning("capturing the decode step failed, decoding eagerly: %s",
                        self.graphs_failed)
            return None


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One lean step's shape, which eager, compiled and graphed execution all follow."""

    rows: int  # the step's real rows (tokens)
    size: int  # its rows once padded: the compiled or captured size (rows where neither)
    layers: range  # the layers it runs
    keep: bool  # every layer's output kept (else the last one's)
    graphed: bool  # replayed as a captured CUDA graph

    @property
    def graph_key(self) -> tuple:
        """What one captured graph serves: the whole plan but its real rows (padding gives
        every step of one size one shape), so a field added to the plan keys graphs too."""
        return dataclasses.astuple(dataclasses.replace(self, rows=0))


def step_mask(start: int, at: torch.Tensor, tree_mask: torch.Tensor | None, size: int,
              window: int | None, width: int | None = None) -> torch.Tensor:
    """(size, width) additive float mask (width: start + size unless given) for the
    n real queries at positions `at` (n,) (rows past n pad the step to `size`: they see
    slot 0 only, and no real query sees them; no query sees the slots past start + size).
    Built on `at`'s device from tensors already there (no copy from the host).

    A query sees the slots before `start` and its ancestors among this step's (tree_mask
    (n, n) bool on that device, or causal for a chain); within `window` positions where one
    is set."""
    n, device = at.shape[0], at.device
    width = start + size if width is None else width
    allowed = torch.zeros(size, width, dtype=torch.bool, device=device)
    allowed[:n, :start] = True
    own = (torch.ones(n, n, dtype=torch.bool, device=device).tril() if tree_mask is None
           else tree_mask)
    allowed[:n, start:start + n] = own
    if window is not None:
        keys = torch.cat([torch.arange(start, device=device), at,
                          torch.full((width - start - n,), -1, device=device)])
        allowed[:n] &= keys[None, :] > at[:, None] - window
    allowed[n:, 0] = True
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)


def build(model, act_dtype: torch.dtype) -> LeanTarget | None:
    """The lean target for `model`, or None where the family is not covered (or its
    layers are not the plain linear and norm modules the lean step reads)."""
    spec = spec_for(model)
    if spec is None:
        return None
    try:
        return LeanTarget(model, spec, act_dtype)
    except (AttributeError, TypeError):
        return None
