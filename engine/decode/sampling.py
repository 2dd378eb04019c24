"""Pure functions: logits -> probabilities -> tokens. No model, no state."""

from __future__ import annotations

import torch

from engine.config import SamplingParams

# The smallest temperature divided by (a smaller one samples as this one): logits of a few
# hundred over it stay finite in float32, and nothing but an exact tie samples otherwise.
MIN_TEMPERATURE = 1e-5
# Top-p candidates a CPU tries before sorting a whole row (_outside_nucleus).
NUCLEUS_FIRST = 256


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus.

    logits: (..., V) already divided by the temperature. Returns a new tensor, same shape.
    The nucleus keeps the smallest prefix of the sorted distribution whose mass reaches
    top_p (the token that crosses the threshold is kept), as Hugging Face does.
    """
    out = logits
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        out = out.masked_fill(_outside_nucleus(out, top_p), float("-inf"))
    return out


def _outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., V) bool: the tokens past the top-p nucleus of each row. A token is dropped when
    the mass of the tokens strictly likelier than it already reaches top_p, so tokens with
    equal logits (common under a low-bit LM head) are kept or dropped together, whatever
    order a sort puts them in; the most likely always stays (top_p 0 keeps it alone, as
    Hugging Face's min_tokens_to_keep=1).

    On a CPU the likeliest NUCLEUS_FIRST tokens are tried first: sorting a whole row costs
    there ~1.5 ms at 49k tokens, a sixth of a small model's step for every verified row,
    and a chat model's nucleus is seldom wider. A GPU sorts a row in microseconds, and
    checking that the candidates suffice would read the device: it always sorts."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and NUCLEUS_FIRST < vocab:
        drop = _past_nucleus(logits, top_p, NUCLEUS_FIRST)
        if drop is not None:
            return drop
    return _past_nucleus(logits, top_p, vocab)


def _past_nucleus(logits: torch.Tensor, top_p: float, first: int) -> torch.Tensor | None:
    """_outside_nucleus decided among each row's `first` likeliest tokens (the rest are
    dropped); None where the mass strictly likelier than the next token does not reach
    top_p in some row."""
    partial = first < logits.shape[-1]
    if partial:  # one more than `first`: it tells whether everything past them is dropped
        top, order = torch.topk(logits, first + 1, dim=-1)  # likeliest first
    else:
        top, order = torch.sort(logits, dim=-1, descending=True)
    # shares of the whole row, normalised as softmax does (from the largest logit)
    largest = top[..., :1]
    probs = (top - largest).exp() / (logits - largest).exp().sum(-1, keepdim=True)
    before = _strictly_likelier(top, probs.cumsum(-1) - probs)
    if partial:
        if not bool((before[..., -1] >= top_p).all()):
            return None
        before, order = before[..., :first], order[..., :first]
    drop = before >= top_p
    drop[..., 0] = False
    return torch.ones_like(logits, dtype=torch.bool).scatter(-1, order, drop)


def _strictly_likelier(top: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """(..., n) values sorted descending and the mass before each in that order -> the mass
    strictly likelier than each: a run of equal values takes its first member's."""
    index = torch.arange(top.shape[-1], device=top.device).expand_as(top)
    starts = torch.ones_like(top, dtype=torch.bool)
    starts[..., 1:] = top[..., 1:] != top[..., :-1]
    first = torch.where(starts, index, 0).cummax(-1).values  # each run's first position
    return before.gather(-1, first)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p.

    At temperature 0 the result is the one-hot of the argmax, so greedy decoding is the
    same code path as sampling with a point-mass distribution.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_ids(logits), logits.shape[-1]).float()
    # Below MIN_TEMPERATURE a float32 logit divided by it can overflow to inf (then NaN).
    temperature = max(params.temperature, MIN_TEMPERATURE)
    scaled = filter_logits(logits / temperature, params.top_k, params.top_p)
    return scaled.softmax(dim=-1)


