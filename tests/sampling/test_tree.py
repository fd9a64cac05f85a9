"""Tree-structured groups (sampling.tree, rredcot.sampling.tree): the forked KV cache gives the same
distributions as a full forward, the token count, the fork rules, node values on a hand-built
tree, and the loss's count of shared tokens against the estimator written out per tree node."""

from __future__ import annotations

import pytest
import torch

from helpers import micro_config
from metrics_doc import undocumented
from rredcot.algebra import credit
from rredcot.algebra.loss import LossSettings, policy_loss
from rredcot.config import CreditConfig, TrainConfig, TreeSamplingConfig
from rredcot.config.io import from_dict
from rredcot.methods.base import CreditContext, build_credit
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import policy_forward
from rredcot.sampling.rollout import encode_prompts, sample_tree_group, segment_batch
from rredcot.sampling.tree import branch_points, pick_forks, token_share_counts
from rredcot.segment import get_segmenter
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.training.trainer import Trainer, shared_token_weighted
from tiny_lms import lively

PROMPTS = ["1+2=?\n", "12*34+5=?\n"]  # different lengths: left padding


def _grow(policy, tok, rule="entropy", leaves=7, roots=2, forks=2, seed=0, max_new_tokens=20):
    torch.manual_seed(seed)
    tree = TreeSamplingConfig(enabled=True, roots=roots, forks_per_round=forks, fork_rule=rule)
    return sample_tree_group(
        policy,
        tok,
        PROMPTS,
        get_segmenter("tokens:3"),
        tree,
        num_generations=leaves,
        max_new_tokens=max_new_tokens,
    )


@pytest.mark.parametrize("rule", ["entropy", "even", "random"])
def test_forked_cache_gives_the_full_forwards_distributions(tiny_policy, char_tokenizer, rule):
    """Every token of every leaf, branches included, was drawn from the distribution a plain
    forward over [prompt | leaf] gives (entropies equal): the copied prefix cache is right."""
    policy = lively(tiny_policy).eval()
    ids, mask, P, rmask, grown = _grow(policy, char_tokenizer, rule)
    assert ids.shape[0] == len(PROMPTS) * 7
    fwd = policy_forward(policy, ids, mask, P, with_entropy=True)
    for row, ent in enumerate(grown.entropies):
        assert len(ent) == int(rmask[row].sum())
        torch.testing.assert_close(
            fwd.entropy[row, : len(ent)], torch.tensor(ent), atol=1e-4, rtol=0
        )
    # each generated token counted once: the leaves' tokens minus the prefixes they copied
    assert grown.generated_tokens == int(rmask.sum()) - sum(grown.fork_depths)
    assert grown.fork_depths and min(grown.fork_depths) >= 1
    assert grown.rounds == 4  # roots, then 2 + 2 + 1 forks


def test_a_seed_fixes_the_tree(tiny_policy, char_tokenizer):
    policy = lively(tiny_policy).eval()
    first = _grow(policy, char_tokenizer, "random", seed=3)[0]
    again = _grow(policy, char_tokenizer, "random", seed=3)[0]
    other = _grow(policy, char_tokenizer, "random", seed=4)[0]
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_fork_rules_pick_what_they_say():
    # (entropy, leaf, position, relative depth)
    cands = [(0.5, 0, 2, 0.1), (2.0, 0, 6, 0.3), (1.0, 1, 12, 0.6), (0.1, 1, 18, 0.9)]
    assert pick_forks(cands, 2, "entropy") == [1, 2]
    assert pick_forks(cands, 1, "even") == [2]  # nearest to depth 1/2
    assert sorted(pick_forks(cands, 2, "even")) == [1, 2]  # depths 1/3 and 2/3
    torch.manual_seed(0)
    picked = pick_forks(cands, 3, "random")
    assert len(set(picked)) == 3
    assert pick_forks([], 2, "entropy") == []
    with pytest.raises(ValueError, match="entropy, even or random"):
        pick_forks(cands, 1, "widest")


def test_tree_config_is_validated():
    with pytest.raises(ValueError, match="fork_rule"):
        TreeSamplingConfig(fork_rule="widest")
    with pytest.raises(ValueError, match="roots"):
        TreeSamplingConfig(roots=0)
    with pytest.raises(ValueError, match="shared_token_weight"):
        TreeSamplingConfig(shared_token_weight="per_token")
    cfg = TrainConfig()
    cfg.sampling.num_generations = 2
    cfg.sampling.tree = TreeSamplingConfig(enabled=True, roots=3)
    with pytest.raises(ValueError, match="roots=3 is more than"):
        cfg.sampling.__post_init__()


