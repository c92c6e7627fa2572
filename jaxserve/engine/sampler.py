"""On-device sampling, one jitted function of arrays: no Python per request, no host sync.

Every sampling parameter is a per-row array, so one compiled step serves any mix of
greedy and sampled requests. Randomness is per request: row b draws its Gumbel noise
from fold_in(key(seed_b), n_b), where n_b is how many tokens the request has made,
and the noise is laid over the vocabulary in token order. A request's tokens so
depend only on its own logits, seed and position, never on its neighbours in the
batch or on the batch size.

Order of processing (as HF's logits processors): repetition penalty, presence and
frequency penalties, logit bias, min_tokens (a row's stop ids banned until it has made
min_tokens tokens), temperature, top-k, top-p, min-p. Logprobs are reported from
the model's raw distribution (log_softmax of the unprocessed logits), as vLLM does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NUM_TOP_LOGPROBS = 20
TOP_K_ROUND = 16  # the largest k XLA's GPU top-k kernel takes (see top_k)
ROW_CHUNK = 16  # a CPU samples a large batch this many rows at a time (in_row_chunks)
CANDIDATES = 64  # the largest logits per row the filters read before falling back to the whole row
NEG_INF = -jnp.inf
STOP_ID_SLOTS = 32  # per row: the stop ids min_tokens bans (a request's stop_token_ids, then the EOS ids)


@struct.dataclass
class SamplingArrays:
    """Per-row parameters; B rows."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, <= 0 = off
    top_p: jax.Array  # [B] f32, 1 = off
    min_p: jax.Array  # [B] f32, 0 = off
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32, 1 = off
    seeds: jax.Array  # [B] u32
    counters: jax.Array  # [B] i32, tokens generated so far by the request
    history: jax.Array  # [B, H] i32, prompt + output ids, -1 padded
    prompt_lens: jax.Array  # [B] i32, history[:, :prompt_len] is the prompt
    logprobs: jax.Array  # [B] bool, the request wants logprobs
    bias_ids: jax.Array  # [B, NB] i32, logit_bias token ids, -1 padded (NB = SamplingParams.MAX_LOGIT_BIAS)
    bias_values: jax.Array  # [B, NB] f32, the bias of each id (0 in the padding)
    # vLLM's min_tokens: stop_ids (EOS unless ignored, and stop_token_ids; -1 padded) cannot be
    # sampled while counters < min_tokens. None (arrays made without them): no such stage.
    min_tokens: jax.Array | None = None  # [B] i32, 0 = off
    stop_ids: jax.Array | None = None  # [B, NS] i32


@struct.dataclass
class SampleOutput:
    """Logprob fields are zeros when no row of the batch asked for logprobs."""

    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, raw logprob of the chosen token
    top_ids: jax.Array  # [B, NUM_TOP_LOGPROBS] i32
    top_logprobs: jax.Array  # [B, NUM_TOP_LOGPROBS] f32


def argmax(x: jax.Array) -> jax.Array:
    """First index of the row maximum, [B, V] -> [B] i32.

    Two plain reductions instead of jnp.argmax's (value, index) reduction, which XLA's
    CPU backend runs about 4x slower on a [64, 49152] batch of logits.
    """
    V = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def apply_penalties(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] -> penalised logits [B, V]."""
    B, V = logits.shape
    H = s.history.shape[1]
    rows = jnp.arange(B)[:, None]
    valid = s.history >= 0
    ids = jnp.where(valid, s.history, V)  # V is out of range: dropped
    is_output = jnp.arange(H)[None, :] >= s.prompt_lens[:, None]
    counts = jnp.zeros((B, V), jnp.float32).at[rows, ids].add((valid & is_output).astype(jnp.float32), mode="drop")
    seen = jnp.zeros((B, V), jnp.bool_).at[rows, ids].set(True, mode="drop")
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - s.frequency_penalty[:, None] * counts - s.presence_penalty[:, None] * (counts > 0)


def apply_logit_bias(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] + each row's sparse bias -> [B, V]."""
    B, V = logits.shape
    ids = jnp.where(s.bias_ids >= 0, s.bias_ids, V)  # V is out of range: dropped
    return logits.at[jnp.arange(B)[:, None], ids].add(s.bias_values, mode="drop")


