"""Paths through a small layered graph given in the prompt: a CPU testbed whose correct steps are
genuinely uncertain.

Each step of a trace picks one of several edges, some of which lead into dead ends (nodes from
which the target can no longer be reached). Several choices are right at most steps, so a policy
that solves the task is still unsure of its right steps, and a wrong trace usually holds several
right-but-unsure decisions before the one that made success impossible. That is where segment
credit can pay (benchmarks/results/headroom/); the arithmetic chains' right steps are near-certain.

Format (the tiny character model learns exactly this)::

    prompt      "d:kb k:q b: ... q:\\nd>q?\\n"     one entry per node, "node:successors", in a
                                                  random order; last line "start>target?"
    completion  "d>k\\nk>x\\nx>q\\nA:q"           one move per line, then the answer line

The graph has ``num_steps + 1`` layers: the start alone in layer 0, ``width`` nodes in each later
layer, the target one of the ``width`` nodes of the last layer. Every edge goes from a layer to the
next, so every complete path has exactly ``num_steps`` moves. A node of layers 1..num_steps-1 has
no successor with probability ``dead_end_prob``, else 1..``max_branching`` of them; a node from
which the target cannot be reached is a dead end (possibly several layers before it gets stuck).
Node names are distinct lowercase letters drawn per problem.

Verification: reward 1.0 iff the lines are exactly ``num_steps`` moves ``x>y`` along edges of the
graph, the first from the start, each from where the last one ended, the last ending at the
target, followed by the answer line ``A:<target>`` (trailing whitespace ignored).
``first_error_step`` is the index of the first line after which success is impossible: a line that
is not a move along an edge from the current node, or a move into a node that cannot reach the
target (a dead end); with every move right, the answer line's index if the answer line is wrong or
missing, or the first extra line. -1: no wrong line.

Gold traces pick, at every step, uniformly among the successors that can still reach the target
(seeded by the prompt), so the warm-start learns to spread its choices over the right moves.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

from rredcot.tasks.base import GeneratedTask, Problem, Verdict, register_task, stable_seed

_MOVE_RE = re.compile(r"([a-z])>([a-z])")
_ANSWER_RE = re.compile(r"A:([a-z])")
_ENTRY_RE = re.compile(r"([a-z]):([a-z]*)")
_QUERY_RE = re.compile(r"([a-z])>([a-z])\?")


@dataclass
class GraphPathsParams:
    """Parameters of the graph_paths task (CLI: `--task.<name> <value>`)."""

    num_steps: int = field(
        default=5, metadata={"help": "Moves per path (layers after the start's)."}
    )
    width: int = field(default=3, metadata={"help": "Nodes per layer after the start's."})
    max_branching: int = field(
        default=3, metadata={"help": "Most successors a node has (in the next layer)."}
    )
    dead_end_prob: float = field(
        default=0.3,
        metadata={"help": "Probability that a node between start and last layer has no successor."},
    )
    min_traps: int = field(
        default=2,
        metadata={
            "help": "Problems are redrawn until at least this many nodes on the start's live "
            "paths offer both a live and a dead successor (decisions a trace can get wrong)."
        },
    )
    eval_fraction: float = field(
        default=0.1, metadata={"help": "Share of the problem space held out for evaluation."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the train/eval split."})

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.width < 2:
            raise ValueError(f"width must be >= 2 (a choice per step), got {self.width}")
        if 1 + self.width * self.num_steps > len(string.ascii_lowercase):
            raise ValueError(
                f"1 + width * num_steps = {1 + self.width * self.num_steps} nodes do not fit in "
                "26 letters; lower width or num_steps"
            )
        if not 1 <= self.max_branching <= self.width:
            raise ValueError(
                f"max_branching must be in [1, width={self.width}], got {self.max_branching}"
            )
        if not 0.0 <= self.dead_end_prob < 1.0:
            raise ValueError(f"dead_end_prob must be in [0, 1), got {self.dead_end_prob}")
        if self.min_traps < 0:
            raise ValueError(f"min_traps must be >= 0, got {self.min_traps}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        sample_graph(random.Random(0), self)  # fails now, clearly, if no graph fits


# ---------------------------------------------------------------------------------------------
# Graphs: {node: successors}, start, target
# ---------------------------------------------------------------------------------------------


def live_nodes(edges: dict[str, str], target: str) -> set[str]:
    """Nodes from which ``target`` can be reached (``target`` included)."""
    live = {target}
    changed = True
    while changed:
        changed = False
        for node, succ in edges.items():
            if node not in live and any(s in live for s in succ):
                live.add(node)
                changed = True
    return live


def count_traps(edges: dict[str, str], start: str, live: set[str]) -> int:
    """Live nodes reachable from ``start`` through live nodes that have both a live and a dead
    successor."""
    seen, stack, traps = {start}, [start], 0
    while stack:
        node = stack.pop()
        succ = edges.get(node, "")
        if any(s in live for s in succ) and any(s not in live for s in succ):
            traps += 1
        for s in succ:
            if s in live and s not in seen:
                seen.add(s)
                stack.append(s)
    return traps


def sample_graph(rng: random.Random, p: GraphPathsParams) -> tuple[dict[str, str], str, str]:
    """A layered graph whose start can reach the target, with at least ``p.min_traps`` traps."""
    for _ in range(10_000):
        names = rng.sample(string.ascii_lowercase, 1 + p.width * p.num_steps)
        layers = [names[:1]] + [
            names[1 + i * p.width : 1 + (i + 1) * p.width] for i in range(p.num_steps)
        ]
        edges: dict[str, str] = {}
        for i, layer in enumerate(layers):
            for node in layer:
                if i == p.num_steps or (i > 0 and rng.random() < p.dead_end_prob):
                    edges[node] = ""
                else:
                    k = rng.randint(1, p.max_branching)
                    edges[node] = "".join(sorted(rng.sample(layers[i + 1], k)))
        start, target = layers[0][0], rng.choice(layers[-1])
        live = live_nodes(edges, target)
        if start in live and count_traps(edges, start, live) >= p.min_traps:
            return edges, start, target
    raise ValueError(
        f"no graph with {p.num_steps} steps, width {p.width}, branching {p.max_branching} and "
        f"dead_end_prob {p.dead_end_prob} offers {p.min_traps} traps; lower min_traps"
    )


def format_prompt(edges: dict[str, str], start: str, target: str, rng: random.Random) -> str:
    """``"d:kb k:q ...\\nd>q?\\n"`` with the entries in a random order."""
    nodes = list(edges)
    rng.shuffle(nodes)
    return " ".join(f"{n}:{edges[n]}" for n in nodes) + f"\n{start}>{target}?\n"


def parse_prompt(prompt: str) -> tuple[dict[str, str], str, str] | None:
    """Inverse of :func:`format_prompt`; ``None`` if ``prompt`` is not a graph prompt."""
    lines = prompt.rstrip("\n").split("\n")
    if len(lines) != 2:
        return None
    query = _QUERY_RE.fullmatch(lines[1])
    entries = [_ENTRY_RE.fullmatch(e) for e in lines[0].split(" ")]
    if query is None or any(m is None for m in entries):
        return None
    edges = {m.group(1): m.group(2) for m in entries}
    start, target = query.group(1), query.group(2)
    if start not in edges or target not in edges:
        return None
    return edges, start, target


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------


@register_task("graph_paths")
class GraphPathsTask(GeneratedTask):
    """Walk from the start to the target of a layered graph, one edge per line."""

    Params = GraphPathsParams
    answer_cue = "A:"
    tiny_model_default = True
    # the headroom testbed wants a policy that fails often: 30-60% greedy, not the usual 50-75%
    warmstart_settings = {"target_accuracy": 0.3, "max_accuracy": 0.6}
    params: GraphPathsParams

    def suggested_max_new_tokens(self) -> int:
        """Character tokens: ``"x>y\\n"`` per step, the answer line and room to spare."""
        return 4 * self.params.num_steps + 12

    def draw(self, rng: random.Random, split: str) -> Problem:
        edges, start, target = sample_graph(rng, self.params)
        prompt = format_prompt(edges, start, target, rng)
        return Problem(prompt=prompt, answer=target, meta={"start": start, "split": split})

    # -- gold text ----------------------------------------------------------------------------
    def gold_steps(self, problem: Problem) -> list[str] | None:
        """A path of moves through live nodes, each chosen uniformly among the live successors
        (seeded by the prompt); `None` if the prompt is not a graph prompt."""
        graph = parse_prompt(problem.prompt)
        if graph is None:
            return None
        edges, node, target = graph
        live = live_nodes(edges, target)
        rng = random.Random(stable_seed("gold", problem.prompt))
        lines = []
        while node != target:
            options = [s for s in edges[node] if s in live]
            if not options:
                return None
            nxt = rng.choice(options)
            lines.append(f"{node}>{nxt}")
            node = nxt
        return lines

    # -- checking -----------------------------------------------------------------------------
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Reward from the whole path and the answer line; first error as in the module doc."""
        if not isinstance(completion, str):
            return Verdict(0.0, None, None, f"completion is {type(completion).__name__}, not str")
        graph = parse_prompt(problem.prompt)
        text = completion.rstrip()
        lines = text.split("\n") if text else []
        answer_match = _ANSWER_RE.fullmatch(lines[-1]) if lines else None
        answer = answer_match.group(1) if answer_match else None
        step_lines = lines[:-1] if lines and lines[-1].startswith(self.answer_cue) else lines
        if graph is None:
            reward = float(answer == problem.answer)
            return Verdict(reward, answer, None, "not a graph prompt; steps not checked")
        edges, node, target = graph
        live = live_nodes(edges, target)
        first_error, why = -1, ""
        for i, line in enumerate(step_lines):
            m = _MOVE_RE.fullmatch(line)
            if node == target:
                first_error, why = i, f"extra line {line[:20]!r}"
            elif m is None:
                first_error, why = i, f"not a move: {line[:20]!r}"
            elif m.group(1) != node:
                first_error, why = i, f"moves from {m.group(1)}, the path is at {node}"
            elif m.group(2) not in edges[node]:
                first_error, why = i, f"{node}>{m.group(2)} is not an edge"
            elif m.group(2) not in live:
                first_error, why = i, f"{m.group(2)} cannot reach {target}"
            if first_error >= 0:
                break
            node = m.group(2)
        if first_error < 0 and node != target:
            first_error, why = len(step_lines), "missing move"
        if first_error < 0 and answer != target:
            first_error, why = len(step_lines), "the answer line"
        reward = 1.0 if first_error < 0 and len(step_lines) == len(lines) - 1 else 0.0
        reason = "correct" if reward else f"first wrong line {first_error}: {why}"
        return Verdict(reward, answer, first_error, reason, len(step_lines))
