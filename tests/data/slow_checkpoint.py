"""train.py with the slow parts of a large model's checkpoint and step, for tests/test_reliability.py's signal tests:
SLOW_CHECKPOINT_SECS before the consolidated state dict (FSDP) and the HF export, SLOW_STEP_SECS in every training
step. The patches are made at import, so the ranks that spawn or torchrun start run them too."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fsdp  # noqa: E402
import train  # noqa: E402
import checkpoints  # noqa: E402
import trainers  # noqa: E402


def slow(fn, variable: str):
    def run(*args, **kwargs):
        time.sleep(float(os.environ.get(variable, 0)))
        return fn(*args, **kwargs)

    return run


fsdp.Sharded.full_state_dict = slow(fsdp.Sharded.full_state_dict, "SLOW_CHECKPOINT_SECS")
checkpoints.Checkpoints.export_hf = slow(checkpoints.Checkpoints.export_hf, "SLOW_CHECKPOINT_SECS")
trainers.BasicTrainer.train_step = slow(trainers.BasicTrainer.train_step, "SLOW_STEP_SECS")
if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    sys.exit(train.main(sys.argv[1:]))