# ---------------------------------------------------------------------------------------------
# a hand-built tree: leaves A = "12\n34", B = "12\n35", C = "19" (each + EOS), rewards 1, 0, 1.
# Its nodes: s_0 and "1" (all three leaves, V = 2/3), "12\n" and "12\n3" (A and B, V = 1/2).

LEAVES = ["12\n34", "12\n35", "19"]
REWARDS = [1.0, 0.0, 1.0]


def _hand_batch(tok) -> RolloutBatch:
    prompt_ids, prompt_mask = encode_prompts(tok, ["1+2=?\n"], "cpu")
    rows = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in LEAVES]
    T = max(map(len, rows))
    response = torch.full((3, T), tok.pad_token_id)
    rmask = torch.zeros(3, T)
    for i, r in enumerate(rows):
        response[i, : len(r)] = torch.tensor(r)
        rmask[i, : len(r)] = 1
    P = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids.repeat(3, 1), response], 1)
    attention = torch.cat([prompt_mask.repeat(3, 1), rmask.long()], 1)
    group_ids = torch.zeros(3, dtype=torch.long)
    batch = RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        prompt_len=P,
        response_mask=rmask,
        rewards=torch.tensor(REWARDS),
        group_ids=group_ids,
        boundaries=[[0, int(m.sum())] for m in rmask],
        segment_ids=credit.boundaries_to_segment_ids([[0, int(m.sum())] for m in rmask], T),
        completions=list(LEAVES),
        token_share_counts=token_share_counts(response, rmask, group_ids),
    )
    return segment_batch(batch, tok, get_segmenter("newline"))


# node advantages by hand (lambda 0 at nodes, pass-through between): per leaf, per token
HAND = {
    0: [0.0, -1 / 6, -1 / 6, 0.0, 0.5, 0.5],  # "1" | "2\n" | "3" | "4<eos>"
    1: [0.0, -1 / 6, -1 / 6, 0.0, -0.5, -0.5],
    2: [0.0, 1 / 3, 1 / 3],  # "1" | "9<eos>"
}


def test_share_counts_and_branch_points_of_the_hand_tree(char_tokenizer):
    batch = _hand_batch(char_tokenizer)
    assert batch.token_share_counts[0, :6].tolist() == [3, 2, 2, 2, 1, 1]
    assert batch.token_share_counts[2, :3].tolist() == [3, 1, 1]
    assert branch_points(batch.token_share_counts, batch.response_mask) == [[1, 4], [1, 4], [1]]
    # the newline boundary (3) and the branch points (1, 4) are all segment boundaries
    assert batch.boundaries == [[0, 1, 3, 4, 6], [0, 1, 3, 4, 6], [0, 1, 3]]


def _credit(name, tok, normalization="none"):
    cfg = CreditConfig(normalization=normalization)
    return build_credit(name, cfg, CreditContext(policy=None, tokenizer=tok))


def test_node_values_on_the_hand_tree(char_tokenizer):
    batch = _hand_batch(char_tokenizer)
    out = _credit("node_values", char_tokenizer).compute(batch)
    for row, expected in HAND.items():
        torch.testing.assert_close(out.advantages[row, : len(expected)], torch.tensor(expected))
    # uniform credit ignores the tree: every token R - mean over the three leaves
    uniform = _credit("uniform", char_tokenizer).compute(batch)
    torch.testing.assert_close(uniform.advantages[2, :3], torch.full((3,), 1 / 3))
    # group statistics come from the leaves: group_std divides by the std of the 3 rewards
    scaled = _credit("uniform", char_tokenizer, "group_std").compute(batch)
    std = torch.tensor(REWARDS).std()
    torch.testing.assert_close(
        scaled.advantages[2, :3], torch.full((3,), (1 / 3) / float(std)), atol=1e-3, rtol=1e-3
    )


