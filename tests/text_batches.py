"""Build a RolloutBatch from given completion texts (gold or error-injected traces) instead of
sampling them: the same layout, verification and segmentation as ``build_rollout_batch``."""

from __future__ import annotations

import torch


def batch_from_texts(
    tokenizer, task, problems, completions, segmenter="newline", group_size=1, cut_rows=()
):
    """``cut_rows``: rows that end without EOS (cut by the token cap); the others end with it."""
    from rredcot.algebra import credit
    from rredcot.sampling.batch import RolloutBatch
    from rredcot.sampling.rollout import encode_prompts, render_prompt
    from rredcot.segment import get_segmenter, segment_completion

    seg = get_segmenter(segmenter) if isinstance(segmenter, str) else segmenter
    prompt_ids, prompt_mask = encode_prompts(
        tokenizer, [render_prompt(p, tokenizer) for p in problems], "cpu"
    )
    P = prompt_ids.shape[1]
    rows, boundaries, char_starts, verdicts = [], [], [], []
    for row, (text, problem) in enumerate(zip(completions, problems)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += [] if row in cut_rows else [tokenizer.eos_token_id]
        bounds, starts, _ = segment_completion(seg, tokenizer, ids, text=text)
        rows.append(ids)
        boundaries.append(bounds)
        char_starts.append(starts)
        verdicts.append(task.verify(problem, text))
    T = max(len(r) for r in rows)
    response = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        response[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = 1
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, response], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        prompt_len=P,
        response_mask=response_mask,
        rewards=torch.tensor([v.reward for v in verdicts], dtype=torch.float),
        group_ids=torch.arange(len(rows)) // group_size,
        boundaries=boundaries,
        segment_ids=credit.boundaries_to_segment_ids(boundaries, T),
        segment_char_starts=char_starts,
        problems=list(problems),
        completions=list(completions),
        verdicts=verdicts,
    )


def traces_batch(tokenizer, task, problems, errors, rng, group_size, **kwargs):
    """:func:`batch_from_texts` of one group per problem: for each entry of ``errors[k]`` (one
    list per problem), problem ``k``'s gold trace (``None``) or the trace with an error injected
    at that line (``task.inject_error(..., rng=rng)``, drawn in row order)."""
    rows, texts = [], []
    for problem, group in zip(problems, errors):
        for line in group:
            rows.append(problem)
            if line is None:
                texts.append(task.gold_completion(problem))
            else:
                texts.append(task.inject_error(problem, line, rng=rng))
    return batch_from_texts(tokenizer, task, rows, texts, group_size=group_size, **kwargs)
