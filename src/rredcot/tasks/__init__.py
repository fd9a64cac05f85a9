"""Tasks: problems, prompts, verifiers.

Built-in tasks are imported on first use (`get_task(name)`), so a task whose module needs an
optional extra (datasets, reasoning-gym) costs nothing until it is asked for. A task module
registers itself with `@register_task("name")`; add one `register_lazy_task` line below for it.
"""

from rredcot.tasks.base import (
    NoParams,
    Problem,
    Task,
    Verdict,
    describe_params,
    get_task,
    get_task_class,
    list_tasks,
    make_params,
    register_lazy_task,
    register_task,
    safe_verify,
)

register_lazy_task("arithmetic", "rredcot.tasks.arithmetic")
register_lazy_task("dataset", "rredcot.tasks.dataset")
register_lazy_task("gsm8k", "rredcot.tasks.dataset")
register_lazy_task("graph_paths", "rredcot.tasks.graph_paths")
register_lazy_task("reasoning_gym", "rredcot.tasks.reasoning_gym")
register_lazy_task("word_problems", "rredcot.tasks.word_problems")

__all__ = [
    "NoParams",
    "Problem",
    "Task",
    "Verdict",
    "describe_params",
    "get_task",
    "get_task_class",
    "list_tasks",
    "make_params",
    "register_lazy_task",
    "register_task",
    "safe_verify",
]