@pytest.mark.parametrize("rule", ["per_leaf", "per_node"])
def test_loss_gradient_is_the_per_node_estimator(tiny_policy, char_tokenizer, rule):
    """The loss's gradient on the hand tree (ratio 1, token mean) against the estimator written
    out over the tree's distinct tokens: ``-(1/N) sum_nodes c_n A_n grad log pi(token_n)``, with
    ``c_n`` the number of leaves through the token (per_leaf) or 1 (per_node)."""
    policy = lively(tiny_policy)
    batch = _hand_batch(char_tokenizer)
    advantages = _credit("node_values", char_tokenizer).compute(batch).advantages
    weighted = shared_token_weighted(advantages, batch, rule)
    params = [p for p in policy.parameters() if p.requires_grad]
    fwd = policy_forward(policy, batch.input_ids, batch.attention_mask, batch.prompt_len)
    N = float(batch.response_mask.sum())
    loss, _ = policy_loss(
        fwd.logprobs,
        fwd.logprobs.detach(),
        weighted,
        batch.response_mask,
        LossSettings(
            clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="token_mean", max_len=batch.response_len
        ),
        num_rows=3,
        num_tokens=N,
    )
    got = torch.autograd.grad(loss, params, retain_graph=True)

    # the tree's distinct tokens, each with (row holding it, position, leaves through it, A)
    nodes = [(0, 0, 3, 0.0), (0, 1, 2, -1 / 6), (0, 2, 2, -1 / 6), (0, 3, 2, 0.0)]
    nodes += [(0, 4, 1, 0.5), (0, 5, 1, 0.5), (1, 4, 1, -0.5), (1, 5, 1, -0.5)]
    nodes += [(2, 1, 1, 1 / 3), (2, 2, 1, 1 / 3)]
    assert sum(c for _, _, c, _ in nodes) == N  # every leaf token is one of these
    target = 0.0
    for row, t, leaves_through, adv in nodes:
        weight = leaves_through if rule == "per_leaf" else 1
        target = target - weight * adv * fwd.logprobs[row, t] / N
    want = torch.autograd.grad(target, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# end to end: one training step with tree groups for every credit method family


class _TreeParityTask(ArithmeticTask):
    """Reward 1 for completions of even length: varied rewards even from a random policy."""

    def verify(self, problem, completion):
        return Verdict(float(len(completion) % 2 == 0), None, None, "parity")


register_task("test_tree_parity")(_TreeParityTask)

FAMILIES = {
    "uniform": {},
    "node_values": {},
    "value_head": {},
    "answer_likelihood": {},
    "monte_carlo": {"monte_carlo": {"rollouts": 2, "max_boundaries": 2}},
    "process_reward": {"process_reward": {"function": "prm_scores:chain_scores"}},
    "gradient": {},
    "first_last": {},
}


@pytest.mark.parametrize("method", sorted(FAMILIES))
def test_a_tree_step_trains_with_every_method_family(init_dir, tmp_path, method):
    cfg = micro_config(
        init_dir,
        tmp_path / "run",
        task="test_tree_parity",
        credit_method=method,
        steps=1,
        credit=from_dict(CreditConfig, FAMILIES[method]),
    )
    cfg.sampling.max_new_tokens = 12
    cfg.sampling.tree = TreeSamplingConfig(enabled=True, roots=1, forks_per_round=2)
    cfg.credit.segmenter = "tokens:3"
    torch.manual_seed(0)
    record = Trainer(cfg, log=lambda *_: None).train_step(1)
    assert record["rollout/tree_rounds"] == 3  # 1 root, then 2 + 1 branches per prompt
    assert 0 < record["rollout/tree_shared_fraction"] < 1
    assert record["rollout/tokens"] < record["rollout/tree_leaf_tokens"]
    assert record["tokens_generated"] == record["rollout/tokens"]
    assert torch.isfinite(torch.tensor(record["policy_loss"]))
    assert undocumented(set(record)) == []  # every key, the tree's too, is in docs/metrics.md
    if method not in ("uniform", "gradient", "first_last"):  # values: the tree's nodes are used
        assert record["credit/node_boundary_fraction"] > 0


def test_tree_groups_refuse_a_model_the_fast_decoder_cannot_fork(tmp_path, char_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from rredcot.errors import UserError

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(char_tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    )
    model.save_pretrained(tmp_path / "gpt2")
    char_tokenizer.save_pretrained(tmp_path / "gpt2")
    cfg = micro_config(tmp_path / "gpt2", tmp_path / "run", steps=1)
    cfg.sampling.tree = TreeSamplingConfig(enabled=True)
    with pytest.raises(UserError, match="sampling.tree needs rredcot's fast decoder.*gpt2"):
        Trainer(cfg, log=lambda *_: None)