def _held(s: SamplingArrays) -> jax.Array:
    """[B] bool: the row has made fewer than its min_tokens, so its stop ids are banned."""
    if s.min_tokens is None:
        return jnp.zeros(s.counters.shape, jnp.bool_)
    return s.counters < s.min_tokens


def apply_min_tokens(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] with each held row's stop ids at -inf."""
    B, V = logits.shape
    ids = jnp.where((s.stop_ids >= 0) & _held(s)[:, None], s.stop_ids, V)  # V is out of range: dropped
    return logits.at[jnp.arange(B)[:, None], ids].set(NEG_INF, mode="drop")


def _processed(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """The penalties, the bias and min_tokens, each skipped when no row asks for it."""
    logits = jax.lax.cond(_penalised(s).any(), apply_penalties, lambda x, _: x, logits, s)
    logits = jax.lax.cond(_biased(s).any(), apply_logit_bias, lambda x, _: x, logits, s)
    if s.min_tokens is None:
        return logits
    return jax.lax.cond(_held(s).any(), apply_min_tokens, lambda x, _: x, logits, s)


def _penalised(s: SamplingArrays) -> jax.Array:
    """[B] bool: the row asks for a repetition, presence or frequency penalty."""
    return (s.repetition_penalty != 1) | (s.presence_penalty != 0) | (s.frequency_penalty != 0)


def _biased(s: SamplingArrays) -> jax.Array:
    """[B] bool: the row has a logit bias."""
    return (s.bias_ids >= 0).any(axis=-1)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 [B, V] -> uint32 [B, V] ordered as the floats are (x < y iff key(x) < key(y), NaN aside):
    the sign bit set on positives, every bit flipped on negatives."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _largest_key(keys: jax.Array, weights: jax.Array, at_least: jax.Array) -> jax.Array:
    """Per row, the largest key t with sum(weights where keys >= t) >= at_least: [B] uint32 (0 when
    no key has it). With weights 1 and at_least k, t is the k-th largest key (ties counted); with
    probabilities, the top-p cut. The sum can only fall as t rises, so t is found bit by bit from
    the top: 32 masked row sums instead of a sort."""
    def bit(i, t):
        candidate = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        mass = jnp.sum(jnp.where(keys >= candidate[:, None], weights, 0), axis=-1)
        return jnp.where(mass >= at_least, candidate, t)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:1], jnp.uint32))


def _key_value(t: jax.Array) -> jax.Array:
    """The float32 whose _order_keys key is t, [B] uint32 -> [B] f32; key 0 (every token passes) -> -inf."""
    u = jnp.where(t >> 31 == 1, t & jnp.uint32(0x7FFFFFFF), ~t)
    return jnp.where(t == 0, NEG_INF, jax.lax.bitcast_convert_type(u, jnp.float32))


def _cuts_by_radix(scaled: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """(top-k cut, top-p cut) [B] f32 of every row by radix selection over the logits' bits
    (_largest_key), whatever its k and p: each cut is 32 passes over [B, V], skipped when no
    row of the batch asks for it. The fallback of _filter_threshold."""
    B, V = scaled.shape
    keys = _order_keys(scaled)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)
    none = lambda *_: jnp.zeros((B,), jnp.uint32)  # noqa: E731  (key 0: every token passes)
    k_cut = jax.lax.cond((s.top_k > 0).any(), _largest_key, none, keys, jnp.ones((), jnp.int32), k)  # [B]

    def p_cut(keys, k_cut, top_p):
        probs = jax.nn.softmax(jnp.where(keys >= k_cut[:, None], scaled, NEG_INF), axis=-1)
        return _largest_key(keys, probs, top_p)

    p_cut = jax.lax.cond((s.top_p < 1).any(), p_cut, none, keys, k_cut, s.top_p)
    p_cut = jnp.where(s.top_p < 1, p_cut, 0)  # top_p 1 is off, rounding aside
    return _key_value(k_cut), _key_value(p_cut)


