"""Tree-structured groups: each prompt's ``G`` completions grown as a tree that shares prefixes.

``sampling.tree`` (docs/tree.md). A group starts as ``roots`` independent completions; each round
then picks ``forks_per_round`` branch points among the segment boundaries of the completions so
far (by the policy's next-token entropy there, evenly over depth, or at random) and samples one new
continuation from each, until the group has ``G`` leaves. A branch copies the keys and values of
its prefix from the parent's KV cache (:mod:`rredcot.sampling.decode`'s static cache), so the shared prefix
is neither generated nor prefilled again; the one token it re-feeds (the last token of the prefix,
whose output gives the branch's first next-token distribution) is counted apart.

Every leaf is a full row of the batch (prompt, the shared prefix, its own continuation), so the
credit methods, the loss and the adapters see an ordinary group of ``G`` completions. What the
tree adds is read from the rows themselves (:func:`token_share_counts`, :func:`branch_points`):
how many leaves share each token, and where they part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.sampling.decode import Decoder, check_left_padded, next_token_scores, prefill_prompts

__all__ = ["TreeSample", "branch_points", "pick_forks", "sample_tree", "token_share_counts"]


@dataclass
class _Leaf:
    """One completion of a tree: its tokens (EOS included where it ended), the sampling entropy
    at each position, and where its keys and values are (token ``j`` at column ``first_column +
    j`` of row ``row`` of ``cache``; the last token was never fed, so it has none)."""

    tokens: list[int]
    entropies: list[float]
    cache: object
    row: int
    first_column: int
    candidates: list[int] | None = None  # interior segment boundaries (computed once)


@dataclass
class TreeSample:
    """The leaves of every prompt's tree and what they cost."""

    response_ids: Tensor  # (U * G, T) long, prompt-major, the pad id after each leaf's end
    generated_tokens: int  # tokens sampled, each once (the budget)
    refed_tokens: int  # prefix tokens re-fed at branch points (one per branch at depth >= 1)
    rounds: int  # decoding passes: 1 for the roots, then one per round of forks
    fork_depths: list[int]  # the response position of every branch point taken
    entropies: list[list[float]]  # per row, the sampling distribution's entropy at each token


@dataclass
class _Prompts:
    """The prompts' one prefill, which every round of a tree reads."""

    decoder: Decoder  # the roots' decoder; its cache holds the prompts' keys and values
    logits: Tensor  # (U, V) next-token logits after each prompt
    bias: Tensor  # (U * kv, 1, P) 0 on a prompt's tokens, -inf on its left padding
    last_position: Tensor  # (U,) rotary position of each prompt's last token


def pick_forks(
    candidates: list[tuple[float, int, int, float]],
    count: int,
    rule: str,
) -> list[int]:
    """Indices of ``count`` candidates (fewer if there are fewer) by ``rule``.

    Args:
        candidates: ``(entropy, leaf, position, relative depth)`` per distinct branch point.
        count: branches wanted.
        rule: ``entropy`` (highest next-token entropy first), ``even`` (nearest to the depths
            ``j / (count + 1)``, ``j = 1..count``) or ``random`` (the global torch RNG).
    """
    n = len(candidates)
    if n == 0 or count <= 0:
        return []
    if rule == "entropy":
        order = sorted(range(n), key=lambda i: (-candidates[i][0], candidates[i][1:3]))
        return order[:count]
    if rule == "random":
        return torch.randperm(n).tolist()[:count]
    if rule == "even":
        left, chosen = set(range(n)), []
        for j in range(1, min(count, n) + 1):
            target = j / (count + 1)
            best = min(left, key=lambda i: (abs(candidates[i][3] - target), candidates[i][1:3]))
            chosen.append(best)
            left.remove(best)
        return chosen
    raise ValueError(f"fork rule {rule!r}: use entropy, even or random")


def _entropy(scores: Tensor) -> Tensor:
    """Entropy ``(B,)`` of ``softmax(scores (B, V))`` (-inf scores contribute nothing)."""
    logp = torch.log_softmax(scores, dim=-1)
    return -(logp.exp() * logp).nan_to_num(0.0).sum(-1)


