"""Peak memory of the answer-likelihood probe pass at a real vocabulary size (issue 14, item 4).

A synthetic tiny Llama (``--vocab`` 152,000 like Qwen2.5, hidden 64, 2 layers, random weights)
scores the probes of ``--traces`` gold traces of ``--steps``-step arithmetic, tokenised by a
byte-level BPE trained here. Each measurement runs in a fresh subprocess and reports the rise of
the process's peak resident memory (``resource.getrusage``) over the call, after the model, the
batch and a one-probe warm-up are in memory.

    PYTHONPATH=src python benchmarks/investigations/answer_likelihood_memory.py            # the current code
    PYTHONPATH=src python benchmarks/investigations/answer_likelihood_memory.py --old OLD.py  # another version

``--old`` takes a copy of an earlier ``answer_likelihood.py`` (``git show
5c5fb6b:src/rredcot/methods/answer_likelihood.py > /tmp/old.py``), which scored probes from the
model's full ``(rows, length, vocabulary)`` logits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _measure(args: argparse.Namespace) -> dict:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from rredcot.algebra import credit
    from rredcot.methods.base import RolloutBatch
    from rredcot.sampling.rollout import encode_prompts
    from rredcot.segment import get_segmenter, token_offsets
    from rredcot.tasks import get_task

    torch.set_num_threads(1)
    if args.old:
        spec = importlib.util.spec_from_file_location("old_answer_likelihood", args.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old  # dataclasses look their module up
        spec.loader.exec_module(old)
        build_probes, packed_probe_logprobs = old.build_probes, old.packed_probe_logprobs
    else:
        from rredcot.methods.answer_probes import build_probes
        from rredcot.methods.probe_logprobs import packed_probe_logprobs

    task = get_task("arithmetic", num_steps=args.steps)
    problems = task.train_problems(args.traces, seed=0)
    texts = [task.gold_completion(p) for p in problems]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [p.prompt + task.gold_completion(p) for p in task.train_problems(500, seed=1)]
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<pad>", "<eos>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()

    # the batch: prompts left-padded, gold responses, newline segments
    seg = get_segmenter("newline")
    prompt_ids, prompt_mask = encode_prompts(tok, [p.prompt for p in problems], "cpu")
    rows, bounds = [], []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        b = seg.boundaries(text, token_offsets(tok, ids))
        rows.append(ids + [tok.eos_token_id])
        bounds.append(b[:-1] + [len(ids) + 1])
    T = max(map(len, rows))
    response = torch.full((len(rows), T), tok.pad_token_id)
    mask = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        response[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    batch = RolloutBatch(
        input_ids=torch.cat([prompt_ids, response], 1),
        attention_mask=torch.cat([prompt_mask, mask.long()], 1),
        prompt_len=prompt_ids.shape[1],
        response_mask=mask,
        rewards=torch.ones(len(rows)),
        group_ids=torch.arange(len(rows)),
        boundaries=bounds,
        segment_ids=credit.boundaries_to_segment_ids(bounds, T),
        problems=problems,
        completions=texts,
    )
    probes, _ = build_probes(batch, tok, task, [[p.answer] for p in problems])
    kwargs = {} if args.old else {"logits_mb": args.logits_mb}
    packed_probe_logprobs(model, batch, probes[:1], **kwargs)  # warm-up (and the head check)
    before = _peak_mib()
    out, forwarded = packed_probe_logprobs(model, batch, probes, **kwargs)
    rise = _peak_mib() - before
    lengths = [
        batch.prompt_len
        + max(p.b for p in probes if p.row == r)
        + sum(len(p.ids) for p in probes if p.row == r)
        for r in range(len(rows))
    ]
    scored = sum(len(p.ids) for p in probes)
    return {
        "code": args.old or "current",
        "vocab": args.vocab,
        "traces": len(rows),
        "probes": len(probes),
        "scored_positions": scored,
        "packed_row_tokens": len(rows) * max(lengths),
        "full_logits_mib_fp32": len(rows) * max(lengths) * args.vocab * 4 / 2**20,
        "logits_mb": None if args.old else args.logits_mb,
        "peak_rise_mib": round(rise, 1),
        "checksum": float(sum(float(t.sum()) for t in out)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=152_000)
    parser.add_argument("--traces", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--logits-mb", type=int, default=256)
    parser.add_argument("--old", default=None, help="path of another answer_likelihood.py")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args)))
        return
    cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    print(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