def adjust(logits: torch.Tensor, base: torch.Tensor, counts: torch.Tensor,
           paths: list[list[int]], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's logit bias and penalties at every row of a draft: row i's token follows the
    reply so far and then `paths[i]` (the draft tokens from the root down to node i, the
    root excluded), so it is penalised as plain decoding would penalise it there.

    logits: (n, V); counts: (V,) float occurrences of each token in the reply so far; base:
    (V,) what every row gets, logit_bias - frequency * counts - presence * (counts > 0)
    (`base_adjustment`). Penalty: frequency per occurrence, presence once per token present.
    Returns a new float32 (n, V) tensor.
    """
    out = logits.float() + base
    rows, cols, times = [], [], []
    for i, path in enumerate(paths):
        for token in set(path):
            rows.append(i)
            cols.append(token)
            times.append(path.count(token))
    if rows and (presence or frequency):
        cols_t = torch.tensor(cols, device=logits.device)
        k = torch.tensor(times, dtype=torch.float32, device=logits.device)
        before = counts[cols_t]
        newly = ((before + k) > 0).float() - (before > 0).float()  # 1 where it first appears
        out[torch.tensor(rows, device=logits.device), cols_t] -= frequency * k + presence * newly
    return out


def base_adjustment(bias: torch.Tensor, counts: torch.Tensor, presence: float,
                    frequency: float) -> torch.Tensor:
    """(V,) logit_bias minus the penalties of tokens already in the reply (`adjust`)."""
    return bias - frequency * counts - presence * (counts > 0).float()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(n, V) logits with every token `allowed` (n, V bool) does not allow at -inf."""
    return logits.masked_fill(~allowed, float("-inf"))


def top_logprobs(logits: torch.Tensor, tokens: list[int],
                 k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of (m, V) logits: (log-probability of tokens[row], the k most likely tokens
    with theirs), from the softmax of the logits as given (after bias, penalties and a
    grammar's mask; before temperature and top-p, as OpenAI reports them)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if k <= 0:
        return [(c, []) for c in chosen]
    values, ids = logp.topk(k, dim=-1)
    return [(c, list(zip(i, v, strict=True)))
            for c, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of (..., V) non-negative weights (normalised or not), as a
    (..., 1) long tensor on their device, drawn there (no read of the device).

    Inverts the cumulative distribution at one uniform number per row: torch.multinomial
    draws on a CPU cost 1.0 ms for 49k entries against 0.09 ms this way (2-core AMD EPYC),
    a tenth of a small model's step. The sum runs in float64 so the smallest weights keep
    their share; a token of weight 0 is never drawn (a row of zeros draws V, past its end)."""
    cdf = weights.cumsum(-1, dtype=torch.float64)
    total = cdf[..., -1:]
    u = torch.rand(total.shape, generator=generator, device=weights.device,
                   dtype=torch.float64)
    # the first entry past u * total, which is below total (u < 1, and float64 rounds
    # total * (1 - 2^-53) down): zero-weight entries, where the sum stays put, never are
    return torch.searchsorted(cdf, u * total, right=True)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a (V,) probability vector (on the generator's device)."""
    return int(draw(probs, generator).item())


def uniform(generator: torch.Generator | None) -> float:
    """One draw from U[0, 1). Made on the generator's device: torch refuses a CUDA
    generator for a tensor it would otherwise make on the CPU."""
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, device=device))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension (the first of equal maxima, as argmax): from
    torch.max, which this torch computes 2-4x faster than argmax on a CPU (49k bf16 logits:
    43 against 179 us a row), a few percent of a small model's step."""
    return logits.max(-1).indices


def next_token(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """Choose the next token from (V,) logits: argmax when greedy, else a sample."""
    if params.greedy:
        return int(greedy_ids(logits).item())
    return sample_from(logits_to_probs(logits, params), generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG for one generation, seeded when a seed is given."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
