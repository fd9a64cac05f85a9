"""The TRL trainers the adapter's tests build: ``make_trainer`` (a tiny Llama on 2-step
arithmetic, two reward functions, CPU) and ``SpyTrainer``, which records TRL's advantages next to
rredcot's. Shared by the tests here and by trl_two_process.py (run as a script from this folder)."""

from __future__ import annotations

from rredcot.integrations.trl import RREDCoTGRPOConfig, RREDCoTGRPOTrainer, task_reward


def arithmetic_prompts():
    """Four 2-step arithmetic problems as a ``datasets.Dataset`` of prompts and answers."""
    from datasets import Dataset

    from rredcot.tasks import get_task

    problems = get_task("arithmetic", num_steps=2).train_problems(4, seed=0)
    return Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])


def digit_share(completions, **kwargs) -> list[float]:
    """Shaping reward in [0, 1] so that an untrained policy's rewards vary within a group."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


class SpyTrainer(RREDCoTGRPOTrainer):
    """Records TRL's own advantages next to rredcot's for every generation batch (rredcot's as
    the loss receives them: written in the loss forward when the credit waits for it)."""

    def _apply_credit(self, inputs, output):
        trl_advantages = output["advantages"].clone()
        output = super()._apply_credit(inputs, output)
        if not hasattr(self, "records"):
            self.records = []
        self.records.append(
            {
                "trl": trl_advantages,
                "ours": output["advantages"].clone(),
                "mask": output["completion_mask"].clone(),
                "batch": self.last_batch,
                "deferred": "rredcot_row" in output,
            }
        )
        return output

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if "rredcot_row" in inputs and self.model.training:
            rec = self.records[-1]
            rec["ours"][inputs["rredcot_row"]] = inputs["advantages"].detach()
        return loss


def make_trainer(model_dir, dataset, out_dir, method="value_head", cls=SpyTrainer, **overrides):
    from rredcot.models import build_char_tokenizer

    credit = {"segmenter": "tokens:4", "handover": {"mode": "off"}, "lam": 0.5}
    credit.update(overrides.pop("credit", {}))
    kwargs = dict(
        output_dir=str(out_dir),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=24,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        reward_weights=[0.5, 0.5],
        credit_method=method,
        credit=credit,
        task="arithmetic",
        task_args={"num_steps": 2},
        disable_tqdm=True,
    )
    reward_funcs = overrides.pop("reward_funcs", None)
    kwargs.update(overrides)
    return cls(
        model=model_dir,
        reward_funcs=reward_funcs or [task_reward("arithmetic", num_steps=2), digit_share],
        args=RREDCoTGRPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=build_char_tokenizer(),
    )