def _cuts_from_candidates(scaled: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(top-k cut, top-p cut, decided) [B] from each row's CANDIDATES largest logits only.

    The k-th largest logit is read off the sorted candidates when k <= CANDIDATES. The top-p cut
    is the first candidate at which the running mass of the top-k distribution (its normaliser:
    one exp-sum over [B, V]) reaches top_p; ties after it stay, as in the radix cut. A row is
    decided when both cuts were found among the candidates: always with top-k <= CANDIDATES
    (its whole distribution is there), and with top-p alone when the model is confident enough."""
    B, V = scaled.shape
    n = min(CANDIDATES, V)
    vals = jax.lax.top_k(scaled, n)[0]  # [B, n], descending
    k_off = (s.top_k <= 0) | (s.top_k >= V)
    kth = jnp.take_along_axis(vals, jnp.clip(s.top_k - 1, 0, n - 1)[:, None], axis=-1)[:, 0]
    k_cut = jnp.where(k_off, NEG_INF, kth)  # for top_k > n a stand-in: the row is undecided
    k_decided = k_off | (s.top_k <= n)

    def p_cut(scaled, vals, k_cut, top_p):
        best = vals[:, :1]
        total = jnp.sum(jnp.where(scaled >= k_cut[:, None], jnp.exp(scaled - best), 0), axis=-1, keepdims=True)
        mass = jnp.cumsum(jnp.where(vals >= k_cut[:, None], jnp.exp(vals - best), 0), axis=-1) / total  # [B, n]
        reached = mass >= top_p[:, None]
        first = jnp.argmax(reached, axis=-1)  # the first True
        cut = jnp.where(top_p < 1, jnp.take_along_axis(vals, first[:, None], axis=-1)[:, 0], NEG_INF)
        return cut, reached.any(axis=-1) | (top_p >= 1)

    p_cut, p_decided = jax.lax.cond((s.top_p < 1).any(), p_cut,
                                    lambda *_: (jnp.full((B,), NEG_INF), jnp.ones((B,), jnp.bool_)),
                                    scaled, vals, k_cut, s.top_p)
    return k_cut, p_cut, k_decided & p_decided


def _filter_threshold(scaled: jax.Array, s: SamplingArrays) -> jax.Array:
    """Smallest scaled logit each row keeps under top-k, then top-p, then min-p: [B].

    Top-k keeps every token at least as large as the k-th largest; top-p then keeps the
    tokens at least as large as the smallest one whose strictly larger tokens hold less than
    top_p of the top-k distribution's mass; min-p those with probability at least min_p times
    the best's; the best token always stays. The cuts are read off each row's CANDIDATES largest
    logits (_cuts_from_candidates) and fall back to radix selection over the whole vocabulary
    (_cuts_by_radix) when a row of the batch needs more: both avoid sorting the vocabulary,
    which took 67 ms per call on our CPU at B = 8, V = 49152 and compiled for a GPU as its
    own sort kernel (about 2 s of every step's compilation). BENCHMARKS.md has the timings.

    The candidates are a CPU path only (lax.platform_dependent picks by the platform a step is
    compiled for, so an AOT compile for a GPU from a CPU host gets the GPU's): a GPU's top-k of
    64 is four rounds of XLA's 16-wide kernel (see top_k), which added 8 % to the GPU AOT check's
    compile time, and no GPU has timed the two against each other yet."""
    def candidates_first(scaled, s):
        k_cut, p_cut, decided = _cuts_from_candidates(scaled, s)
        decided |= s.temperature <= 0  # a greedy row's cuts are not used
        return jax.lax.cond(decided.all(), lambda *_: (k_cut, p_cut), _cuts_by_radix, scaled, s)

    k_cut, p_cut = jax.lax.platform_dependent(scaled, s, cpu=candidates_first, default=_cuts_by_radix)
    return _threshold(scaled, k_cut, p_cut, s.min_p)


def _threshold(scaled: jax.Array, k_cut: jax.Array, p_cut: jax.Array, min_p: jax.Array) -> jax.Array:
    """The smallest logit a row keeps [B]: at least both cuts and min_p times the best token's
    probability (best + log min_p), but never above the best token, which always stays."""
    best = scaled.max(axis=-1)
    return jnp.minimum(jnp.maximum(jnp.maximum(k_cut, p_cut), best + jnp.log(min_p)), best)


def _filtered(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Penalised logits [B, V] -> temperature-scaled logits with what top-k / top-p / min-p
    drop set to -inf: the log of each sampled row's distribution, up to a constant."""
    B, V = logits.shape
    scaled = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    needs_filter = (s.temperature > 0) & ((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0))
    threshold = jax.lax.cond(needs_filter.any(), _filter_threshold,
                             lambda x, _: jnp.full((B,), NEG_INF, x.dtype), scaled, s)
    return jnp.where(scaled >= threshold[:, None], scaled, NEG_INF)


def gumbel_noise(s: SamplingArrays, V: int, stream: int = 0) -> jax.Array:
    """[B, V] noise of row b from fold_in(key(seed_b), counter_b); streams other than 0 (a
    draft model's, speculative decoding's acceptance test) fold in the stream number too,
    so they are independent of the noise that picks the row's token. Made in row chunks on a
    CPU (in_row_chunks: 20 against 9 ms at B = 64, V = 49152)."""
    def one(seed, n):
        key = jax.random.fold_in(jax.random.key(seed), n)
        return jax.random.gumbel(jax.random.fold_in(key, stream) if stream else key, (V,), jnp.float32)

    return in_row_chunks(jax.vmap(one), s.seeds, s.counters)


def in_row_chunks(fn, *args):
    """fn(*args) for a row-wise fn (row b of every output depends on row b of the arguments
    alone; leading axis B everywhere). On a CPU, batches of more than 2 * ROW_CHUNK rows run it
    ROW_CHUNK rows at a time (lax.map), the same bits row by row: XLA's CPU code for [B, V]
    passes falls off a cliff once the working set outgrows the cache: at V = 49152 a greedy
    `sample` took 1 ms at B = 32 and 11 ms at B = 64 in one piece, 3 ms at B = 64 in chunks of 16
    (BENCHMARKS.md, "Sampling on a CPU"). A GPU takes the batch whole: a loop there would
    serialise."""
    B = jax.tree.leaves(args)[0].shape[0]
    if B <= 2 * ROW_CHUNK or B % ROW_CHUNK:
        return fn(*args)

    def chunked(*args):
        split = lambda x: x.reshape(B // ROW_CHUNK, ROW_CHUNK, *x.shape[1:])  # noqa: E731
        out = jax.lax.map(lambda a: fn(*a), jax.tree.map(split, args))
        return jax.tree.map(lambda x: x.reshape(B, *x.shape[2:]), out)

    return jax.lax.platform_dependent(*args, cpu=chunked, default=fn)


def uniform_noise(s: SamplingArrays, stream: int) -> jax.Array:
    """[B] uniform in [0, 1) of row b, from its seed, counter and a stream (see gumbel_noise)."""
    return jax.vmap(lambda seed, n: jax.random.uniform(
        jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), n), stream)))(s.seeds, s.counters)


def _sampled_tokens(logits: jax.Array, s: SamplingArrays, greedy: jax.Array) -> jax.Array:
    """Rows with temperature > 0 draw from their filtered distribution; the rest keep `greedy`."""
    candidates = _filtered(logits, s) + gumbel_noise(s, logits.shape[1])
    return jnp.where(s.temperature > 0, argmax(candidates), greedy)


def probabilities(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] -> [B, V] the distribution `sample` draws row b's token from: after the
    penalties, the bias, min_tokens, the temperature and the filters; one-hot at the argmax of a greedy
    row. Speculative decoding with a draft model compares two of these (engine/speculative.py)."""
    logits = _processed(logits, s)
    one_hot = jax.nn.one_hot(argmax(logits), logits.shape[1], dtype=jnp.float32)
    return jnp.where(s.temperature[:, None] > 0, jax.nn.softmax(_filtered(logits, s), axis=-1), one_hot)


def sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    """logits [B, V] float32 -> next tokens and logprobs.

    A batch of plain greedy rows (no penalty or bias, no temperature, no logprobs), the common
    case of a benchmark or a batch job, takes a branch that is one argmax. Otherwise the
    penalties, the noise and filters, and the logprobs are each skipped (lax.cond) when
    no row asks for them: on a CPU the Gumbel noise alone costs a third of a greedy
    decode step of the default model at B=64. Skipping never changes a row's result,
    because a row that does not ask for a stage is left exactly as it was by it; nor does a
    CPU's sampling a large batch 16 rows at a time (in_row_chunks), as every stage is row-wise.
    """
    return in_row_chunks(_sample, logits, s)


def _sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    plain = ~(_penalised(s) | _biased(s) | _held(s) | (s.temperature > 0) | s.logprobs).any()
    return jax.lax.cond(plain, _plain_greedy, _full_sample, logits, s)


def _plain_greedy(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    chosen, top_lp, top_ids = _no_logprobs(logits, None)
    return SampleOutput(tokens=argmax(logits), logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)


def _full_sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    raw = logits
    logits = _processed(logits, s)
    greedy = argmax(logits)
    tokens = jax.lax.cond((s.temperature > 0).any(), _sampled_tokens, lambda x, _, g: g, logits, s, greedy)
    tokens = tokens.astype(jnp.int32)
    chosen, top_lp, top_ids = jax.lax.cond(s.logprobs.any(), token_logprobs, _no_logprobs, raw, tokens)
    return SampleOutput(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)


def token_logprobs(logits: jax.Array, tokens: jax.Array):
    """Raw log-probabilities of the chosen tokens [B] and the top alternatives [B, N] (values, ids)."""
    return _logprobs_of(jax.nn.log_softmax(logits, axis=-1), tokens)


def ranked_token_logprobs(logits: jax.Array, tokens: jax.Array):
    """token_logprobs and each chosen token's rank in its row [B] (1: the most likely; tokens
    tied with it share its rank), which vLLM's prompt logprobs report: a prompt token is
    often far outside the top alternatives. Only scored prefills pay the extra pass over V."""
    raw = jax.nn.log_softmax(logits, axis=-1)
    chosen, top_lp, top_ids = _logprobs_of(raw, tokens)
    rank = 1 + jnp.sum(raw > chosen[:, None], axis=-1, dtype=jnp.int32)
    return chosen, rank, top_lp, top_ids


def _logprobs_of(raw: jax.Array, tokens: jax.Array):
    top_lp, top_ids = top_k(raw, min(NUM_TOP_LOGPROBS, raw.shape[-1]))
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return chosen, top_lp, top_ids.astype(jnp.int32)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k(x, k) over the last axis (ties: the lower index first), in rounds of at most
    16: XLA's GPU compiler has a top-k kernel for k <= 16 and sorts the whole row above that
    (the vocabulary, once per step, and 2 s of compilation per step). A round masks the ids the
    earlier rounds took with -inf, so a row with fewer than k finite values may repeat an id
    among its -inf alternatives (logprobs come from finite logits)."""
    if k <= TOP_K_ROUND:
        return jax.lax.top_k(x, k)
    vals, ids = jax.lax.top_k(x, TOP_K_ROUND)
    rows = jnp.arange(x.shape[0])[:, None]
    more_vals, more_ids = top_k(x.at[rows, ids].set(NEG_INF), k - TOP_K_ROUND)
    return jnp.concatenate([vals, more_vals], axis=-1), jnp.concatenate([ids, more_ids], axis=-1)


def _no_logprobs(logits: jax.Array, tokens: jax.Array):
    B, V = logits.shape
    n = min(NUM_TOP_LOGPROBS, V)
    return jnp.zeros((B,), jnp.float32), jnp.zeros((B, n), jnp.float32), jnp.zeros((B, n), jnp.int32)
