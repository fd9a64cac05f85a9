"""Per-variant learning rate: the lr with the highest mean held-out accuracy over training,
averaged over tuning seeds 0 and 1 (each run's learn.json summary).

    python benchmarks/investigations/headroom_choose_lr.py ROOT     # ROOT holds one <name>lr<LR>/learn.json per rate
"""

import collections
import json
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
table = collections.defaultdict(dict)
for learn in sorted(root.glob("*lr*/learn.json")):
    lr = learn.parent.name.split("lr")[-1]
    for row in json.loads(learn.read_text())["summary"]:
        if len(row["seeds"]) == 2:
            table[row["variant"]][lr] = (
                row["mean_accuracy_mean"],
                row["mean_accuracy"],
                row["final_accuracy"],
            )
for v, by_lr in table.items():
    best = max(by_lr, key=lambda lr: by_lr[lr][0])
    print(v, "chosen lr", best)
    for lr, (m, per, fin) in sorted(by_lr.items(), key=lambda kv: float(kv[0])):
        print(f"   lr {lr}: mean acc {m:.4f} per seed {per} final {fin}")