def _grow(
    decoder: Decoder,
    logits: Tensor,
    depths: list[int],
    column: int,
    last_prompt_position: Tensor,
    prompt_bias: Tensor,
    decoded_bias: Tensor | None,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    temperature: float,
    top_p: float,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample every row on from its depth: row ``i`` has ``depths[i]`` response tokens already
    (its prefix), ``logits (B, V)`` give its next token, which is fed at decoded column
    ``column + 1`` (then one column per step). A row stops at EOS or at ``max_new_tokens``
    response tokens. Returns each row's new tokens and their sampling entropies."""
    B, device = logits.shape[0], logits.device
    depth = torch.tensor(depths, dtype=torch.long, device=device)
    room = [max_new_tokens - d for d in depths]
    unfinished = torch.tensor([r > 0 for r in room], dtype=torch.bool, device=device)
    room_t = torch.tensor(room, dtype=torch.long, device=device)
    pad = torch.tensor(pad_token_id, device=device)
    tokens: list[list[int]] = [[] for _ in range(B)]
    entropies: list[list[float]] = [[] for _ in range(B)]
    for s in range(max(room, default=0)):
        scores = next_token_scores(logits, temperature, top_p)
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        entropy = _entropy(scores)
        live = unfinished.tolist()
        chosen, ent = token.tolist(), entropy.tolist()
        for i in range(B):
            if live[i]:
                tokens[i].append(chosen[i])
                entropies[i].append(ent[i])
        token = torch.where(unfinished, token, pad)
        if eos_token_id is not None:
            unfinished &= token != eos_token_id
        unfinished &= s + 1 < room_t
        if not bool(unfinished.any()):
            break
        positions = (last_prompt_position + depth + s + 1)[:, None]
        logits = decoder.step(token[:, None], positions, column + 1 + s, prompt_bias, decoded_bias)
    return tokens, entropies


@torch.no_grad()
def sample_tree(
    policy,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    num_leaves: int,
    roots: int,
    forks_per_round: int,
    fork_rule: str,
    candidates: Callable[[list[int], list[float]], list[int]],
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int | None,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> TreeSample:
    """Grow one tree of ``num_leaves`` completions per left-padded prompt.

    Args:
        input_ids, attention_mask: ``(U, P)`` prompts, padded on the left.
        num_leaves: ``G``, the completions (leaves) per prompt.
        roots: independent completions each tree starts from (``1..G``).
        forks_per_round: branches added per prompt per decoding round.
        fork_rule: ``entropy``, ``even`` or ``random`` (:func:`pick_forks`).
        candidates: ``(tokens, entropies) -> positions``: a finished leaf's segment boundaries
            (response positions ``b``; a branch keeps tokens ``[0, b)`` and samples on from ``b``).
            Positions outside ``1..len - 1`` are ignored.

    Returns:
        :class:`TreeSample`; rows are prompt-major, each prompt's roots first, then its branches in
        the order they were made. Uses the global torch RNG (a seed fixes the tree).
    """
    if not 1 <= roots <= num_leaves:
        raise ValueError(f"roots={roots} must be in 1..num_leaves={num_leaves}")
    mask = attention_mask.bool()
    check_left_padded(mask)
    U, P = input_ids.shape
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    settings = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        temperature=temperature,
        top_p=top_p,
    )
    prompts = _prefill(policy, input_ids, attention_mask, roots, max_new_tokens)
    leaves = _grow_roots(prompts, roots, settings)
    generated = sum(len(leaf.tokens) for tree in leaves for leaf in tree)
    refed = 0
    rounds = 1 if max_new_tokens > 0 else 0
    fork_depths: list[int] = []
    forked: list[set[tuple[int, ...]]] = [set() for _ in range(U)]
    while max_new_tokens > 0 and len(leaves[0]) < num_leaves:
        f = min(forks_per_round, num_leaves - len(leaves[0]))
        plan = [_plan_forks(leaves[u], forked[u], f, fork_rule, candidates) for u in range(U)]
        forks = [(u, parent, b) for u in range(U) for parent, b in plan[u]]
        fork_depths.extend(b for _, _, b in forks if b > 0)
        new_tokens, new_refed = _grow_forks(policy, prompts, leaves, forks, f, P, settings)
        generated += new_tokens
        refed += new_refed
        rounds += 1
    response = _response_ids(leaves, pad_token_id, input_ids.device)
    entropies = [leaf.entropies for tree in leaves for leaf in tree]
    return TreeSample(response, generated, refed, rounds, fork_depths, entropies)


def _prefill(
    policy, input_ids: Tensor, attention_mask: Tensor, roots: int, max_new_tokens: int
) -> _Prompts:
    """One prefill of the ``(U, P)`` left-padded prompts (:func:`rredcot.sampling.decode.prefill_prompts`,
    as :func:`rredcot.sampling.decode.generate` does), in a decoder with room for ``roots`` samples per
    prompt."""
    U, P = input_ids.shape
    decoder = Decoder(policy, U, roots, P, max(max_new_tokens, 1))
    logits, last_position, bias = prefill_prompts(decoder, input_ids, attention_mask)
    return _Prompts(decoder, logits, bias, last_position)


def _grow_roots(prompts: _Prompts, roots: int, settings: dict) -> list[list[_Leaf]]:
    """Each prompt's ``roots`` independent completions (empty ones if ``max_new_tokens`` is 0),
    sampled in the prefill's decoder."""
    first = prompts.decoder
    U = prompts.logits.shape[0]
    if settings["max_new_tokens"] <= 0:
        return [[_Leaf([], [], first.cache, 0, 0) for _ in range(roots)] for _ in range(U)]
    new, ents = _grow(
        first,
        prompts.logits.repeat_interleave(roots, dim=0),
        [0] * (U * roots),
        -1,
        prompts.last_position.repeat_interleave(roots),
        prompts.bias,
        None,
        **settings,
    )
    leaves: list[list[_Leaf]] = [[] for _ in range(U)]
    for i, (toks, ent) in enumerate(zip(new, ents)):
        leaves[i // roots].append(_Leaf(toks, ent, first.cache, i, 0))
    return leaves


def _grow_forks(
    policy,
    prompts: _Prompts,
    leaves: list[list[_Leaf]],
    forks: list[tuple[int, int, int]],
    f: int,
    P: int,
    settings: dict,
) -> tuple[int, int]:
    """One round: sample a continuation from each ``(prompt, parent leaf, depth)`` of ``forks``
    (``f`` per prompt, prompt-major) in a new decoder, and append the new leaves to ``leaves``.
    Returns ``(tokens generated, prefix tokens re-fed)``."""
    depths = [b for _, _, b in forks]
    # row i's prefix tokens [0, b_i - 1) sit in the columns just before `column`, where its
    # token b_i - 1 is re-fed; a row with b_i = 0 starts after it
    column = max(depths) - 1
    decoder, decoded_bias = _branch_decoder(policy, prompts, f, P, column, settings)
    logits, refed = _feed_prefixes(
        decoder, decoded_bias, prompts, leaves, forks, f, column, settings
    )
    new, ents = _grow(
        decoder,
        logits,
        depths,
        column,
        prompts.last_position.repeat_interleave(f),
        prompts.bias,
        decoded_bias,
        **settings,
    )
    generated = 0
    for i, ((u, parent, b), toks, ent) in enumerate(zip(forks, new, ents)):
        src = leaves[u][parent]
        prefix, prefix_ent = src.tokens[:b], src.entropies[:b]
        leaves[u].append(_Leaf(prefix + toks, prefix_ent + ent, decoder.cache, i, column + 1 - b))
        generated += len(toks)
    return generated, refed


def _branch_decoder(
    policy, prompts: _Prompts, f: int, P: int, column: int, settings: dict
) -> tuple[Decoder, Tensor]:
    """A decoder for ``f`` branches per prompt that shares the prompts' cache, with room for
    ``column + 1`` prefix columns (zeroed) before the new tokens; and its decoded-column bias
    ``(columns, U * f * kv, 1)``, all 0 (:func:`_feed_prefixes` hides what a row does not use)."""
    first = prompts.decoder
    U = prompts.logits.shape[0]
    decoder = Decoder(policy, U, f, P, column + 1 + settings["max_new_tokens"])
    decoder.cache.prompt_keys = first.cache.prompt_keys
    decoder.cache.prompt_values = first.cache.prompt_values
    columns = decoder.cache.keys.shape[1]
    # columns a row does not use are hidden by -inf, and -inf + garbage may be NaN: zero them
    decoder.cache.keys[:, : column + 1].zero_()
    decoder.cache.values[:, : column + 1].zero_()
    dtype, device = first.cache.keys.dtype, prompts.bias.device
    decoded_bias = torch.zeros(columns, U * f * first.kv_heads, 1, dtype=dtype, device=device)
    return decoder, decoded_bias


def _feed_prefixes(
    decoder: Decoder,
    decoded_bias: Tensor,
    prompts: _Prompts,
    leaves: list[list[_Leaf]],
    forks: list[tuple[int, int, int]],
    f: int,
    column: int,
    settings: dict,
) -> tuple[Tensor, int]:
    """Copy each branch's prefix keys and values from its parent's cache into the columns before
    ``column``, hide the columns it does not use, and re-feed its last prefix token at
    ``column`` (``f`` branches per prompt). Returns the branches' first next-token logits ``(U * f, V)`` (a new root's are its
    prompt's) and the count of re-fed tokens."""
    kv, device = prompts.decoder.kv_heads, prompts.bias.device
    feed = torch.full((len(forks),), settings["pad_token_id"], dtype=torch.long, device=device)
    row_positions = prompts.last_position.repeat_interleave(f).clone()
    refed = 0
    cache = decoder.cache
    for i, (u, parent, b) in enumerate(forks):
        rows = slice(i * kv, (i + 1) * kv)
        decoded_bias[: column + 1 - b, rows] = float("-inf")
        if b >= 1:
            src = leaves[u][parent]
            n = b - 1
            src_rows = slice(src.row * kv, (src.row + 1) * kv)
            at = src.first_column
            cache.keys[:, column - n : column, rows] = src.cache.keys[:, at : at + n, src_rows]
            cache.values[:, column - n : column, rows] = src.cache.values[:, at : at + n, src_rows]
            feed[i] = src.tokens[b - 1]
            row_positions[i] = prompts.last_position[u] + b
            refed += 1
    if column < 0:  # every branch is a new root
        return prompts.logits.repeat_interleave(f, dim=0), refed
    logits = decoder.step(feed[:, None], row_positions[:, None], column, prompts.bias, decoded_bias)
    root_rows = [i for i, (_, _, b) in enumerate(forks) if b == 0]
    if root_rows:
        idx = torch.tensor(root_rows, device=device)
        logits[idx] = prompts.logits[torch.tensor([forks[i][0] for i in root_rows])]
    return logits, refed


def _response_ids(leaves: list[list[_Leaf]], pad_token_id: int, device) -> Tensor:
    """``(U * G, T)`` the leaves' tokens, prompt-major, right-padded with ``pad_token_id``."""
    rows = [leaf.tokens for tree in leaves for leaf in tree]
    T = max((len(r) for r in rows), default=0)
    response = torch.full((len(rows), T), pad_token_id, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        if r:
            response[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
    return response


def _plan_forks(
    leaves: list[_Leaf],
    forked: set[tuple[int, ...]],
    count: int,
    rule: str,
    candidates: Callable[[list[int], list[float]], list[int]],
) -> list[tuple[int, int]]:
    """``count`` ``(parent leaf, depth)`` branch points for one tree: distinct prefixes not forked
    before, by ``rule``; where the tree offers fewer, prefixes forked before, then new roots
    (depth 0). Records the chosen prefixes in ``forked``."""
    fresh, again, seen = [], [], set()
    for index, leaf in enumerate(leaves):
        if leaf.candidates is None:
            leaf.candidates = sorted(
                {b for b in candidates(leaf.tokens, leaf.entropies) if 0 < b < len(leaf.tokens)}
            )
        for b in leaf.candidates:
            key = tuple(leaf.tokens[:b])
            if key in seen:
                continue
            seen.add(key)
            entry = (leaf.entropies[b], index, b, b / len(leaf.tokens))
            (again if key in forked else fresh).append(entry)
    plan = [fresh[i] for i in pick_forks(fresh, count, rule)]
    plan += [again[i] for i in pick_forks(again, count - len(plan), rule)]
    out = [(index, b) for _, index, b, _ in plan]
    for index, b in out:
        forked.add(tuple(leaves[index].tokens[:b]))
    out += [(0, 0)] * (count - len(out))
    return out


def token_share_counts(response_ids: Tensor, response_mask: Tensor, group_ids: Tensor) -> Tensor:
    """How many rows of its group hold the same tokens up to and including each token.

    Args:
        response_ids: ``(B, T)`` long; response_mask: ``(B, T)``; group_ids: ``(B,)``.

    Returns:
        ``(B, T)`` float, ``>= 1`` on response tokens, 0 on padding. In a tree group a token of
        the shared prefix of ``k`` leaves has count ``k``.
    """
    B, T = response_ids.shape
    lengths = response_mask.bool().sum(-1).tolist()
    ids, groups = response_ids.tolist(), group_ids.tolist()
    node: dict[tuple[int, int, int], int] = {}  # (group, parent node, token) -> node
    rows_nodes: list[list[int]] = []
    count: list[int] = []
    for row in range(B):
        parent, nodes = -1, []
        for t in range(lengths[row]):
            key = (groups[row], parent, ids[row][t])
            if key not in node:
                node[key] = len(count)
                count.append(0)
            parent = node[key]
            count[parent] += 1
            nodes.append(parent)
        rows_nodes.append(nodes)
    out = torch.zeros(B, T, dtype=torch.float)
    for row, nodes in enumerate(rows_nodes):
        if nodes:
            out[row, : len(nodes)] = torch.tensor([float(count[n]) for n in nodes])
    return out.to(response_ids.device)


def branch_points(share_counts: Tensor, response_mask: Tensor) -> list[list[int]]:
    """Per row, the response positions ``b`` (``0 < b < length``) where the leaves that share its
    tokens ``[0, b)`` part: fewer of them share token ``b`` as well. These are the tree's nodes
    on the row's path; the trainer makes each one a segment boundary, so that a node's value is
    read exactly where the leaves below it part.

    Args:
        share_counts: ``(B, T)`` from :func:`token_share_counts`; response_mask: ``(B, T)``.
    """
    lengths = response_mask.bool().sum(-1).tolist()
    counts = share_counts.tolist()
    out = []
    for row, n in enumerate(lengths):
        c = counts[row]
        out.append([b for b in range(1, n) if c[b] < c[b - 1]])
    return out
