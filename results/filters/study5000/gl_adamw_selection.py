"""What the tuned AdamW chose on glyphs100: its first 500 samples with the 5,000-sample run's schedule.

Run from the repository root: ``python results/filters/study5000/gl_adamw_selection.py 0 1 2``.
"""

import sys

sys.path.insert(0, "benchmarks")
import common  # noqa: E402

for seed in map(int, sys.argv[1:]):
    args = [
        "--config", "configs/glyphs100_lite0.yaml", "--config", "configs/baselines/adamw_tuned.yaml",
        f"--seed_everything={seed}", f"--data.seed={seed}", "--data.max_samples=5000",
        "--model.lr_scheduler.total_iters=5000", "--trainer.max_steps=500",
    ]  # fmt: skip
    result = common.fit(args)
    print("seed", seed, "steps", result.steps, "acc@500", result.online_acc[-1], "selection:", result.selection)
