"""rredcot's verl advantage estimator on one hand-made batch, on a CPU: no GPU, no Ray, no data.

    pip install -c constraints/cpu.txt -e ".[verl]" && pip install --no-deps "verl==0.9.1"
    python examples/verl/cpu_advantages.py

Two rollouts of one prompt (one right, one wrong) with made-up critic values: each segment of a
trace (a line; the answer line joins the last) gets its own advantage, where GRPO gives one per trace. In a verl run the same
estimator is `algorithm.adv_estimator=rredcot` (`run_gsm8k.sh`, docs/scaling.md).
"""

import numpy as np
import torch
from verl import DataProto

import rredcot.integrations.verl as rredcot_verl  # registers adv_estimator "rredcot" in verl
from rredcot.models import build_char_tokenizer

tokenizer = build_char_tokenizer()  # any tokenizer; this one needs no download
texts = ["2+3=5\n5*4=20\nA:20", "2+3=6\n6*4=24\nA:24"]  # one prompt's group: right, wrong
ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
T = max(map(len, ids))
responses = torch.full((2, T), tokenizer.pad_token_id)
mask, rewards = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T)
for row, r in enumerate(ids):
    responses[row, : len(r)], mask[row, : len(r)] = torch.tensor(r), 1
    rewards[row, len(r) - 1] = float(row == 0)  # the outcome reward on the last token
values = torch.linspace(0.2, 0.8, T).repeat(2, 1)  # verl's critic, per token
data = DataProto.from_dict(
    tensors={
        "responses": responses,
        "response_mask": mask,
        "token_level_rewards": rewards,
        "values": values,
    },
    non_tensors={"uid": np.array(["q1", "q1"], dtype=object)},
)
rredcot_verl.compute_advantage_for_data(
    data, tokenizer, {"rredcot": {"credit_method": "critic", "handover": {"mode": "off"}}}
)
print(data.batch["advantages"])  # per token; in a verl run: algorithm.adv_estimator=rredcot
